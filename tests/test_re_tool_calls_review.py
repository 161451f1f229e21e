"""Review R-E of the simulated model's tool calls (H203, 6dec3f9) against vLLM 0.33: the
shapes a call is answered in, read off vLLM's chat and Responses serving."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest
from openai.types.responses import ResponseCompletedEvent, ResponseFunctionToolCall

from cachecore.replica.toolcalls import CALL_MARKER
from tests.test_responses_replica import replica

pytestmark = pytest.mark.timeout(60)

_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
_CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": _PARAMS}}
_RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": _PARAMS}


async def test_call_ids_are_vllms_random_uuid() -> None:
    # vLLM 0.33 make_tool_call_id: f"chatcmpl-tool-{random_uuid()}", and a function_call
    # item fc_{random_uuid()} (responses/utils build_response_output_items,
    # streaming_events emit_simple_tool_call_open); random_uuid (vllm/utils) is 16 hex
    async with replica() as (h, _, model):
        msgs = [{"role": "user", "content": "the weather?"}]
        body = {"model": model, "messages": msgs, "tools": [_CHAT_TOOL], "tool_choice": "required"}
        r = await h.post("/v1/chat/completions", json=body)
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call["id"]), call["id"]
        rbody = {"model": model, "input": "x", "tools": [_RESP_TOOL], "tool_choice": "required"}
        (item,) = (await h.post("/v1/responses", json=rbody)).json()["output"]
        assert re.fullmatch(r"fc_[0-9a-f]{16}", item["id"]), item["id"]
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", item["call_id"]), item["call_id"]


async def _chat_stream_calls(h: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str]:
    """A streamed chat call's name and arguments, its chunks joined."""
    name, args = "", ""
    async with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for tc in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls", []):
                name += tc.get("function", {}).get("name") or ""
                args += tc.get("function", {}).get("arguments") or ""
    return name, args


async def test_a_property_name_outside_ascii_streams_its_call() -> None:
    # the Hermes block was dumped with ensure_ascii (escaped), its arguments without:
    # PlannedCall.arguments_at's text.index raised ValueError in the middle of the stream
    params = {"type": "object", "properties": {"城市": {"type": "string"}, "天数": {}}}
    tool = {"type": "function", "function": {"name": "天气", "parameters": params}}
    marked = [{"role": "user", "content": f"天气? {CALL_MARKER}"}]
    async with replica() as (h, sdk, model):
        body = {"model": model, "messages": marked, "tools": [tool]}
        r = await h.post("/v1/chat/completions", json=body)
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert set(json.loads(call["function"]["arguments"])) == {"城市", "天数"}
        streamed = await _chat_stream_calls(h, body)
        assert streamed == ("天气", call["function"]["arguments"])
        resp_tool: Any = {"type": "function", "name": "天气", "parameters": params}
        stream = await sdk.responses.create(
            model=model, input=f"天气? {CALL_MARKER}", tools=[resp_tool], stream=True
        )
        events = [e async for e in stream]
        last = events[-1]
        assert isinstance(last, ResponseCompletedEvent)
        (item,) = last.response.output
        assert isinstance(item, ResponseFunctionToolCall)
        assert set(json.loads(item.arguments)) == {"城市", "天数"}


async def test_a_forced_call_answers_empty_content_an_auto_one_null() -> None:
    # vLLM 0.33 assemble_chat_message_fields (chat_completion/message_assembly.py): for
    # "required" or a named tool_choice content = content or "" after the parser's None;
    # "auto" keeps the Hermes parser's None (no text before <tool_call>)
    async with replica() as (h, sdk, model):
        base = {"model": model, "tools": [_CHAT_TOOL]}
        msgs = [{"role": "user", "content": "the weather?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, content in (("required", ""), (named, "")):
            r = await h.post(
                "/v1/chat/completions", json={**base, "messages": msgs, "tool_choice": choice}
            )
            message = r.json()["choices"][0]["message"]
            assert message["tool_calls"] and message["content"] == content, (choice, message)
        marked = [{"role": "user", "content": f"the weather? {CALL_MARKER}"}]
        r = await h.post("/v1/chat/completions", json={**base, "messages": marked})
        message = r.json()["choices"][0]["message"]
        assert message["tool_calls"] and message["content"] is None
        got = await sdk.chat.completions.create(
            model=model, messages=msgs, tools=[_CHAT_TOOL], tool_choice="required"
        )  # type: ignore[call-overload]
        assert got.choices[0].message.content == ""


async def test_the_response_echoes_its_tools_and_tool_choice() -> None:
    # vLLM 0.33 ResponsesResponse.from_request: tools=request.tools,
    # tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls
    # (check_tool_usage turns a tool-less "auto" into "none" first)
    async with replica() as (h, sdk, model):
        named = {"type": "function", "name": "get_weather"}
        body = {"model": model, "input": "x", "tools": [_RESP_TOOL], "tool_choice": named}
        got = (await h.post("/v1/responses", json={**body, "parallel_tool_calls": False})).json()
        assert got["tools"] == [_RESP_TOOL] and got["tool_choice"] == named
        assert got["parallel_tool_calls"] is False
        bare = (await h.post("/v1/responses", json={"model": model, "input": "x"})).json()
        assert (bare["tools"], bare["tool_choice"], bare["parallel_tool_calls"]) == (
            [],
            "none",
            True,
        )
        r = await sdk.responses.create(
            model=model, input="x", tools=[_RESP_TOOL], tool_choice="required"
        )  # type: ignore[call-overload]
        assert r.tool_choice == "required" and r.tools[0].name == "get_weather"


async def test_an_auto_call_answered_by_its_result_is_followed_by_text() -> None:
    # the marker in an earlier user message called again after the tool's result: an
    # agent loop under "auto" never ended (a model answers the result; "required" is the
    # way to force a call each turn)
    marked = [{"role": "user", "content": f"the weather? {CALL_MARKER}"}]
    async with replica() as (h, _, model):
        body = {"model": model, "messages": marked, "tools": [_CHAT_TOOL], "max_tokens": 64}
        message = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}
        history = [*marked, {"role": "assistant", "tool_calls": [call]}, result]
        r = await h.post("/v1/chat/completions", json={**body, "messages": history})
        assert r.json()["choices"][0]["message"]["tool_calls"] == []
        # a new user turn with the marker calls again
        again = [*history, {"role": "assistant", "content": "ok"}, *marked]
        r = await h.post("/v1/chat/completions", json={**body, "messages": again})
        assert r.json()["choices"][0]["message"]["tool_calls"]
        # Responses: a chain whose follow-up is the call's output answers a message
        rbody = {"model": model, "tools": [_RESP_TOOL], "max_output_tokens": 64}
        first = (await h.post("/v1/responses", json={**rbody, "input": marked})).json()
        (item,) = first["output"]
        assert item["type"] == "function_call"
        output = {"type": "function_call_output", "call_id": item["call_id"], "output": "sunny"}
        follow = {**rbody, "previous_response_id": first["id"], "input": [output]}
        got = (await h.post("/v1/responses", json=follow)).json()
        assert [o["type"] for o in got["output"]] == ["message"]
