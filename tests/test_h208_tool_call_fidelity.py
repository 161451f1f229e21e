"""H208: the simulated replica's tool calls against vLLM 0.33's, the differences review R-E
left open (6dec3f9): a call cut by ``max_tokens``, the stream's opening of a call, message
item ids, and the ``tool_choice`` refusals vLLM's chat request model makes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.replica.toolcalls import CALL_MARKER
from cachecore.tokenizer import builtin_tokenizer
from gateway.errors import GatewayError
from tests.test_gateway_support import stack
from tests.test_responses_replica import replica, template_model

pytestmark = pytest.mark.timeout(60)

_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
_CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": _PARAMS}}
_RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": _PARAMS}


async def _events(h: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses stream's events, parsed."""
    out: list[dict[str, Any]] = []
    async with h.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


async def test_message_item_ids_are_vllms_random_uuid() -> None:
    # vLLM 0.33: a message item's id is f"msg_{random_uuid()}" (responses/utils.py,
    # streaming_events.py), random_uuid 16 hex digits
    async with replica() as (h, _, model):
        body = {"model": model, "input": "hello", "max_output_tokens": 4}
        (item,) = (await h.post("/v1/responses", json=body)).json()["output"]
        assert re.fullmatch(r"msg_[0-9a-f]{16}", item["id"]), item["id"]
        ids = {e["item"]["id"] for e in await _events(h, body) if "item" in e}
        assert len(ids) == 1 and re.fullmatch(r"msg_[0-9a-f]{16}", ids.pop()), ids


