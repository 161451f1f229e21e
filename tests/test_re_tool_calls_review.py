"""Review R-E of the simulated model's tool calls (H203, 6dec3f9) against vLLM 0.33: the
shapes a call is answered in, read off vLLM's chat and Responses serving."""

from __future__ import annotations

import re

import pytest

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
