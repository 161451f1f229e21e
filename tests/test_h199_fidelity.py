"""H199: templates whose compiled code Python refuses, the shared lax-bool reader, /tokenize
and Responses tools: [] over a pool's default tools, and a Responses stream whose engine
request fails (vLLM 0.33 ends the body without a terminal event)."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pydantic import TypeAdapter

from cachecore.laxbool import lax_bool
from cachecore.replica.settings import ReplicaSettings, load_score_template
from cachecore.tokenizer import (
    ChatOptions,
    HFTokenizer,
    ScoreTemplate,
    TokenizerError,
    export_builtin,
    option_param,
)
from gateway.errors import GatewayError
from gateway.tokenization import TokenizerPools, add_generation_prompt, continue_final_message
from policies.schema import PolicyError, parse_policy_text
from tests.test_agent_helpers import counter_total
from tests.test_gateway_support import stack
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(90)

# jinja2 parses these, then Python's compile() refuses the code it generates: a bare
# SyntaxError, not a TemplateSyntaxError (its line the generated code's)
_PYTHON_REFUSED = {
    "{% break %}": "'break' outside loop",
    "{% if x %}{% continue %}{% endif %}": "'continue' not properly in loop",
    "{% macro f(a, a) %}{% endmacro %}": "duplicate argument 'l_1_a' in function definition",
}


@pytest.mark.parametrize("source", sorted(_PYTHON_REFUSED))
def test_a_score_template_python_refuses_is_refused_as_one_that_does_not_parse(
    source: str, tmp_path: Path
) -> None:
    why = _PYTHON_REFUSED[source]
    with pytest.raises(
        TokenizerError, match=f"^score template does not compile: {re.escape(why)}$"
    ):
        ScoreTemplate(source)
    with pytest.raises(PolicyError, match=r"models\.default\.score_template") as exc:
        parse_policy_text(f"models:\n  default:\n    score_template: '{source}'\n")
    assert f"score template does not compile: {why}" in str(exc.value)
    path = tmp_path / "score.jinja"
    path.write_text(source)
    with pytest.raises(ValueError, match=re.escape(f"score template does not compile: {why}")):
        load_score_template(str(path))


@pytest.mark.parametrize("source", sorted(_PYTHON_REFUSED))
async def test_a_chat_template_python_refuses_refuses_the_tokenizer(
    source: str, tmp_path: Path
) -> None:
    why = _PYTHON_REFUSED[source]
    export_builtin(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(source)
    with pytest.raises(TokenizerError, match=f"^chat template does not compile: {re.escape(why)}$"):
        HFTokenizer.from_dir(tmp_path)
    policy = parse_policy_text(
        f"models:\n  default:\n    tokenizer: hf\n    tokenizer_dir: '{tmp_path}'\n"
    )
    async with httpx.AsyncClient() as client:
        problems = await TokenizerPools(client, lambda _m, _t: None).load_hf(policy.models)
    message = f"{str(tmp_path)!r} does not load: chat template does not compile: {why}"
    assert problems == [("models.default.tokenizer_dir", message)]


_LAX_WORDS = ("true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0")


def _lax_values() -> list[object]:
    values: list[object] = [None, True, False, 0, 1, 2, -1, 0.0, 1.0, 0.5, float("nan")]
    values += [b"yes", b"0", "", " ", "1.0", "２", [], {}]
    for word in _LAX_WORDS:
        for case in itertools.product(*[(c.lower(), c.upper()) for c in word]):
            text = "".join(case)
            values += [text, f" {text}", f"{text} ", f"\t{text}\n"]
    rng = random.Random(199)
    alphabet = "truefalsyonTRUEFALSYON01-+. \t"
    values += ["".join(rng.choices(alphabet, k=rng.randint(0, 5))) for _ in range(5000)]
    return values


def _read(reader: Callable[[object], object], value: object) -> tuple[object, ...]:
    try:
        return ("ok", reader(value))
    except (ValueError, GatewayError):  # pydantic's refusal, the gateway's 400
        return ("refused",)


def test_the_shared_lax_bool_reads_as_pydantic_and_the_gateway_readers_with_it() -> None:
    optional, required = TypeAdapter(bool | None), TypeAdapter(bool)
    for value in _lax_values():
        assert _read(lax_bool, value) == _read(optional.validate_python, value), value
        want = _read(required.validate_python, value)
        got = _read(lambda v: add_generation_prompt({"add_generation_prompt": v}), value)
        assert got == want, value
        assert _read(lambda v: continue_final_message({"continue_final_message": v}), value) == (
            want
        )


@pytest.mark.parametrize("flag", [" yes", " no", "no ", 2, "2", "none"])
def test_kwargs_tokenize_reads_add_special_tokens_as_vllms_request_model(flag: object) -> None:
    """vLLM 0.33's chat and /tokenize request models type ``add_special_tokens`` as a bool
    (pydantic, lax): a value it refuses is a 400 naming it before anything renders, where
    the kwargs-tokenize reading stripped whitespace (" no" off, " yes" on) and took any
    other value as on, refusing it as "tokenize with add_special_tokens" instead."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"tokenize": True},
        "add_special_tokens": flag,
    }
    for form in ("chat", "tokenize"):
        with pytest.raises(TokenizerError) as exc:
            ChatOptions.from_body(body, form)
        assert option_param(exc.value) == "add_special_tokens", str(exc.value)
    for ok, on in (("no", False), ("OFF", False), (0, False), (None, False), ("Yes", True)):
        body["add_special_tokens"] = ok
        if on:
            with pytest.raises(TokenizerError, match="tokenize with add_special_tokens"):
                ChatOptions.from_body(body, "chat")
        else:
            ChatOptions.from_body(body, "chat")  # no refusal: a tokenized chat, charged


