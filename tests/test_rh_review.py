"""Review R-H of 520e2df / 977e1fb (``--exclude-tools-when-tool-choice-none`` as the pool
field ``exclude_tools_when_tool_choice_none``, and ``ServerChatDefaults`` deep-copying as
itself). A policy's pools cache their ``ServerChatDefaults`` (``ModelPool.chat_defaults``,
the only object cached on a policy model); every request kind on every pool kind reads it,
after which a policy must still deep-copy, pickle and parse/reload in the same process."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from cachecore.responses import render_request
from cachecore.tokenizer import ChatOptions, HFTokenizer, ServerChatDefaults
from policies.schema import parse_policy_text
from tests.test_gateway_support import stack
from tests.test_h210_exclude_tools import (
    _CHAT_TOOL,
    _DEFAULT_TOOLS,
    _HEAD,
    _RESP_TOOL,
    _messages,
    _replica,
    _tokens,
)
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(180)

_KWARGS = {"tools": _DEFAULT_TOOLS, "flavour": "x"}


def _pool(kind: str, model: Path) -> dict[str, Any]:
    pool: dict[str, Any] = {"tokenizer": kind, "exclude_tools_when_tool_choice_none": True}
    if kind != "engine_render":  # that engine maps the efforts it renders
        pool["reasoning_effort_map"] = {"high": "medium"}
    if kind == "hf":  # an engine_* pool's engines lay their own default kwargs
        pool.update(tokenizer_dir=str(model), default_chat_template_kwargs=_KWARGS)
    return pool


def _requests(model: str) -> list[tuple[str, dict[str, Any]]]:
    msgs = _messages("hello there")
    tools = {"tools": [_CHAT_TOOL], "tool_choice": "none"}
    return [
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 1, **tools}),
        ("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 1}),
        (
            "/v1/responses",
            {"model": model, "input": msgs, "max_output_tokens": 1, **tools, "tools": [_RESP_TOOL]},
        ),
        ("/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 1}),
        ("/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": 1}),
        ("/tokenize", {"model": model, "messages": msgs, **tools}),
        ("/tokenize", {"model": model, "prompt": "hello there"}),
        ("/v1/embeddings", {"model": model, "input": "hello there"}),
        ("/v1/embeddings", {"model": model, "messages": msgs}),
        ("/pooling", {"model": model, "messages": msgs}),
        ("/classify", {"model": model, "input": "hello there"}),
        ("/score", {"model": model, "text_1": "a question", "text_2": ["an answer"]}),
        ("/rerank", {"model": model, "query": "a question", "documents": ["an answer"]}),
    ]


def _copies(policy: Any) -> None:
    again = copy.deepcopy(policy)
    assert again == policy
    assert pickle.loads(pickle.dumps(policy)) == policy
    for pool in (again.models.default, *again.models.pools.values()):
        assert pool.chat_defaults == ServerChatDefaults.of(
            pool.default_chat_template_kwargs,
            pool.reasoning_effort_map,
            pool.exclude_tools_when_tool_choice_none,
        )


async def test_a_policy_copies_pickles_and_reloads_after_every_request_kind(
    tmp_path: Path,
) -> None:
    """In one process: the shared default pool (a policy without ``models``) and an hf,
    engine_tokenize and engine_render pool each serve a chat (tool_choice "none" and
    plain), Responses, completion, /tokenize, embeddings (text and chat), pooling,
    classify, score and rerank; then the gateway's policy deep-copies and pickles (equal
    to itself, its cached chat defaults those of its fields), and policies parse, and
    reload through POST /admin/policy, with and without ``models``."""
    model = template_model(tmp_path, _HEAD)
    replica = _replica(model, True, default_chat_template_kwargs=_KWARGS)
    policies: list[str | None] = [None, "index: {pending_ttl_ms: 1}\n"]
    for kind in ("hf", "engine_tokenize", "engine_render"):
        policies.append(f"models: {{default: {json.dumps(_pool(kind, model))}}}\n")
    for text in policies:
        async with stack(count=1, replica=replica, policy=text) as st, st.http() as h:
            for path, body in _requests(st.model):
                r = await h.post(path, json=body)
                assert r.status_code < 500, (text, path, r.text)
            _copies(st.gw.policy)
            for other in policies:
                parse_policy_text(other or "")
                r = await h.post(
                    "/admin/policy", content=other or "{}\n", headers=st.admin_headers()
                )
                assert r.status_code == 200, (text, other, r.text)
                _copies(st.gw.policy)
            _copies(parse_policy_text(""))


def test_server_chat_defaults_copy_and_pickle_equal_and_read_only() -> None:
    """The deep copy is the object (immutable: a frozen dataclass of read-only views);
    a pickled one is equal, its views read-only again."""
    srv = ServerChatDefaults.of(_KWARGS, {"high": "medium"}, True)
    assert copy.deepcopy(srv) is srv
    back = pickle.loads(pickle.dumps(srv))
    assert back == srv and back.bare == srv.bare
    for view in (back.kwargs, back.effort_map, back.under):
        with pytest.raises(TypeError):
            view["x"] = 1
    assert back.bare is not None and back.bare.template_kwargs is not None
    with pytest.raises(TypeError):
        back.bare.template_kwargs["x"] = 1


_NAMED_CHAT = {"type": "function", "function": {"name": "get_weather"}}
_NAMED_RESP = {"type": "function", "name": "get_weather"}


@pytest.mark.parametrize("flag", [True, False])
def test_which_tool_choice_forms_leave_the_tools_out(flag: bool) -> None:
    """vLLM 0.33 drops a chat's tools only for ``request.tool_choice == "none"``
    (``OnlineRenderer.render_chat``; a missing choice with tools is "auto" by
    ``check_tool_usage``) and a Responses request's likewise (``construct_tool_dicts``):
    a named function, "auto", "required", null or a missing choice render them, with the
    flag or without; "none" renders the defaults' tools in their place under the flag."""
    srv = ServerChatDefaults.of({"tools": _DEFAULT_TOOLS}, None, flag)
    forms: list[Any] = ["none", "auto", "required", None, "missing"]
    for choice in [*forms, _NAMED_CHAT]:
        body: dict[str, Any] = {"tools": [_CHAT_TOOL]}
        if choice != "missing":
            body["tool_choice"] = choice
        o = ChatOptions.from_body(body, "chat", srv)
        assert o is not None and o.tools is not None
        dropped = flag and choice == "none"
        name = o.tools[0]["function"]["name"]
        assert name == ("lookup" if dropped else "get_weather"), (choice, name)
        # /tokenize never reads tool_choice
        t = ChatOptions.from_body(body, "tokenize", srv)
        assert t is not None and t.tools is not None
        assert t.tools[0]["function"]["name"] == "get_weather", choice
    for choice in [*forms, _NAMED_RESP]:
        body = {"input": "hi", "tools": [_RESP_TOOL]}
        if choice != "missing":
            body["tool_choice"] = choice
        req = render_request(body, [], None, srv)
        dropped = flag and choice == "none"
        assert (req.tools is None) == dropped, (choice, req.tools)
        assert req.exact, choice


