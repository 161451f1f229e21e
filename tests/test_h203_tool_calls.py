"""The simulated replica's own tool calls (H203): a request offering tools under
``tool_choice`` ``"required"``, a named function, or ``"auto"`` with the marker in its last
user message is answered with a call in vLLM's shapes (chat ``tool_calls``, Responses
``function_call`` items, streamed as vLLM streams them), its output tokens the call's. Then
the agent loops the engine itself produced, end to end through the gateway: the follow-up
turn sent back with the call and its result is charged and predicted as the engine runs it,
and a Responses chain through ``previous_response_id`` whose previous output is a call."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.replica.toolcalls import CALL_MARKER
from cachecore.tokenizer import HFTokenizer, builtin_tokenizer
from tests.test_gateway_support import stack, words
from tests.test_responses_replica import replica, tools_model

pytestmark = pytest.mark.timeout(120)

_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
_CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": _PARAMS}}
_OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
_RESP_TOOL = {"type": "function", "name": "get_weather", "parameters": _PARAMS}


def _tokens(tok: HFTokenizer, text: str) -> int:
    return len(tok.encode(text))


async def test_the_replica_calls_as_vllm_answers_each_tool_choice() -> None:
    async with replica() as (h, _, model):
        tok = builtin_tokenizer()
        msgs = [{"role": "user", "content": "the weather?"}]
        base = {"model": model, "messages": msgs, "tools": [_CHAT_TOOL, _OTHER]}
        # required: the first function, vLLM's structured-output list generated
        r = await h.post("/v1/chat/completions", json={**base, "tool_choice": "required"})
        choice = r.json()["choices"][0]
        # a forced call's content "" (vLLM's assemble_chat_message_fields)
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
        (call,) = choice["message"]["tool_calls"]
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        fn = call["function"]
        args = json.loads(fn["arguments"])
        assert fn["name"] == "get_weather" and args["days"] == 1
        assert args["city"].startswith("city-")
        listed = json.dumps([{"name": fn["name"], "parameters": args}], ensure_ascii=False)
        assert r.json()["usage"]["completion_tokens"] == _tokens(tok, listed)
        # a named choice: that function, its arguments alone generated, finish "stop"
        named = {"type": "function", "function": {"name": "get_time"}}
        r = await h.post("/v1/chat/completions", json={**base, "tool_choice": named})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["tool_calls"][0]["function"] == {
            "name": "get_time",
            "arguments": "{}",
        }
        assert r.json()["usage"]["completion_tokens"] == _tokens(tok, "{}")
        # auto: text unless the last user message holds the marker (then Hermes' block)
        r = await h.post("/v1/chat/completions", json={**base, "max_tokens": 3})
        assert r.json()["choices"][0]["message"]["tool_calls"] == []
        marked = [{"role": "user", "content": f"the weather? {CALL_MARKER}"}]
        r = await h.post("/v1/chat/completions", json={**base, "messages": marked})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        fn = choice["message"]["tool_calls"][0]["function"]
        block = json.dumps({"name": fn["name"], "arguments": json.loads(fn["arguments"])})
        hermes = f"<tool_call>\n{block}\n</tool_call>"
        assert r.json()["usage"]["completion_tokens"] == _tokens(tok, hermes)
        # none, and a required call max_tokens cuts: its list no longer parses, so no call
        # and content "" (vLLM 0.33's Parser._extract_tool_calls; H208), finish length
        r = await h.post(
            "/v1/chat/completions", json={**base, "messages": marked, "tool_choice": "none"}
        )
        assert r.json()["choices"][0]["message"]["tool_calls"] == []
        r = await h.post(
            "/v1/chat/completions",
            json={**base, "tool_choice": "required", "max_tokens": 3},
        )
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
        assert choice["message"]["content"] == ""
        # the same prompt makes the same call
        r1 = await h.post("/v1/chat/completions", json={**base, "tool_choice": "required"})
        r2 = await h.post("/v1/chat/completions", json={**base, "tool_choice": "required"})
        c1, c2 = (x.json()["choices"][0]["message"]["tool_calls"][0] for x in (r1, r2))
        assert c1["function"] == c2["function"] and c1["id"] != c2["id"]
        # Responses: a function_call item, completed, its tokens the output
        body = {"model": model, "input": "the weather?", "tools": [_RESP_TOOL]}
        r = await h.post("/v1/responses", json={**body, "tool_choice": "required"})
        got = r.json()
        assert got["status"] == "completed", got
        (item,) = got["output"]
        assert item["type"] == "function_call" and item["id"].startswith("fc_")
        assert item["call_id"].startswith("chatcmpl-tool-") and item["name"] == "get_weather"
        args = json.loads(item["arguments"])
        listed = json.dumps([{"name": "get_weather", "parameters": args}], ensure_ascii=False)
        assert got["usage"]["output_tokens"] == _tokens(tok, listed)
        # no tools: text as before
        r = await h.post(
            "/v1/responses", json={"model": model, "input": "x", "tool_choice": "auto"}
        )
        assert r.json()["output"][0]["type"] == "message"


async def _until_predicted(
    h: httpx.AsyncClient, path: str, body: Callable[[int], dict[str, Any]], usage: str
) -> tuple[httpx.Response, int, int]:
    """``body(i)`` sent until the gateway predicts a hit (the agent indexed the blocks
    before): the answer, its predicted and its reported cached tokens."""
    r, got = None, (0, 0)
    for i in range(40):  # bounded: the agent indexes the earlier turn's blocks
        r = await h.post(path, json=body(i))
        assert r.status_code == 200, r.text
        cached = r.json()["usage"][usage]["cached_tokens"]
        got = (int(r.headers.get("x-kvgate-predicted-cached-tokens", "0")), cached)
        if got[0] > 0:
            break
        await asyncio.sleep(0.1)
    assert r is not None
    return r, *got


def _charges(gw: Any, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Each uncached-token charge and debit the gateway takes from now on, and each
    refund as a negative amount."""
    taken: list[float] = []
    charge, debit = gw.limiter.charge_uncached, gw.limiter.debit_uncached
    refund = gw.limiter.refund_uncached

    def on_charge(tenant: str, limits: Any, tokens: float, now: float) -> Any:
        taken.append(tokens)
        return charge(tenant, limits, tokens, now)

    def on_debit(tenant: str, tokens: float, now: float) -> None:
        taken.append(tokens)
        debit(tenant, tokens, now)

    def on_refund(tenant: str, tokens: float, now: float) -> None:
        taken.append(-tokens)
        refund(tenant, tokens, now)

    monkeypatch.setattr(gw.limiter, "charge_uncached", on_charge)
    monkeypatch.setattr(gw.limiter, "debit_uncached", on_debit)
    monkeypatch.setattr(gw.limiter, "refund_uncached", on_refund)
    return taken


