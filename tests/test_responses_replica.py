"""The simulated replica's Responses API (D30): ``POST /v1/responses`` plain and streamed
as vLLM serves it for text, ``GET /v1/responses/{id}``, a chain through
``previous_response_id`` run through the engine's prefix cache, vLLM's refusals, and the
bounded per-replica store (lost on a restart)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.responses import ResponseOutputMessage, ResponseOutputText

from cachecore.replica.fleet import run_fleet
from cachecore.replica.responses import output_text
from cachecore.replica.settings import ReplicaSettings
from cachecore.responses import request_messages
from cachecore.tokenizer import export_builtin
from tests.test_gateway_support import FAST, words

pytestmark = pytest.mark.timeout(60)


# a tool-calling model's turn parts (D31): an assistant's reasoning and tool calls (the
# arguments as the parsed object) and a tool message's call id, rendered into the prompt
_TOOL_LOOP = (
    "{%- for message in messages -%}\n<|im_start|>{{ message['role'] }}\n"
    "{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}"
    "</think>{% endif %}{{ message['content'] }}"
    "{% for c in message.tool_calls or [] %}<call>{{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if message.tool_call_id is defined %}<for>{{ message.tool_call_id }}</for>{% endif %}"
    "<|im_end|>\n{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n<|im_start|>assistant\n{% endif -%}\n"
)


def tools_model(directory: Path, tool_loop: bool = False) -> Path:
    """The built-in tokenizer as an HF model directory whose chat template renders the
    request's tools (as a tool-calling model's does: each as JSON before the chat), and
    with ``tool_loop`` the turns' reasoning, tool calls and tool call ids too."""
    head = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
        "{% endif %}"
    )
    return template_model(directory, head, _TOOL_LOOP if tool_loop else None)


def template_model(directory: Path, head: str, body: str | None = None) -> Path:
    """The built-in tokenizer as an HF model directory whose chat template is ``head``
    then ``body`` (default: the built-in template)."""
    export_builtin(directory)
    jinja = directory / "chat_template.jinja"
    template = head + (jinja.read_text() if body is None else body)
    jinja.write_text(template)
    cfg = directory / "tokenizer_config.json"
    config = json.loads(cfg.read_text())
    config["chat_template"] = template
    cfg.write_text(json.dumps(config))
    return directory


@asynccontextmanager
async def replica(
    settings: ReplicaSettings = FAST,
) -> AsyncIterator[tuple[httpx.AsyncClient, openai.AsyncOpenAI, str]]:
    async with (
        run_fleet(settings, count=1) as fleet,
        httpx.AsyncClient(base_url=fleet.endpoints[0].url, timeout=30) as h,
        openai.AsyncOpenAI(base_url=fleet.endpoints[0].url + "/v1", api_key="x") as sdk,
    ):
        yield h, sdk, fleet.endpoints[0].model


async def test_the_sdk_creates_and_retrieves_a_response() -> None:
    async with replica() as (_, sdk, model):
        r = await sdk.responses.create(
            model=model, input=words(40, 1), instructions=words(10, 2), max_output_tokens=5
        )
        assert r.id.startswith("resp_") and r.object == "response"
        assert (r.model, r.previous_response_id) == (model, None)
        # the simulated engine runs to max_output_tokens: vLLM's "incomplete" for that
        assert r.status == "incomplete" and r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"
        (item,) = r.output
        assert isinstance(item, ResponseOutputMessage)
        assert (item.type, item.role, item.status) == ("message", "assistant", "completed")
        (part,) = item.content
        assert isinstance(part, ResponseOutputText)
        assert part.type == "output_text" and part.text and part.annotations == []
        assert r.output_text == part.text
        assert r.usage is not None
        # instructions (system) + input (user) through the chat template; 5 tokens out
        assert r.usage.input_tokens > 50 and r.usage.output_tokens == 5
        assert r.usage.total_tokens == r.usage.input_tokens + 5
        assert r.usage.input_tokens_details.cached_tokens == 0
        got = await sdk.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == r.output_text
        # vLLM's request_id is the response's id
        mine = await sdk.responses.create(
            model=model, input="hi", max_output_tokens=2, extra_body={"request_id": "resp_mine"}
        )
        assert mine.id == "resp_mine"