_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_NO_TOOLS = ("When using `tool_choice`, `tools` must be set.", "tool_choice")
# vLLM 0.33's ChatCompletionRequest.check_tool_usage: (request fields, (message, param))
_REFUSED: list[tuple[dict[str, Any], tuple[str, str]]] = [
    ({"tool_choice": "auto"}, _NO_TOOLS),
    ({"tool_choice": "required", "tools": None}, _NO_TOOLS),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, _NO_TOOLS),
    (
        {"tools": [_CHAT_TOOL], "tool_choice": "any"},
        (
            'Invalid value for `tool_choice`: any! Only named tools, "none", "auto" or '
            '"required" are supported.',
            "tool_choice",
        ),
    ),
    (
        {"tools": [_CHAT_TOOL], "tool_choice": {"type": "function"}},
        (
            f"Invalid value for `function`: `None` in `tool_choice`! {_USAGE}",
            "tool_choice.function",
        ),
    ),
    (
        {"tools": [_CHAT_TOOL], "tool_choice": {"type": "function", "function": {}}},
        (
            f"Expected field `name` in `function` in `tool_choice`! {_USAGE}",
            "tool_choice.function.name",
        ),
    ),
    (
        {"tools": [_CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": ""}}},
        (
            f"Invalid `name` in `function`: `` in `tool_choice`! {_USAGE}",
            "tool_choice.function.name",
        ),
    ),
    (
        {"tools": [_CHAT_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        (
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        ),
    ),
]


async def test_tool_choice_refused_as_vllm_by_gateway_before_charge_and_replica(
    tmp_path: Path,
) -> None:
    model = str(template_model(tmp_path, ""))
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    settings = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    msgs = [{"role": "user", "content": "the weather?"}]
    async with stack(count=1, replica=settings, policy=policy) as st:
        url = st.fleet.endpoints[0].url
        async with httpx.AsyncClient(timeout=30.0) as h:
            for fields, (message, param) in _REFUSED:
                body = {"model": st.model, "messages": msgs, "max_tokens": 4, **fields}
                for where in (st.url, url):
                    r = await h.post(where + "/v1/chat/completions", json=body)
                    assert r.status_code == 400, (where, fields, r.text)
                    err = r.json()["error"]
                    assert (err["message"], err["param"]) == (message, param), (where, r.text)
                # refused before the decision: no charge, no routing
                with pytest.raises(GatewayError):
                    await st.gw.prepare("chat", "anonymous", dict(body), {}, "x", True)
            # what vLLM serves: none or null without tools, a named tool that exists
            for fields in (
                {"tool_choice": "none"},
                {"tool_choice": None},
                {"tools": [_CHAT_TOOL], "tool_choice": {"type": "function",
                                                        "function": {"name": "get_weather"}}},
            ):  # fmt: skip
                body = {"model": st.model, "messages": msgs, "max_tokens": 4, **fields}
                for where in (st.url, url):
                    r = await h.post(where + "/v1/chat/completions", json=body)
                    assert r.status_code == 200, (where, fields, r.text)


async def _chunks(h: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat stream's chunks (with a usage each), parsed."""
    so = {"include_usage": False, "continuous_usage_stats": True}
    out: list[dict[str, Any]] = []
    stream = {**body, "stream": True, "stream_options": so}
    async with h.stream("POST", "/v1/chat/completions", json=stream) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
    return out


def _tokens_until(text: str, end: int) -> int:
    """How many of ``text``'s tokens it takes to hold its first ``end`` characters."""
    _, offsets = builtin_tokenizer().encode_offsets(text)
    return next(i + 1 for i, (_, e) in enumerate(offsets) if e >= end)


async def test_a_streamed_call_opens_when_the_parser_sees_its_name() -> None:
    # vLLM 0.33 opens a streamed call (its id, type and name) when its parser sees the
    # name: extract_required_tool_call_streaming once the name is whole and the
    # parameters begun, the hermes parser's extract_tool_calls_streaming once its
    # "name": "..." closed (the name alone, the arguments an entry of their own, the
    # delta's content null), extract_named_tool_call_streaming at the first output;
    # outputs before that send no chunk
    msgs = [{"role": "user", "content": f"the weather? {CALL_MARKER}"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with replica() as (h, _, model):
        base = {"model": model, "messages": msgs, "tools": [_CHAT_TOOL]}
        for choice in ("required", "auto", named):
            body = {**base, "tool_choice": choice}
            whole = (await h.post("/v1/chat/completions", json=body)).json()
            (call,) = whole["choices"][0]["message"]["tool_calls"]
            args = call["function"]["arguments"]
            chunks = await _chunks(h, body)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
            assert chunks[1] is calls[0], (choice, chunks[1])  # nothing sent before
            first = calls[0]["choices"][0]["delta"]
            opening = first["tool_calls"][0]
            assert (opening["type"], opening["index"]) == ("function", 0), opening
            assert opening["function"]["name"] == "get_weather"
            n = calls[0]["usage"]["completion_tokens"]
            if choice == "required":
                text = json.dumps([{"name": "get_weather", "parameters": json.loads(args)}])
                assert n == _tokens_until(text, text.index(args) + 1), (n, first)
                assert opening["function"]["arguments"], first  # the parameters begun
                later = [c["choices"][0]["delta"]["tool_calls"][0] for c in calls[1:]]
                assert all(tc["function"]["name"] is None for tc in later), later
            elif choice == "auto":
                block = json.dumps({"name": "get_weather", "arguments": json.loads(args)})
                text = f"<tool_call>\n{block}\n</tool_call>"
                name_end = text.index('"get_weather"') + len('"get_weather"')
                assert n == _tokens_until(text, name_end), (n, first)
                assert first["content"] is None and opening["function"] == {
                    "name": "get_weather"
                }, first
            else:
                assert n == 1, first
            joined = "".join(
                tc["function"].get("arguments") or ""
                for c in calls
                for tc in c["choices"][0]["delta"]["tool_calls"]
            )
            assert joined == args, (choice, joined, args)
            assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


_RESP_NAMED = {"type": "function", "name": "get_weather"}


async def test_a_call_max_tokens_cuts_is_answered_as_vllm_answers_it() -> None:
    # vLLM 0.33, non-streamed (Parser._extract_tool_calls, assemble_chat_message_fields,
    # resolve_finish_reason): a cut named call is its partial arguments, content "",
    # finish length; a cut required list parses to no call, content ""; a cut auto block
    # is the raw text, unless the hermes parser reads it as JSON (cut after its object:
    # the call, content null, finish length). Streamed, each parser sends what it read.
    msgs = [{"role": "user", "content": f"the weather? {CALL_MARKER}"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with replica() as (h, _, model):
        base = {"model": model, "messages": msgs, "tools": [_CHAT_TOOL]}
        whole = await h.post("/v1/chat/completions", json={**base, "tool_choice": "auto"})
        args = whole.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        block = json.dumps({"name": "get_weather", "arguments": json.loads(args)})
        hermes = f"<tool_call>\n{block}\n</tool_call>"
        # named, cut: the partial arguments as the call
        body = {**base, "tool_choice": named, "max_tokens": 4}
        choice = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        partial = call["function"]["arguments"]
        assert partial and args.startswith(partial) and partial != args, partial
        assert (choice["message"]["content"], choice["finish_reason"]) == ("", "length")
        streamed = await _chunks(h, body)
        pieces = [
            tc["function"]["arguments"]
            for c in streamed
            for tc in c["choices"][0]["delta"].get("tool_calls", [])
        ]
        assert (
            "".join(pieces) == partial and streamed[-1]["choices"][0]["finish_reason"] == "length"
        )
        # required, cut: no call, content ""; streamed, nothing before the parameters
        body = {**base, "tool_choice": "required", "max_tokens": 3}
        choice = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["message"]["tool_calls"] == [] and choice["message"]["content"] == ""
        assert choice["finish_reason"] == "length"
        streamed = await _chunks(h, body)
        assert [c["choices"][0]["delta"] for c in streamed[1:]] == [{}], streamed
        assert streamed[-1]["choices"][0]["finish_reason"] == "length"
        # auto, cut mid-block: the raw text; cut after its JSON object: the call
        body = {**base, "tool_choice": "auto", "max_tokens": 5}
        choice = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        text = choice["message"]["content"]
        assert text and hermes.startswith(text) and choice["message"]["tool_calls"] == []
        assert choice["finish_reason"] == "length"
        k = _tokens_until(hermes, len("<tool_call>\n") + len(block))
        body = {**base, "tool_choice": "auto", "max_tokens": k}
        choice = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        assert choice["message"]["content"] is None and choice["finish_reason"] == "length"
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == args
        # auto, streamed, cut right after the name: the call opens, its arguments "{}"
        # (finalize_generation's unstreamed arguments)
        k = _tokens_until(hermes, hermes.index('"get_weather"') + len('"get_weather"'))
        streamed = await _chunks(h, {**base, "tool_choice": "auto", "max_tokens": k})
        deltas = [c["choices"][0]["delta"] for c in streamed[1:]]
        assert len(deltas) == 1 and streamed[-1]["choices"][0]["finish_reason"] == "length"
        assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}


async def test_a_responses_call_max_output_tokens_cuts_is_answered_as_vllm_answers_it() -> None:
    # vLLM 0.33's build_response_output_items: a cut named call is a function_call item
    # with its partial arguments, status incomplete; a cut required one no item; the
    # response incomplete. Streamed (SimpleStreamingEventProcessor): the item as the
    # parser streamed it, closed incomplete, or none; the stream ends response.incomplete
    async with replica() as (h, _, model):
        base = {"model": model, "input": "the weather?", "tools": [_RESP_TOOL]}
        body = {**base, "tool_choice": _RESP_NAMED, "max_output_tokens": 4}
        got = (await h.post("/v1/responses", json=body)).json()
        assert got["status"] == "incomplete", got
        (item,) = got["output"]
        assert (item["type"], item["status"]) == ("function_call", "incomplete"), item
        whole = (await h.post("/v1/responses", json={**body, "max_output_tokens": 100})).json()
        (done,) = whole["output"]
        partial = item["arguments"]
        assert partial and done["arguments"].startswith(partial), (item, done)
        assert partial != done["arguments"], (item, done)
        events = await _events(h, body)
        kinds = [e["type"] for e in events]
        assert kinds[:3] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
        ]
        assert kinds[-3:] == [
            "response.function_call_arguments.done", "response.output_item.done",
            "response.incomplete",
        ], kinds  # fmt: skip
        final = events[-1]["response"]
        assert final["status"] == "incomplete" and final["output"] == [events[-2]["item"]]
        assert events[-2]["item"]["status"] == "incomplete"
        assert events[-2]["item"]["arguments"] == item["arguments"]
        # required, cut before its parameters: no item, streamed or not
        body = {**base, "tool_choice": "required", "max_output_tokens": 3}
        got = (await h.post("/v1/responses", json=body)).json()
        assert (got["status"], got["output"]) == ("incomplete", []), got
        events = await _events(h, body)
        assert [e["type"] for e in events] == [
            "response.created", "response.in_progress", "response.incomplete",
        ]  # fmt: skip
        assert events[-1]["response"]["output"] == []
        stored = (await h.get(f"/v1/responses/{events[-1]['response']['id']}")).json()
        assert stored["output"] == [] and stored["status"] == "incomplete"