def _model_stack(tmp_path: Path) -> tuple[str, str, ReplicaSettings]:
    model = str(tools_model(tmp_path, tool_loop=True))
    policy = (
        f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
        "index: {pending_ttl_ms: 1}\n"
    )
    return model, policy, ReplicaSettings(time_scale=0.05, tokenizer_dir=model)


async def test_a_chat_tool_loop_the_engine_made_is_charged_and_predicted_as_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, policy, settings = _model_stack(tmp_path)
    async with (
        stack(count=1, replica=settings, policy=policy, agents=True) as st,
        httpx.AsyncClient(base_url=st.url, timeout=30.0) as h,
    ):
        msgs = [
            {"role": "system", "content": words(120, 1)},
            {"role": "user", "content": words(20, 2)},
        ]
        turn1 = {"model": st.model, "messages": msgs, "tools": [_CHAT_TOOL],
                     "tool_choice": "required"}  # fmt: skip
        r = await h.post("/v1/chat/completions", json=turn1)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        first_prompt = r.json()["usage"]["prompt_tokens"]

        def turn2(i: int) -> dict[str, Any]:
            result = {"role": "tool", "tool_call_id": call["id"], "content": words(30, 50 + i)}
            history = [*msgs, {"role": "assistant", "content": None, "tool_calls": [call]}]
            return {"model": st.model, "messages": [*history, result],
                        "tools": [_CHAT_TOOL], "max_tokens": 2}  # fmt: skip

        taken = _charges(st.gw, monkeypatch)
        r, predicted, cached = await _until_predicted(
            h, "/v1/chat/completions", turn2, "prompt_tokens_details"
        )
        assert predicted == cached and cached >= first_prompt // 16 * 16 > 0, (
                predicted, cached, first_prompt,
            )  # fmt: skip
        prompt = r.json()["usage"]["prompt_tokens"]
        assert taken[-1] == prompt - predicted, (taken, prompt, predicted)
        d = await st.gw.prepare("chat", "anonymous", turn2(0), {}, "x", True)
        assert d.prompt_tokens == prompt
        assert r.json()["choices"][0]["message"]["tool_calls"] == []  # auto, no marker


