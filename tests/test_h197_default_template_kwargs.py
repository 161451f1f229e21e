"""A pool whose engines run vLLM 0.33 with ``--default-chat-template-kwargs`` and
``--reasoning-effort-map`` (H197). vLLM lays the default kwargs under every chat's own
(``ChatParams.with_defaults`` over ``preprocess_chat``'s defaults: chat completions,
Responses, ``/tokenize``; not the pooling chat forms, whose IO processors pass none) and
rewrites a chat completion's or Responses request's effort by the map before
``build_chat_params`` sets ``reasoning_effort`` and ``enable_thinking``. The gateway
rendered without them: such a pool's charges were not its engines' prompts and its prefix
keys never matched their blocks. Now ``models.<pool>.default_chat_template_kwargs`` and
``models.<pool>.reasoning_effort_map`` say them, the simulated replica takes the two flags,
and the expected prompts here are written out by hand from vLLM's merge."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cachecore.replica.cli import build_settings, configure
from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import ChatOptions, HFTokenizer
from policies.schema import PolicyError, parse_policy_text
from tests.test_gateway_support import FAST, stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(120)

# a template that prints the variables the flags set
_HEAD = (
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{% if enable_thinking %}<think>{% endif %}"
    "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}"
    "{% if style is defined %}<style {{ style }}>{% endif %}"
    "{% if cohere_format is defined %}<cf {{ cohere_format }}>{% endif %}\n"
)
_DEFAULTS = {"enable_thinking": False, "style": "terse"}
_EFFORTS = {"high": "max", "medium": "low"}
_SYSTEM = words(300, 5)


def _replica(model: Path) -> ReplicaSettings:
    return ReplicaSettings(
        time_scale=0.05,
        tokenizer_dir=str(model),
        default_chat_template_kwargs=_DEFAULTS,
        reasoning_effort_map=_EFFORTS,
    )


def _policy(model: Path, extra: str = "") -> str:
    pool = {
        "tokenizer": "hf",
        "tokenizer_dir": str(model),
        "default_chat_template_kwargs": _DEFAULTS,
        "reasoning_effort_map": _EFFORTS,
    }
    return f"models: {{default: {json.dumps(pool)}}}\nindex: {{pending_ttl_ms: 1}}\n{extra}"


def _tokens(
    tok: HFTokenizer, messages: list[dict[str, Any]], kw: dict[str, Any] | None, gen: bool = True
) -> int:
    opts = None if kw is None else ChatOptions(template_kwargs=kw)
    return len(tok.encode(tok.apply_chat_template(messages, gen, opts)))


def _messages(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


# (endpoint, request fields besides the conversation, the template variables vLLM passes)
_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("chat", {}, {**_DEFAULTS}),
    # the mapped effort; enable_thinking from it over the default
    (
        "chat",
        {"reasoning_effort": "high"},
        {
            "style": "terse",
            "reasoning_effort": "max",
            "enable_thinking": True,
        },
    ),
    # the request's kwargs over the defaults; its None is no override (the default stands)
    (
        "chat",
        {"chat_template_kwargs": {"style": "long", "enable_thinking": None}},
        {"enable_thinking": False, "style": "long"},
    ),
    # an effort the map does not name passes as it is; the request's enable_thinking stands
    (
        "chat",
        {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}},
        {
            "enable_thinking": False,
            "style": "terse",
            "reasoning_effort": "low",
        },
    ),
    ("responses", {}, {**_DEFAULTS}),
    (
        "responses",
        {"reasoning": {"effort": "medium"}, "chat_template_kwargs": {"style": None}},
        {
            "style": "terse",
            "reasoning_effort": "low",
            "enable_thinking": True,
        },
    ),
]


def _body(model: str, endpoint: str, fields: dict[str, Any], user: str) -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": model, "messages": _messages(user), "max_tokens": 1, **fields}
    return {"model": model, "input": _messages(user), "max_output_tokens": 1, **fields}


@pytest.mark.parametrize("case", range(len(_CASES)))
async def test_charged_and_keyed_as_the_engine_renders_with_the_flags(
    tmp_path: Path, case: int
) -> None:
    """The replica runs vLLM's rendering with the flags; the gateway charges that prompt
    and, on the request repeated, predicts the cached tokens the replica reports."""
    endpoint, fields, kw = _CASES[case]
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/responses"
    want = _tokens(tok, _messages("hello there"), kw)
    assert want != _tokens(tok, _messages("hello there"), None)  # the flags render
    async with (
        stack(count=1, replica=_replica(model), policy=_policy(model), agents=True) as st,
        st.http() as h,
    ):
        assert st.gw.alignment_problems == []
        body = _body(st.model, endpoint, fields, "hello there")
        d = await st.gw.prepare(endpoint, "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == want, (d.prompt_tokens, want)
        got: list[tuple[int, int, int]] = []
        for _ in range(40):  # bounded: until the agent has indexed the first run's blocks
            r = await h.post(path, json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            if endpoint == "chat":
                prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]
            else:
                prompt, cached = usage["input_tokens"], usage["input_tokens_details"]
            predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
            got.append((prompt, predicted, cached["cached_tokens"]))
            if predicted > 0:
                break
            await asyncio.sleep(0.1)
    assert all(p == want for p, _, _ in got), (got, want)
    _, predicted, cached = got[-1]
    assert cached >= 300, got  # the system prompt and more
    assert predicted == cached, got


async def test_tokenize_takes_the_defaults_and_pooling_does_not(tmp_path: Path) -> None:
    """``/tokenize`` with messages lays the defaults under the request's kwargs (it takes
    no effort); an embeddings request's chat form gets none, at the replica and in the
    gateway's size."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    msgs = _messages("hi")
    async with stack(count=1, replica=_replica(model), policy=_policy(model)) as st, st.http() as h:
        url = st.fleet.endpoints[0].url
        r = await h.post(url + "/tokenize", json={"model": st.model, "messages": msgs})
        assert r.status_code == 200, r.text
        assert r.json()["count"] == _tokens(tok, msgs, {**_DEFAULTS})
        body = {"model": st.model, "messages": msgs, "chat_template_kwargs": {"style": "x"}}
        r = await h.post(url + "/tokenize", json=body)
        want = _tokens(tok, msgs, {"enable_thinking": False, "style": "x"})
        assert r.json()["count"] == want
        body = {"model": st.model, "messages": msgs}
        r = await h.post(url + "/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        plain = _tokens(tok, msgs, None, gen=False)
        assert r.json()["usage"]["prompt_tokens"] == plain
        d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == plain


async def test_an_engine_tokenized_pool_maps_the_effort(tmp_path: Path) -> None:
    """An ``engine_tokenize`` pool's chat goes to /tokenize with its effort as template
    kwargs: mapped by the pool's map (the engine's /tokenize maps none), the engine's
    defaults laid under by the engine."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    pool = {"tokenizer": "engine_tokenize", "reasoning_effort_map": _EFFORTS}
    policy = f"models: {{default: {json.dumps(pool)}}}\n"
    async with stack(count=1, replica=_replica(model), policy=policy) as st, st.http() as h:
        body = {**_body(st.model, "chat", {"reasoning_effort": "high"}, "hi")}
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        want = _tokens(tok, _messages("hi"), _CASES[1][2])
        assert r.json()["usage"]["prompt_tokens"] == want
        d = await st.gw.prepare("chat", "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == want


async def test_alignment_check_sees_engines_started_with_other_defaults(tmp_path: Path) -> None:
    """A pool whose policy omits the engines' default kwargs is reported misaligned at
    start-up (the probe chat renders differently), not silently mis-keyed."""
    model = template_model(tmp_path, _HEAD)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    async with stack(count=1, replica=_replica(model), policy=policy) as st:
        problems = st.gw.alignment_problems
        assert problems and all("chat" in p for p in problems), problems


@pytest.mark.parametrize(
    ("pool", "field", "said"),
    [
        ({"default_chat_template_kwargs": [1]}, "default_chat_template_kwargs", "dictionary"),
        (
            {"default_chat_template_kwargs": {"messages": 1}},
            "default_chat_template_kwargs",
            "'messages'",
        ),
        (
            {"default_chat_template_kwargs": {"conversation": 1}},
            "default_chat_template_kwargs",
            "conversation",
        ),
        ({"default_chat_template_kwargs": {"tools": "x"}}, "default_chat_template_kwargs", "array"),
        ({"reasoning_effort_map": {"huge": "max"}}, "reasoning_effort_map", "unknown efforts"),
        ({"reasoning_effort_map": {"high": 1}}, "reasoning_effort_map", "string"),
        (
            {"tokenizer": "engine_tokenize", "default_chat_template_kwargs": {"a": 1}},
            "default_chat_template_kwargs",
            "only with a local tokenizer",
        ),
        (
            {"tokenizer": "engine_render", "reasoning_effort_map": {"high": "max"}},
            "reasoning_effort_map",
            "engine_render",
        ),
    ],
)
def test_invalid_values_are_refused_at_load(pool: dict[str, Any], field: str, said: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_text(f"models: {{pools: {{m: {json.dumps(pool)}}}}}\n")
    assert f"models.pools.m.{field}" in str(err.value), str(err.value)
    assert said in str(err.value), str(err.value)


def test_a_yaml_value_vllm_could_not_be_given_is_refused() -> None:
    with pytest.raises(PolicyError, match="JSON"):
        parse_policy_text("models: {default: {default_chat_template_kwargs: {d: 2024-01-01}}}\n")
    pol = parse_policy_text(
        _policy(Path("/nonexistent"))
        .replace('"hf"', '"builtin"')
        .replace('"tokenizer_dir": "/nonexistent", ', "")
    )
    assert pol.models.default.chat_defaults.effort_map == _EFFORTS


def test_the_replica_takes_the_flags_as_vllm_does() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    configure(parser)
    args = parser.parse_args(
        ["--default-chat-template-kwargs", '{"enable_thinking": false}',
         "--reasoning-effort-map", '{"medium": "low"}']
    )  # fmt: skip
    s = build_settings(args)
    assert s.chat_defaults().kwargs == {"enable_thinking": False, "cohere_format": "cmd4"}
    assert s.chat_defaults().effort_map == {"medium": "low"}
    with pytest.raises(argparse.ArgumentError, match="invalid loads value"):  # vLLM's type
        parser.parse_args(["--reasoning-effort-map", "{not json"])
    with pytest.raises(ValidationError, match="unknown efforts"):
        FAST.model_validate({"reasoning_effort_map": {"huge": "low"}})
    with pytest.raises(ValidationError, match="multiple values"):
        ReplicaSettings(default_chat_template_kwargs={"self": 1})


def test_request_kwargs_override_the_defaults_per_form() -> None:
    """vLLM's merge, form by form: the request's kwargs over the defaults (a None or
    "auto" no override), the request's tools over the defaults' tools and the kwargs' over
    both, the effort mapped; a pooling chat form gets no defaults."""
    from cachecore.tokenizer import ServerChatDefaults

    t1 = [{"type": "function", "function": {"name": "a", "parameters": {}}}]
    t0 = [{"type": "function", "function": {"name": "zero"}}]
    srv = ServerChatDefaults.of({"x": 1, "y": 2, "tools": t0, "documents": [{"d": 1}]}, _EFFORTS)
    o = ChatOptions.from_body({"chat_template_kwargs": {"x": "auto", "y": 3}}, "tokenize", srv)
    assert o is not None and o.tools == t0 and o.documents == [{"d": 1}]
    assert dict(o.template_kwargs or {}) == {"x": 1, "y": 3}
    o = ChatOptions.from_body({"tools": t1, "reasoning_effort": "medium"}, "chat", srv)
    assert o is not None and o.tools is not None and o.tools[0]["function"]["name"] == "a"
    assert (o.template_kwargs or {})["reasoning_effort"] == "low"
    o = ChatOptions.from_body({"tools": t1, "chat_template_kwargs": {"tools": []}}, "chat", srv)
    assert o is not None and o.tools == []
    o = ChatOptions.from_body({"chat_template_kwargs": {"y": 3}}, "pooling", srv)
    assert o is not None and o.tools is None and dict(o.template_kwargs or {}) == {"y": 3}
    # an effort mapped to "auto" is no override of the kwargs' (merge_kwargs)
    auto = ServerChatDefaults.of(None, {"high": "auto"})
    o = ChatOptions.from_body(
        {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "k"}},
        "chat",
        auto,
    )
    assert o is not None and (o.template_kwargs or {})["reasoning_effort"] == "k"
    assert (o.template_kwargs or {})["enable_thinking"] is True