@pytest.mark.parametrize("flag", [True, False])
async def test_responses_tool_choice_none_keyed_exactly_over_default_tools(
    tmp_path: Path, flag: bool
) -> None:
    """D30's change: a Responses request with function tools and tool_choice "none" is
    keyed. On engines with default kwargs tools, the flag renders those in the request's
    tools' place (none: the request's own): the gateway charges the replica's prompt and,
    repeated, predicts the cached tokens the replica reports."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    want = _tokens(tok, _DEFAULT_TOOLS if flag else [_CHAT_TOOL])
    assert _tokens(tok, _DEFAULT_TOOLS) != _tokens(tok, [_CHAT_TOOL])
    kwargs = {"tools": _DEFAULT_TOOLS}
    pool = {
        "tokenizer": "hf",
        "tokenizer_dir": str(model),
        "default_chat_template_kwargs": kwargs,
        "exclude_tools_when_tool_choice_none": flag,
    }
    replica = _replica(model, flag, default_chat_template_kwargs=kwargs)
    policy = f"models: {{default: {json.dumps(pool)}}}\nindex: {{pending_ttl_ms: 1}}\n"
    async with stack(count=1, replica=replica, policy=policy, agents=True) as st, st.http() as h:
        body = {
            "model": st.model,
            "input": _messages("hello there"),
            "max_output_tokens": 1,
            "tools": [_RESP_TOOL],
            "tool_choice": "none",
        }
        d = await st.gw.prepare("responses", "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == want, (d.prompt_tokens, want)
        got: list[tuple[int, int, int]] = []
        for _ in range(40):  # bounded: until the agent has indexed the first run's blocks
            r = await h.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
            cached = usage["input_tokens_details"]["cached_tokens"]
            got.append((usage["input_tokens"], predicted, cached))
            if predicted > 0:
                break
            await asyncio.sleep(0.1)
    assert all(p == want for p, _, _ in got), (got, want)
    _, predicted, cached = got[-1]
    assert cached >= 300 and predicted == cached, got


def test_a_pool_copied_with_new_fields_builds_its_chat_defaults_anew() -> None:
    """``ModelPool.chat_defaults`` is a cached property, which pydantic's ``model_copy``
    copies with the instance's fields: a copy updating the flag or the defaults rendered
    with the original's."""
    pool = parse_policy_text("models: {}\n").models.default
    assert not pool.chat_defaults.excludes_tools("none")
    flagged = pool.model_copy(update={"exclude_tools_when_tool_choice_none": True})
    assert flagged.chat_defaults.excludes_tools("none")
    kw = pool.model_copy(update={"default_chat_template_kwargs": {"tools": _DEFAULT_TOOLS}})
    assert kw.chat_defaults.tools == _DEFAULT_TOOLS
    same = pool.model_copy(deep=True)
    assert same.chat_defaults is pool.chat_defaults  # no new field: the one object
    assert not pool.chat_defaults.excludes_tools("none")
