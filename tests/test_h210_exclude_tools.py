"""A pool whose engines run vLLM 0.33 with ``--exclude-tools-when-tool-choice-none`` (H210).
vLLM renders a chat completion's tools as None when its ``tool_choice`` is "none" under
that flag (``OnlineRenderer.render_chat``), and a Responses request's too
(``construct_tool_dicts`` from ``render_responses``); None is no override in
``preprocess_chat``'s ``merge_kwargs``, so the server's default tools (or the request's
kwargs tools) render in their place. ``/tokenize`` never reads it (``create_tokenize``: no
``tool_choice``). The gateway rendered the tools: every such request charged and keyed as
another prompt. Now ``models.<pool>.exclude_tools_when_tool_choice_none`` says it and the
simulated replica takes the flag."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from cachecore.replica.cli import build_settings, configure
from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import ChatOptions, HFTokenizer, ServerChatDefaults, TokenizerError
from policies.schema import PolicyError, parse_policy_text
from tests.test_gateway_support import stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(120)

# prints the tools the template gets: none, an empty list, or each one's name
_HEAD = (
    "{% if tools is none %}<no tools>{% elif tools %}{% for t in tools %}"
    "<tool {{ t.function.name }}: {{ t.function.description }}>{% endfor %}"
    "{% else %}<an empty list of tools>{% endif %}\n"
)
_FN = {
    "name": "get_weather",
    "description": "reads the weather of a city from the forecast service",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
_CHAT_TOOL = {"type": "function", "function": _FN}
_RESP_TOOL = {"type": "function", **_FN}
_DEFAULT_TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "a ledger record"}}
]
_SYSTEM = words(300, 21)


def _messages(user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def _tokens(tok: HFTokenizer, tools: list[Any] | None, user: str = "hello there") -> int:
    opts = None if tools is None else ChatOptions(tools=tools)
    return len(tok.encode(tok.apply_chat_template(_messages(user), True, opts)))


def _replica(model: Path, flag: bool, **extra: Any) -> ReplicaSettings:
    return ReplicaSettings(
        time_scale=0.05,
        tokenizer_dir=str(model),
        exclude_tools_when_tool_choice_none=flag,
        **extra,
    )


def _policy(pool: dict[str, Any]) -> str:
    return f"models: {{default: {json.dumps(pool)}}}\nindex: {{pending_ttl_ms: 1}}\n"


def _body(model: str, endpoint: str, user: str = "hello there", **extra: Any) -> dict[str, Any]:
    if endpoint == "chat":
        tools: dict[str, Any] = {"tools": [_CHAT_TOOL], "tool_choice": "none"}
        return {"model": model, "messages": _messages(user), "max_tokens": 1, **tools, **extra}
    tools = {"tools": [_RESP_TOOL], "tool_choice": "none"}
    return {"model": model, "input": _messages(user), "max_output_tokens": 1, **tools, **extra}


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
@pytest.mark.parametrize("flag", [True, False])
async def test_charged_and_keyed_as_the_engine_renders_tool_choice_none(
    tmp_path: Path, endpoint: str, flag: bool
) -> None:
    """The replica renders a tool_choice "none" request without its tools under the flag,
    with them without it; the gateway's pool says the same, charges that prompt and, on the
    request repeated, predicts the cached tokens the replica reports (a Responses request
    with tool_choice "none" is keyed now: the pool says how its engines render it)."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    want = _tokens(tok, None if flag else [_CHAT_TOOL])
    assert _tokens(tok, None) != _tokens(tok, [_CHAT_TOOL])
    pool: dict[str, Any] = {"tokenizer": "hf", "tokenizer_dir": str(model)}
    if flag:
        pool["exclude_tools_when_tool_choice_none"] = True
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/responses"
    async with (
        stack(count=1, replica=_replica(model, flag), policy=_policy(pool), agents=True) as st,
        st.http() as h,
    ):
        assert st.gw.alignment_problems == []
        body = _body(st.model, endpoint)
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


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
@pytest.mark.parametrize("tokenizer", ["engine_tokenize", "engine_render"])
async def test_an_engine_tokenized_pool_leaves_the_tools_out(
    tmp_path: Path, tokenizer: str, endpoint: str
) -> None:
    """The engine's /tokenize renders the tools whatever tool_choice says, its render
    endpoint as its chat route: the gateway leaves them out of what it sends where the
    pool's engines would (a Responses request is sent to either as its chat)."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    want = _tokens(tok, None)
    pool = {"tokenizer": tokenizer, "exclude_tools_when_tool_choice_none": True}
    async with stack(count=1, replica=_replica(model, True), policy=_policy(pool)) as st:
        async with st.http() as h:
            body = _body(st.model, endpoint)
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/responses"
            r = await h.post(path, json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            prompt = usage["prompt_tokens"] if endpoint == "chat" else usage["input_tokens"]
            assert prompt == want, (prompt, want)
        d = await st.gw.prepare(endpoint, "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == want, (d.prompt_tokens, want)


async def test_responses_built_in_tools_alone_render_the_default_tools(tmp_path: Path) -> None:
    """Review R-F's case: built-in tools alone render [] (laid over the server's default
    tools), but under the flag with tool_choice "none" ``construct_tool_dicts`` returns
    None, so the server's default tools render: the replica runs that prompt and the
    gateway charges it (still unkeyed: built-in tools)."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    defaults, empty = _tokens(tok, _DEFAULT_TOOLS), _tokens(tok, [])
    assert defaults != empty
    kwargs = {"tools": _DEFAULT_TOOLS}
    pool = {
        "tokenizer": "hf",
        "tokenizer_dir": str(model),
        "default_chat_template_kwargs": kwargs,
        "exclude_tools_when_tool_choice_none": True,
    }
    replica = _replica(model, True, default_chat_template_kwargs=kwargs)
    async with stack(count=1, replica=replica, policy=_policy(pool)) as st, st.http() as h:
        base = {"model": st.model, "input": _messages("hello there"), "max_output_tokens": 1}
        for choice, want in (("none", defaults), ("auto", empty)):
            body = {**base, "tools": [{"type": "web_search"}], "tool_choice": choice}
            r = await h.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] == want, (choice, r.text)
            d = await st.gw.prepare("responses", "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == want, (choice, d.prompt_tokens, want)


async def test_tokenize_renders_the_tools_under_the_flag(tmp_path: Path) -> None:
    """vLLM's /tokenize takes no tool_choice (an extra it ignores): the tools render."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    pool = {
        "tokenizer": "hf",
        "tokenizer_dir": str(model),
        "exclude_tools_when_tool_choice_none": True,
    }
    replica = _replica(model, True)
    async with stack(count=1, replica=replica, policy=_policy(pool)) as st, st.http() as h:
        body = {"model": st.model, "messages": _messages("hello there")}
        body.update(tools=[_CHAT_TOOL], tool_choice="none")
        for where in (st.fleet.endpoints[0].url, ""):  # the replica, the gateway
            r = await h.post(f"{where}/tokenize", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["count"] == _tokens(tok, [_CHAT_TOOL]), r.text


def test_the_rule_per_form() -> None:
    """The tools a request renders on a server that excludes them: none for a chat or
    Responses tool_choice "none" (the defaults' tools, or the kwargs' tools, in their
    place), all for another choice, a /tokenize or a server without the flag; a malformed
    tool is still refused."""
    srv = ServerChatDefaults.of({"tools": _DEFAULT_TOOLS}, None, True)
    none = {"tools": [_CHAT_TOOL], "tool_choice": "none"}
    o = ChatOptions.from_body(none, "chat", srv)
    assert o is not None and o.tools == _DEFAULT_TOOLS
    o = ChatOptions.from_body(none, "chat", ServerChatDefaults.of(None, None, True))
    assert o is None
    own = [{"type": "function", "function": {"name": "own"}}]
    o = ChatOptions.from_body({**none, "chat_template_kwargs": {"tools": own}}, "chat", srv)
    assert o is not None and o.tools == own
    for body, form, server in (
        ({**none, "tool_choice": "auto"}, "chat", srv),
        (none, "tokenize", srv),
        (none, "chat", ServerChatDefaults.of({"tools": _DEFAULT_TOOLS})),
    ):
        o = ChatOptions.from_body(body, form, server)  # type: ignore[arg-type]
        assert o is not None and o.tools is not None
        assert o.tools[0]["function"]["name"] == "get_weather", (body, form)
    with pytest.raises(TokenizerError, match="tools"):
        ChatOptions.from_body({"tools": [{"type": "x"}], "tool_choice": "none"}, "chat", srv)


def test_the_pool_field_and_the_replica_flag() -> None:
    pol = parse_policy_text("models: {default: {exclude_tools_when_tool_choice_none: true}}\n")
    assert pol.models.default.chat_defaults.excludes_tools("none")
    assert not pol.models.default.chat_defaults.excludes_tools("auto")
    assert not parse_policy_text("models: {}\n").models.default.chat_defaults.excludes_tools("none")
    with pytest.raises(PolicyError) as err:
        parse_policy_text("models: {pools: {m: {exclude_tools_when_tool_choice_none: maybe}}}\n")
    assert "models.pools.m.exclude_tools_when_tool_choice_none" in str(err.value)
    parser = argparse.ArgumentParser(exit_on_error=False)
    configure(parser)
    s = build_settings(parser.parse_args(["--exclude-tools-when-tool-choice-none"]))
    assert s.chat_defaults().excludes_tools("none")
    assert not build_settings(parser.parse_args([])).chat_defaults().excludes_tools("none")


def test_a_policy_parses_after_the_shared_default_pool_rendered() -> None:
    """The default pool of a policy whose ``models`` has no ``default`` is pydantic's one
    shared instance, whose ``chat_defaults`` (a cached property) a chat computes; a later
    parse of a policy without ``models`` deep-copies it (the field's default): that was a
    TypeError (cannot pickle 'mappingproxy') where a policy reload was expected."""
    defaults = parse_policy_text("models: {}\n").models.default.chat_defaults
    pol = parse_policy_text("index: {pending_ttl_ms: 1}\n")
    assert pol.models.default.chat_defaults == defaults