# prints what the template gets as tools: None, an empty list, or how many
_TOOLS_HEAD = (
    "{% if tools is none %}<none>{% elif tools %}{% for t in tools %}"
    "<tool {{ t.function.name }}: {{ t.function.description }}>{% endfor %}"
    "{% else %}<an empty list of tools>{% endif %}\n"
)
_DEFAULT_TOOLS = {
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "finds a record by its key in the ledger",
                "parameters": None,
            },
        }
    ]
}
_MSGS = [{"role": "user", "content": "hello there"}]


def _tool_count(tok: HFTokenizer, tools: list[Any] | None, gen: bool = True) -> int:
    return len(tok.encode(tok.apply_chat_template(_MSGS, gen, ChatOptions(tools=tools))))


def _defaults_replica(model: Path) -> ReplicaSettings:
    return ReplicaSettings(
        time_scale=0.05, tokenizer_dir=str(model), default_chat_template_kwargs=_DEFAULT_TOOLS
    )


async def test_tokenize_tools_empty_renders_no_tools_over_the_default_tools(
    tmp_path: Path,
) -> None:
    """vLLM 0.33's chat /tokenize (non-Harmony: ``create_tokenize``) hands its ``tools:
    []`` to ``preprocess_chat`` as ``tool_dicts``, whose ``merge_kwargs`` lays it over the
    server's default kwargs (only None and "auto" are no override): the template gets
    ``[]``, not the defaults' tools, nor None (the replica dropped it to None, then took
    the defaults'). The request's own kwargs tools still win over it."""
    model = template_model(tmp_path, _TOOLS_HEAD)
    tok = HFTokenizer.from_dir(model)
    empty, defaults = _tool_count(tok, []), _tool_count(tok, _DEFAULT_TOOLS["tools"])
    assert len({empty, defaults, _tool_count(tok, None)}) == 3
    policy = f"models: {{default: {json.dumps({'tokenizer': 'hf', 'tokenizer_dir': str(model)})}}}"
    async with (
        stack(count=1, replica=_defaults_replica(model), policy=policy) as st,
        st.http() as h,
    ):
        url = st.fleet.endpoints[0].url
        body = {"model": st.model, "messages": _MSGS}
        r = await h.post(f"{url}/tokenize", json=body)
        assert r.status_code == 200 and r.json()["count"] == defaults, r.text
        for where in (url, ""):  # the replica, and through the gateway
            r = await h.post(f"{where}/tokenize", json={**body, "tools": []})
            assert r.status_code == 200 and r.json()["count"] == empty, r.text
        kwargs = {"chat_template_kwargs": {"tools": None}, "tools": []}
        r = await h.post(f"{url}/tokenize", json={**body, **kwargs})
        assert r.json()["count"] == empty, r.text
        kwargs = {"chat_template_kwargs": _DEFAULT_TOOLS, "tools": []}
        r = await h.post(f"{url}/tokenize", json={**body, **kwargs})
        assert r.json()["count"] == defaults, r.text