async def test_a_responses_chain_through_an_engine_made_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, policy, settings = _model_stack(tmp_path)
    async with (
        stack(count=2, replica=settings, policy=policy, agents=True) as st,
        httpx.AsyncClient(base_url=st.url, timeout=30.0) as h,
    ):
        instructions = words(100, 3)
        base = {"model": st.model, "instructions": instructions, "tools": [_RESP_TOOL]}
        r = await h.post(
            "/v1/responses",
            json={**base, "input": words(40, 4), "tool_choice": "required"},
        )
        assert r.status_code == 200, r.text
        first = r.json()
        (item,) = first["output"]
        assert item["type"] == "function_call" and first["status"] == "completed"
        stored_on = r.headers["x-kvgate-replica"]
        taken = _charges(st.gw, monkeypatch)
        result = {"type": "function_call_output", "call_id": item["call_id"],
                      "output": words(30, 5)}  # fmt: skip
        turn2 = {**base, "previous_response_id": first["id"], "input": [result],
                     "max_output_tokens": 2}  # fmt: skip
        r = await h.post("/v1/responses", json=turn2)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-replica"] == stored_on
        usage = r.json()["usage"]
        prompt, cached = usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]
        # turn 1's prompt read from the cache (vLLM renders no previous function_call:
        # construct_input_messages keeps message items alone), the rest charged
        assert cached >= first["usage"]["input_tokens"] // 16 * 16 > 0, (cached, first)
        # the gateway sees the follow-up's own part alone (D30: instructions, tools,
        # the call's output; the stored history is the engine's), sizes it as the
        # engine renders that part, charges it before the run and debits the rest of
        # the engine's reported prefill after; a pinned follow-up is not predicted
        alone = {**turn2, "store": False}
        del alone["previous_response_id"]
        at = next(i for i in range(2) if st.replica_id(i) == stored_on)
        own = await h.post(st.fleet.endpoints[at].url + "/v1/responses", json=alone)
        assert own.status_code == 200, own.text
        d = await st.gw.prepare("responses", "anonymous", dict(alone), {}, "x", True)
        assert d.prompt_tokens == own.json()["usage"]["input_tokens"]
        assert taken[0] == d.prompt_tokens, taken
        assert sum(taken) == prompt - cached, (taken, prompt, cached)
        assert r.headers.get("x-kvgate-predicted-cached-tokens", "0") == "0"
        assert r.json()["output"][0]["type"] == "message"


async def test_streamed_calls_parse_with_the_sdk_through_the_gateway(tmp_path: Path) -> None:
    _, policy, settings = _model_stack(tmp_path)
    async with stack(count=1, replica=settings, policy=policy) as st:
        c = st.client()
        msgs: Any = [{"role": "user", "content": words(20, 6)}]
        named: Any = {"type": "function", "function": {"name": "get_weather"}}
        chat_tools: Any = [_CHAT_TOOL]
        resp_tools: Any = [_RESP_TOOL]
        stream = await c.chat.completions.create(
            model=st.model, messages=msgs, tools=chat_tools, tool_choice=named, stream=True
        )
        ids, names, args, finishes = set(), set(), "", []
        async for chunk in stream:
            for ch in chunk.choices:
                finishes.append(ch.finish_reason)
                for tc in ch.delta.tool_calls or ():
                    assert tc.index == 0
                    if tc.id:
                        ids.add(tc.id)
                    if tc.function and tc.function.name:
                        names.add(tc.function.name)
                    if tc.function and tc.function.arguments:
                        args += tc.function.arguments
        assert len(ids) == 1 and names == {"get_weather"} and finishes[-1] == "stop"
        assert set(json.loads(args)) == {"city", "days"}
        rs = await c.responses.create(
            model=st.model, input=words(20, 7), tools=resp_tools, tool_choice="required",
            stream=True,
        )  # fmt: skip
        events: list[Any] = [e async for e in rs]
        kinds = [e.type for e in events]
        assert kinds[:3] == [
            "response.created", "response.in_progress", "response.output_item.added",
        ]  # fmt: skip
        assert kinds[-3:] == [
            "response.function_call_arguments.done", "response.output_item.done",
            "response.completed",
        ]  # fmt: skip
        deltas = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        done = events[-1].response
        (item,) = done.output
        assert item.type == "function_call" and item.arguments == deltas
        assert item.id.startswith("fc_") and item.name == "get_weather"
        # the SDK's follow-up on it: the call's output under the streamed response's id
        result: Any = [{"type": "function_call_output", "call_id": item.call_id, "output": "12C"}]
        follow = await c.responses.create(
            model=st.model, previous_response_id=done.id, tools=resp_tools, input=result,
            max_output_tokens=2,
        )  # fmt: skip
        assert follow.status == "incomplete" and follow.output_text