async def test_a_streamed_response_is_the_responses_events_in_order() -> None:
    async with replica() as (h, sdk, model):
        body = {"model": model, "input": words(30, 3), "max_output_tokens": 4, "stream": True}
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            raw = (await resp.aread()).decode()
        events = []
        for block in raw.strip().split("\n\n"):
            head, data = block.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: ")
            event = orjson.loads(data[6:])
            assert event["type"] == head[7:]
            events.append(event)
        kinds = [e["type"] for e in events]
        assert kinds == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added", *["response.output_text.delta"] * 4,
            "response.output_text.done", "response.content_part.done",
            "response.output_item.done", "response.completed",
        ]  # fmt: skip
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "[DONE]" not in raw  # vLLM ends the stream with response.completed
        final = events[-1]["response"]
        assert events[0]["response"]["status"] == "in_progress"
        assert events[0]["response"]["id"] == final["id"]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert final["output"][0]["content"][0]["text"] == text == events[-4]["text"]
        assert final["usage"]["output_tokens"] == 4
        # the SDK reads the same stream; the stored one is retrievable
        stream = await sdk.responses.create(
            model=model, input=words(30, 4), max_output_tokens=3, stream=True
        )
        seen = [event async for event in stream]
        assert seen[-1].type == "response.completed"
        done = seen[-1].response
        assert (await sdk.responses.retrieve(done.id)).output_text == done.output_text