@pytest.mark.parametrize("tokenizer", ["hf", "engine_tokenize"])
async def test_responses_builtin_tools_alone_render_no_tools_over_the_default_tools(
    tmp_path: Path, tokenizer: str
) -> None:
    """A Responses request whose tools are all of vLLM's built-in types renders ``[]``
    (``construct_tool_dicts``: the function tools of a non-empty list), laid over the
    server's default tools by ``preprocess_chat``; ``tools: []`` itself renders None (the
    defaults' tools). The replica answers so, and the gateway charges it (a local
    tokenizer over the pool's defaults, or the engine's /tokenize with its own)."""
    model = template_model(tmp_path, _TOOLS_HEAD)
    tok = HFTokenizer.from_dir(model)
    empty, defaults = _tool_count(tok, []), _tool_count(tok, _DEFAULT_TOOLS["tools"])
    pool: dict[str, Any] = {"tokenizer": tokenizer}
    if tokenizer == "hf":
        pool.update(tokenizer_dir=str(model), default_chat_template_kwargs=_DEFAULT_TOOLS)
    policy = f"models: {{default: {json.dumps(pool)}}}"
    namespace = {"type": "namespace", "name": "ns", "description": "n", "tools": []}
    cases: list[tuple[list[Any], int]] = [
        ([{"type": "web_search"}], empty),
        ([namespace], empty),
        ([], defaults),
    ]
    async with (
        stack(count=1, replica=_defaults_replica(model), policy=policy) as st,
        st.http() as h,
    ):
        for tools, want in cases:
            body = {"model": st.model, "input": _MSGS, "max_output_tokens": 1, "tools": tools}
            r = await h.post("/v1/responses", json=body)
            assert r.status_code == 200, (tools, r.text)
            assert r.json()["usage"]["input_tokens"] == want, (tools, r.text)
            d = await st.gw.prepare("responses", "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == want, (tools, d.prompt_tokens, want)


def _event_kinds(raw: bytes) -> list[str]:
    """A Responses stream's event types in order: the gateway's own error event (an error
    object, no type) ``gateway_error``, ``[DONE]`` empty."""
    out = []
    for block in raw.strip().split(b"\n\n"):
        data = block.split(b"data: ", 1)[-1]
        obj = orjson.loads(data) if data.startswith(b"{") else {}
        out.append("gateway_error" if "error" in obj else obj.get("type", ""))
    return out


async def _stream_failing(h: httpx.AsyncClient, url: str, body: dict[str, Any], st: Any) -> bytes:
    """POST a Responses stream and fail its engine request at its first output delta (the
    API server stays up); the bytes the client got, to the end of the body or its break."""
    raw = b""
    failed = False
    async with h.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_bytes():
            raw += chunk
            if not failed and b"response.output_text.delta" in raw:
                failed = True
                drv = st.fleet.replicas[0].driver
                for running in list(drv._handles):
                    drv.abort(running, "engine failed")
    assert failed
    return raw


async def test_a_responses_stream_whose_engine_request_fails_breaks_off_as_vllms() -> None:
    """vLLM 0.33's responses_stream_generator answers a GenerationError with an
    ErrorResponse validated as a StreamingResponsesResponse, which raises (no event type
    takes an ``{"error": ...}`` object): the body breaks off after its 200 head, with no
    terminal event and no error event. The replica sent an ``error`` event and ended the
    body cleanly. Through the gateway the client gets the gateway's mid-stream error event
    and [DONE], counted, and the failure held against the replica (passive ejection)."""
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "input": "tell me more", "max_output_tokens": 400}
        body["stream"] = True
        url = st.fleet.endpoints[0].url
        with pytest.raises(httpx.RemoteProtocolError):
            await _stream_failing(h, f"{url}/v1/responses", body, st)
        assert st.gw.pool is not None
        (rep,) = st.gw.pool.all()
        assert rep.consecutive_failures == 0
        raw = await _stream_failing(h, "/v1/responses", body, st)
        kinds = _event_kinds(raw)
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-2:] == ["gateway_error", ""], kinds
        assert not {"error", "response.completed", "response.incomplete"} & set(kinds), kinds
        assert counter_total(st.gw.metrics.upstream_errors, kind="mid_stream") == 1
        assert rep.consecutive_failures == 1
