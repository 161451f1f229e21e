"""The Responses API's input read as vLLM reads it into chat messages (D31): function calls,
their outputs and reasoning items as vLLM's ``construct_chat_messages_with_tool_call``
builds them for non-Harmony models, grouped as it groups them, and a 400 naming ``input``
for what is malformed or not served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachecore.responses import ResponsesInputError, input_messages, request_messages
from cachecore.tokenizer import HFTokenizer, normalize_messages
from tests.test_responses_replica import tools_model

CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q":1}'}
CALL2 = {"type": "function_call", "call_id": "call_2", "name": "clock", "arguments": "{}"}
OUT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
SAID = {
    "type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
    "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
}  # fmt: skip
THOUGHT = {
    "type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "short"}],
    "content": [{"type": "reasoning_text", "text": "long"}],
}  # fmt: skip


def _tc(call: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": call["name"], "arguments": call["arguments"]}
    return {"id": call["call_id"], "function": fn, "type": "function"}


def test_a_tool_loop_reads_as_vllms_chat_messages() -> None:
    got = input_messages([{"role": "user", "content": "what?"}, CALL, OUT])
    assert got == [
        {"role": "user", "content": "what?"},
        {"role": "assistant", "tool_calls": [_tc(CALL)]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_assistant_items_join_the_assistant_message_before_them() -> None:
    # parallel calls: one assistant message
    assert input_messages([CALL, CALL2]) == [
        {"role": "assistant", "tool_calls": [_tc(CALL), _tc(CALL2)]}
    ]
    # reasoning, text, then calls: one message (reasoning from the first content part)
    assert input_messages([THOUGHT, SAID, CALL, CALL2, OUT]) == [
        {
            "role": "assistant",
            "reasoning": "long",
            "content": "Let me look.",
            "tool_calls": [_tc(CALL), _tc(CALL2)],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    # a call then text fills the missing content; a second text is a message of its own
    assert input_messages([CALL, SAID, SAID]) == [
        {"role": "assistant", "tool_calls": [_tc(CALL)], "content": "Let me look."},
        {"role": "assistant", "content": "Let me look."},
    ]
    # a tool message or a user message between: new assistant messages
    got = input_messages([CALL, OUT, CALL2, {"role": "user", "content": "u"}, THOUGHT, THOUGHT])
    roles = ["assistant", "tool", "assistant", "user", "assistant", "assistant"]
    assert [m["role"] for m in got] == roles
    # reasoning where the message before already has its own: a message of its own
    assert got[4:] == [{"role": "assistant", "reasoning": "long"}] * 2


def test_assistant_and_reasoning_text_as_vllm_takes_it() -> None:
    two = {**SAID, "content": [{"type": "output_text", "text": t} for t in ("a", "b")]}
    assert input_messages([two]) == [{"role": "assistant", "content": "a"}]  # first part
    user = {"role": "user", "content": [{"type": "input_text", "text": t} for t in ("a", "b")]}
    assert input_messages([user]) == [{"role": "user", "content": "a\nb"}]  # joined
    summary_only = {"type": "reasoning", "id": "rs", "summary": [{"text": "s", "type": "x"}]}
    assert input_messages([summary_only]) == [{"role": "assistant", "reasoning": "s"}]
    empty = {"type": "reasoning", "id": "rs", "summary": []}
    assert input_messages([empty]) == [{"role": "assistant", "reasoning": ""}]


def test_the_first_input_item_never_joins_the_previous_conversation() -> None:
    prior = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    got = request_messages("sys", prior, [CALL])
    assert got[-1] == {"role": "assistant", "tool_calls": [_tc(CALL)]}
    assert prior[-1] == {"role": "assistant", "content": "a"}  # untouched


def test_the_chat_path_reads_the_messages_as_a_chat_completion_s(tmp_path: Path) -> None:
    # the gateway keys these messages through its chat path: the same normalized chat and
    # prompt as the chat completion a client would send with them
    msgs = input_messages([{"role": "user", "content": "q"}, SAID, CALL, OUT])
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [_tc(CALL)]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    assert normalize_messages(msgs) == normalize_messages(chat)
    tok = HFTokenizer.from_dir(tools_model(tmp_path, tool_loop=True))
    text = tok.apply_chat_template(msgs)
    assert text == tok.apply_chat_template(chat)
    assert '<call>call_1 lookup {"q": 1}</call>' in text and "42<for>call_1</for>" in text


@pytest.mark.parametrize(
    ("item", "names"),
    [
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "call_id"),
        ({**CALL, "call_id": 7}, "call_id"),
        ({**CALL, "name": None}, "name"),
        ({**CALL, "arguments": {"q": 1}}, "arguments"),
        ({**CALL, "arguments": "{q: 1"}, "arguments"),
        ({**CALL, "namespace": "ns"}, "namespace"),
        ({"type": "function_call_output", "output": "x"}, "call_id"),
        ({**OUT, "output": None}, "output"),
        ({**OUT, "output": [{"type": "input_text", "text": "x"}]}, "output"),
        ({**THOUGHT, "encrypted_content": "gAAA"}, "encrypted_content"),
        ({**THOUGHT, "content": "long"}, "content"),
        ({**THOUGHT, "content": None, "summary": [{"type": "summary_text"}]}, "summary"),
        ({"type": "item_reference", "id": "x"}, "item_reference"),
        ({"type": "web_search_call", "id": "x"}, "web_search_call"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}, "input_image"),
        ({"role": "tool", "content": "x"}, "role"),
        ("text", "item object"),
    ],
)
def test_malformed_or_unserved_items_are_refused_naming_input(item: Any, names: str) -> None:
    with pytest.raises(ResponsesInputError) as exc:
        input_messages([{"role": "user", "content": "q"}, item])
    assert exc.value.param == "input"
    assert "input[1]" in str(exc.value) and names in str(exc.value)