async def test_a_chain_continues_the_stored_conversation_from_the_prefix_cache() -> None:
    async with replica() as (h, sdk, model):
        # the instructions sent on every turn: they do not carry over (vLLM drops the
        # stored conversation's system messages), so each turn leads with them again
        system = words(20, 6)
        first = await sdk.responses.create(
            model=model, input=words(80, 5), instructions=system, max_output_tokens=8
        )
        second = await sdk.responses.create(
            model=model, input=words(30, 7), instructions=system,
            previous_response_id=first.id, max_output_tokens=8,
        )  # fmt: skip
        third = await sdk.responses.create(
            model=model,
            input=[{"role": "user", "content": [{"type": "input_text", "text": words(30, 8)}]}],
            instructions=system,
            previous_response_id=second.id,
            max_output_tokens=8,
        )
        assert second.previous_response_id == first.id
        ins = [r.usage.input_tokens for r in (first, second, third) if r.usage]
        cached = [
            r.usage.input_tokens_details.cached_tokens for r in (first, second, third) if r.usage
        ]
        # each turn's prompt holds the previous one's (its input, then its output)
        assert ins[0] < ins[1] < ins[2]
        assert ins[1] > ins[0] + first.usage.output_tokens + 30  # type: ignore[union-attr]
        # and reads the previous turn's prompt blocks from the prefix cache
        assert cached[0] == 0 < cached[1] < cached[2]
        assert cached[1] >= (ins[0] // 16 - 1) * 16
        # the engine saw the same: prefix-cache queries and hits in /metrics
        text = (await h.get("/metrics")).text
        hits = [ln for ln in text.splitlines() if ln.startswith("vllm:prefix_cache_hits_total")]
        assert hits and float(hits[0].rsplit(" ", 1)[1]) >= cached[1] + cached[2]
        # store=false: answered, not kept (neither retrievable nor continued)
        loose = await sdk.responses.create(model=model, input="x", max_output_tokens=2, store=False)
        assert loose.to_dict()["store"] is False
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(loose.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model=model, input="y", previous_response_id=loose.id)


def test_a_follow_up_is_built_as_vllms_construct_input_messages() -> None:
    # vLLM (0.33 and main, responses/utils.py construct_input_messages): the request's
    # instructions, the stored messages less every system one (turn 1's instructions and a
    # system input item alike: instructions do not carry over), each part of each output
    # message as its own assistant message (reasoning and calls left out), the input
    stored = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "An input item."},
        {"role": "developer", "content": "Kept."},
        {"role": "user", "content": "q"},
    ]
    output: list[dict[str, Any]] = [
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [output_text("a"), output_text("b")]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    ]  # fmt: skip
    history = [
        {"role": "developer", "content": "Kept."},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    got = request_messages("Be brief.", stored, "next", output)
    assert got == [
        {"role": "system", "content": "Be brief."},
        *history,
        {"role": "user", "content": "next"},
    ]
    assert request_messages(None, stored, "next", output) == [
        *history,
        {"role": "user", "content": "next"},
    ]
    assert stored[0] == {"role": "system", "content": "Be brief."}  # read, not changed


async def test_a_follow_up_renders_as_vllm_and_reuses_turn_ones_prefix() -> None:
    # vLLM's rule for the prompt of a follow-up: the same instructions on every turn make
    # turn 2's prompt extend turn 1's, so the engine reads instructions and turn 1's input
    # from its cache (the earlier rendering kept the stored system message too, after the
    # new one: instructions sent twice, and only their blocks matched); a follow-up
    # without instructions runs with none, sharing no prefix with the stored turn
    system, first_in, second_in, third_in = words(20, 40), words(80, 41), words(30, 42), "ok"
    async with replica() as (h, _, model):

        async def turn(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
            r = await h.post("/v1/responses", json={"model": model, "max_output_tokens": 6, **body})
            assert r.status_code == 200, r.text
            got: dict[str, Any] = r.json()
            return got, got["output"][0]["content"][0]["text"]

        async def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
            r = await h.post(
                "/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
            usage: dict[str, Any] = r.json()["usage"]
            return usage

        one, said1 = await turn({"instructions": system, "input": first_in})
        two, said2 = await turn(
            {"instructions": system, "input": second_in, "previous_response_id": one["id"]}
        )
        prompt1, prompt2 = one["usage"]["input_tokens"], two["usage"]["input_tokens"]
        # every full block of turn 1's prompt (its instructions and input) read from cache
        assert two["usage"]["input_tokens_details"]["cached_tokens"] >= prompt1 // 16 * 16
        expected = [
            {"role": "system", "content": system},
            {"role": "user", "content": first_in},
            {"role": "assistant", "content": said1},
            {"role": "user", "content": second_in},
        ]
        # the chat completion of those messages is turn 2's prompt, token for token: the
        # same size, and every full block of it cached by turn 2
        same = await chat(expected)
        assert same["prompt_tokens"] == prompt2
        assert same["prompt_tokens_details"]["cached_tokens"] >= (prompt2 - 1) // 16 * 16
        # without instructions: turn 2's stored messages less the system one, no head
        three, _ = await turn({"input": third_in, "previous_response_id": two["id"]})
        assert three["usage"]["input_tokens_details"]["cached_tokens"] == 0
        bare = await chat(
            [*expected[1:], {"role": "assistant", "content": said2},
             {"role": "user", "content": third_in}]
        )  # fmt: skip
        assert bare["prompt_tokens"] == three["usage"]["input_tokens"]
        assert bare["prompt_tokens_details"]["cached_tokens"] > 0  # turn 3's own blocks


async def test_vllms_refusals() -> None:
    async with replica() as (h, _, model):
        cases = [
            ({"model": model}, 400, "input"),
            ({"model": model, "input": 3}, 400, "input"),
            ({"model": model, "input": []}, 400, "input"),
            ({"model": model, "input": [{"type": "function_call_output", "output": "x"}]}, 400,
             "input"),
            ({"model": model, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
             400, "input"),
            ({"model": model, "input": [{"role": "robot", "content": "x"}]}, 400, "input"),
            ({"model": model, "input": "x", "instructions": 5}, 400, "instructions"),
            ({"model": model, "input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
            ({"model": model, "input": "x", "temperature": "hot"}, 400, "temperature"),
            ({"model": model, "input": "x", "cache_salt": ""}, 400, "cache_salt"),
            # vLLM's check_tool_usage: a named tool_choice naming no tool, "required"
            # without tools
            ({"model": model, "input": "x", "tools": [{"type": "function", "name": "f"}],
              "tool_choice": {"type": "function", "name": "g"}}, 400, "tool_choice"),
            ({"model": model, "input": "x", "tool_choice": "required"}, 400, "tool_choice"),
            ({"model": "nope", "input": "x"}, 404, "model"),
            ({"model": model, "input": "x", "previous_response_id": "resp_nope"}, 404,
             "response_id"),
        ]  # fmt: skip
        for body, status, param in cases:
            r = await h.post("/v1/responses", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param, (body, err)
        r = await h.post(
            "/v1/responses", json={"model": model, "input": "x", "previous_response_id": "resp_q"}
        )
        assert r.json()["error"]["message"] == "Response with id 'resp_q' not found."
        assert r.json()["error"]["type"] == "invalid_request_error"
        r = await h.get("/v1/responses/resp_gone")
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "Response with id 'resp_gone' not found."


async def test_the_store_is_bounded_and_per_engine_process() -> None:
    async with replica(FAST.model_copy(update={"responses_store_max": 2})) as (h, sdk, model):
        ids = [
            (await sdk.responses.create(model=model, input=str(i), max_output_tokens=2)).id
            for i in range(3)
        ]
        with pytest.raises(openai.NotFoundError):  # the least recently used went first
            await sdk.responses.retrieve(ids[0])
        await sdk.responses.retrieve(ids[1])  # now the most recently used
        await sdk.responses.create(model=model, input="3", max_output_tokens=2)
        await sdk.responses.retrieve(ids[1])
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(ids[2])
        # a restarted engine has lost them all (vLLM's store is in its process's memory)
        assert (await h.post("/debug/restart")).status_code == 200
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(ids[1])


async def test_the_cache_salt_scopes_a_responses_prompt() -> None:
    async with replica() as (h, sdk, model):
        for salt in ("salt-a", "salt-b"):
            await sdk.responses.create(
                model=model, input=words(40, 9), max_output_tokens=2,
                extra_body={"cache_salt": salt},
            )  # fmt: skip
        blocks = (await h.get("/debug/blocks")).json()["blocks"]
        roots = [b["extra_keys"] for b in blocks if b["parent_block_hash"] is None]
        assert sorted(k for keys in roots if keys for k in keys if k.startswith("salt")) == [
            "salt-a",
            "salt-b",
        ]


async def test_function_tools_render_as_the_chat_with_converted_tools(tmp_path: Path) -> None:
    tool = {
        "type": "function", "name": "lookup", "description": "Look it up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    }  # fmt: skip
    fn = {k: v for k, v in tool.items() if k != "type"}
    settings = FAST.model_copy(update={"tokenizer_dir": str(tools_model(tmp_path))})
    async with replica(settings) as (h, _, _):
        plain = await h.post("/v1/responses", json={"input": "hello there", "max_output_tokens": 1})
        with_tools = await h.post(
            "/v1/responses", json={"input": "hello there", "tools": [tool], "max_output_tokens": 1}
        )
        chat = await h.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1,
                  "tools": [{"type": "function", "function": fn}]},
        )  # fmt: skip
        assert plain.status_code == with_tools.status_code == chat.status_code == 200
        n = with_tools.json()["usage"]["input_tokens"]
        assert n > plain.json()["usage"]["input_tokens"]
        assert n == chat.json()["usage"]["prompt_tokens"]
        bad = await h.post("/v1/responses", json={"input": "x", "tools": [{"type": "function"}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


LOOKUP = {
    "type": "function", "name": "lookup", "description": "Look it up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}  # fmt: skip


async def test_a_tool_loop_renders_as_its_chat_and_a_follow_up_carries_the_output(
    tmp_path: Path,
) -> None:
    # D31: function_call and function_call_output items render as vLLM's chat messages (an
    # assistant's tool_calls, a tool message), and a stored turn's follow-up carrying a
    # call's output continues its conversation from the prefix cache
    fn = {k: v for k, v in LOOKUP.items() if k != "type"}
    settings = FAST.model_copy(update={"tokenizer_dir": str(tools_model(tmp_path, True))})
    call = {"type": "function_call", "call_id": "call_9", "name": "lookup", "arguments": "{}"}
    out = {"type": "function_call_output", "call_id": "call_9", "output": words(30, 31)}
    question = words(40, 30)

    def called(call_id: str, output: str) -> list[dict[str, Any]]:
        """A lookup call and its output as chat messages."""
        fn_call = {"name": "lookup", "arguments": "{}"}
        return [
            {"role": "assistant",
             "tool_calls": [{"id": call_id, "type": "function", "function": fn_call}]},
            {"role": "tool", "tool_call_id": call_id, "content": output},
        ]  # fmt: skip

    async with replica(settings) as (h, _, model):

        async def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
            """The prompt tokens of ``messages`` as a chat completion."""
            chat = await h.post(
                "/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 1,
                      "tools": [{"type": "function", "function": fn}]},
            )  # fmt: skip
            assert chat.status_code == 200, chat.text
            tokens: int = chat.json()["usage"]["prompt_tokens"]
            return tokens

        body = {
            "model": model, "instructions": "Be brief.", "tools": [LOOKUP],
            "input": [{"role": "user", "content": question}, call, out],
            "max_output_tokens": 3,
        }  # fmt: skip
        r = await h.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        said = r.json()["output"][0]["content"][0]["text"]
        chat_messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question},
            *called("call_9", out["output"]),
        ]
        assert await chat_prompt_tokens(chat_messages) == r.json()["usage"]["input_tokens"]
        # the follow-up: its instructions again (the stored ones do not carry over), the
        # stored conversation, the answer, then the second call's output
        call2 = {**call, "call_id": "call_10"}
        out2 = {**out, "call_id": "call_10", "output": words(20, 32)}
        follow = await h.post(
            "/v1/responses",
            json={"model": model, "instructions": "Be brief.", "tools": [LOOKUP],
                  "previous_response_id": r.json()["id"], "input": [call2, out2],
                  "max_output_tokens": 2},
        )  # fmt: skip
        assert follow.status_code == 200, follow.text
        usage = follow.json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] > 0
        chat_messages += [
            {"role": "assistant", "content": said},
            *called("call_10", out2["output"]),
        ]
        assert await chat_prompt_tokens(chat_messages) == usage["input_tokens"]
        # a malformed item: vLLM's 400 naming input
        bad = await h.post(
            "/v1/responses", json={"model": model, "input": [{**call, "arguments": {}}]}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text
