"""Review R-H of 520e2df / 977e1fb (``--exclude-tools-when-tool-choice-none`` as the pool
field ``exclude_tools_when_tool_choice_none``, and ``ServerChatDefaults`` deep-copying as
itself). A policy's pools cache their ``ServerChatDefaults`` (``ModelPool.chat_defaults``,
the only object cached on a policy model); every request kind on every pool kind reads it,
after which a policy must still deep-copy, pickle and parse/reload in the same process."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from cachecore.tokenizer import ServerChatDefaults
from policies.schema import parse_policy_text
from tests.test_gateway_support import stack
from tests.test_h210_exclude_tools import (
    _CHAT_TOOL,
    _DEFAULT_TOOLS,
    _HEAD,
    _RESP_TOOL,
    _messages,
    _replica,
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
