"""The Responses API's input read as vLLM reads it into chat messages (D31): function calls,
their outputs and reasoning items as vLLM's ``construct_chat_messages_with_tool_call``
builds them for non-Harmony models, grouped as it groups them, and a 400 naming ``input``
for what is malformed or not served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachecore.responses import (
    ResponsesInputError,
    chat_fields,
    chat_tools,
    continues_final_message,
    input_messages,
    request_messages,
    stored_messages,
)
from cachecore.tokenizer import (
    ChatOptions,
    HFTokenizer,
    effort_template_kwargs,
    message_text,
    normalize_messages,
)
from tests.test_responses_replica import tools_model


def _parts(*texts: str) -> list[dict[str, str]]:
    """Texts as the chat reader's text parts (what a list content is read as)."""
    return [{"type": "text", "text": t} for t in texts]


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
USER_PARTS = [{"type": "input_text", "text": "y"}]
CUSTOM = {"type": "custom_tool_call", "call_id": "call_3", "name": "shell", "input": "ls -l é"}
CUSTOM_OUT = {"type": "custom_tool_call_output", "call_id": "call_3", "output": "a.txt"}


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
    # its parts kept (an openai-format template sees them), joined for a string one
    assert input_messages([user]) == [{"role": "user", "content": _parts("a", "b")}]
    assert message_text(input_messages([user])[0]["content"]) == "a\nb"
    summary_only = {
        "type": "reasoning",
        "id": "rs",
        "summary": [{"text": "s", "type": "summary_text"}],
    }
    assert input_messages([summary_only]) == [{"role": "assistant", "reasoning": "s"}]
    empty = {"type": "reasoning", "id": "rs", "summary": []}
    assert input_messages([empty]) == [{"role": "assistant", "reasoning": ""}]


def test_inputs_vllm_serves_are_read_as_it_reads_them() -> None:
    """Review of D31: items vLLM 0.33 serves that were a 400 here, and the shapes its
    request model takes (checked against it: pydantic 2.14, openai 3.63)."""
    # a tool's output as parts: the tool message of their texts, empty ones dropped by a
    # string template
    parts = [{"type": "input_text", "text": t} for t in ("a", "", "b")]
    assert input_messages([{**OUT, "output": parts}]) == [
        {"role": "tool", "content": _parts("a", "", "b"), "tool_call_id": "call_1"}
    ]
    assert message_text(_parts("a", "", "b")) == "a\nb"
    assert message_text(input_messages([{**OUT, "output": []}])[0]["content"]) == ""
    # an empty encrypted_content is absent (vLLM tests it for truth)
    for secret in ("", None):
        got = input_messages([{**THOUGHT, "encrypted_content": secret}])
        assert got == [{"role": "assistant", "reasoning": "long"}]
    # a namespaced call: vLLM's flat_namespace_tool_name; an empty namespace is none
    assert input_messages([{**CALL, "namespace": "crm"}])[0]["tool_calls"][0]["function"] == {
        "name": "crm__lookup", "arguments": '{"q":1}'
    }  # fmt: skip
    for plain in ("", None):
        assert input_messages([{**CALL, "namespace": plain}]) == [
            {"role": "assistant", "tool_calls": [_tc(CALL)]}
        ]
    # vLLM's request model fills a reasoning item's id, a typed assistant message's id
    # and status; an untyped one of output_text parts needs its id
    bare = {k: v for k, v in THOUGHT.items() if k != "id"}
    assert input_messages([bare]) == [{"role": "assistant", "reasoning": "long"}]
    typed = {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "hi"}]}  # fmt: skip
    untyped = {k: v for k, v in SAID.items() if k not in ("type", "status")}
    easy = {"role": "assistant", "content": [{"type": "input_text", "text": "hi"}]}
    for item in (typed, untyped, easy):
        assert input_messages([item])[0]["content"] in ("hi", "Let me look.")
    # an untyped item with a string id is an item reference to vLLM's request model, so
    # it takes any text parts, read by the item's role
    ref = {"role": "user", "id": "u", "content": [{"type": "output_text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}  # fmt: skip
    assert input_messages([ref]) == [{"role": "user", "content": _parts("a", "b")}]
    said = {"role": "assistant", "id": "a", "content": [*USER_PARTS, *SAID["content"]]}
    assert input_messages([said]) == [{"role": "assistant", "content": "y"}]
    # an untyped assistant item with no parts: its own message, never joined
    assert input_messages([CALL, {"role": "assistant", "content": []}]) == [
        {"role": "assistant", "tool_calls": [_tc(CALL)]},
        {"role": "assistant", "content": ""},
    ]


def test_a_partial_final_message_is_continued_as_vllm_continues_it() -> None:
    # vLLM's should_continue_final_message: the last item a message (any role) or
    # reasoning item in_progress or incomplete
    for status in ("in_progress", "incomplete"):
        for last in ({**SAID, "status": status}, {**THOUGHT, "status": status},
                     {"role": "user", "content": "q", "status": status}):  # fmt: skip
            assert continues_final_message([{"role": "user", "content": "q"}, last])
            fields = chat_fields([last], None, None)
            assert fields == {"add_generation_prompt": False, "continue_final_message": True}
    partial = {**SAID, "status": "incomplete"}
    for value in (
        "q",
        [partial, SAID],  # not the last item
        [{**CALL, "status": "incomplete"}],  # a call is never continued
        [{**OUT, "status": "in_progress"}],
        [{**SAID, "status": "completed"}],
    ):
        assert not continues_final_message(value)
    assert chat_fields("q", None, None) == {
        "add_generation_prompt": True, "continue_final_message": False
    }  # fmt: skip


def test_reasoning_effort_and_template_kwargs_render_as_a_chat_completion_s() -> None:
    fields = chat_fields("q", {"effort": "high", "summary": "auto"}, {"x": 1})
    assert fields == {
        "add_generation_prompt": True, "continue_final_message": False,
        "reasoning_effort": "high", "chat_template_kwargs": {"x": 1},
    }  # fmt: skip
    assert "reasoning_effort" not in chat_fields("q", {"effort": None}, None)
    for reasoning, param in (
        ({"effort": "extreme"}, "reasoning.effort"),
        ("high", "reasoning"),
    ):
        with pytest.raises(ResponsesInputError) as exc:
            chat_fields("q", reasoning, None)
        assert exc.value.param == param
    with pytest.raises(ResponsesInputError) as exc:
        chat_fields("q", None, ["x"])
    assert exc.value.param == "chat_template_kwargs"
    # the chat path's options: vLLM's build_chat_params merge (the request's effort over
    # the kwargs'; enable_thinking unless the kwargs set it)
    opts = ChatOptions.from_body(fields)
    assert opts is not None and opts.template_kwargs == {
        "x": 1, "reasoning_effort": "high", "enable_thinking": True
    }  # fmt: skip
    own = {"enable_thinking": False, "reasoning_effort": "low"}
    assert effort_template_kwargs(own, "none") == {
        "enable_thinking": False, "reasoning_effort": "none"
    }  # fmt: skip
    assert effort_template_kwargs(None, "none") == {
        "reasoning_effort": "none", "enable_thinking": False
    }  # fmt: skip
    assert effort_template_kwargs({"reasoning_effort": "low"}, None) == {"reasoning_effort": "low"}


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


@pytest.mark.parametrize("arguments", ["{q: 1", "[1]", "7", "null", ""])
def test_a_call_s_arguments_no_json_object_render_as_an_empty_object(
    tmp_path: Path, arguments: str
) -> None:
    # vLLM 0.33 renders a function_call's arguments that are no JSON object as {}, as
    # its chat completions do (one rule, the chat reader's); kvgate answered 400 (D31)
    call = {**CALL, "arguments": arguments}
    msgs = input_messages([{"role": "user", "content": "q"}, call, OUT])
    assert msgs[1] == {"role": "assistant", "tool_calls": [_tc(call)]}
    assert normalize_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == {}
    tok = HFTokenizer.from_dir(tools_model(tmp_path, tool_loop=True))
    assert "<call>call_1 lookup {}</call>" in tok.apply_chat_template(msgs)


def test_custom_tool_calls_and_outputs_read_as_vllm_renders_them(tmp_path: Path) -> None:
    """Review H162 of D31: vLLM 0.33 renders a custom_tool_call as a function tool call
    whose arguments are ``encode_custom_tool_input`` (``{"input": ...}``, non-ASCII as
    is) and a custom_tool_call_output as a function call output's tool message; kvgate
    refused both naming input."""
    shim = {"id": "call_3", "type": "function",
            "function": {"name": "shell", "arguments": '{"input": "ls -l é"}'}}  # fmt: skip
    got = input_messages([{"role": "user", "content": "q"}, SAID, CALL, CUSTOM, CUSTOM_OUT])
    assert got == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [_tc(CALL), shim]},
        {"role": "tool", "content": "a.txt", "tool_call_id": "call_3"},
    ]
    # an empty input, a namespace (not rendered), an id or a null one: the same call
    for extra in ({"namespace": "ops"}, {"namespace": None, "id": None}, {"id": "ctc_1"}):
        assert input_messages([{**CUSTOM, **extra}]) == [
            {"role": "assistant", "tool_calls": [shim]}
        ]
    empty = input_messages([{**CUSTOM, "input": ""}])[0]["tool_calls"][0]["function"]
    assert empty["arguments"] == '{"input": ""}'
    parts = [{"type": "input_text", "text": t} for t in ("a", "", "b")]
    assert input_messages([{**CUSTOM_OUT, "output": parts}]) == [
        {"role": "tool", "content": _parts("a", "", "b"), "tool_call_id": "call_3"}
    ]
    # the chat template sees the arguments as the object {"input": ...}
    tok = HFTokenizer.from_dir(tools_model(tmp_path, tool_loop=True))
    text = tok.apply_chat_template(got)
    assert '<call>call_3 shell {"input": "ls -l é"}</call>' in text
    assert "a.txt<for>call_3</for>" in text


def test_a_custom_outputs_parts_are_spent_for_the_follow_up() -> None:
    """vLLM's request model holds a custom_tool_call_output's array output as a one-shot
    iterator (the SDK types it Iterable), which its first rendering consumes: the stored
    conversation renders that tool message empty in a follow-up. A string output, and a
    function call output's parts (a list), are kept."""
    parts = [{"type": "input_text", "text": "a"}]
    value = [CALL, {**OUT, "output": parts}, CUSTOM, {**CUSTOM_OUT, "output": parts},
             CUSTOM, CUSTOM_OUT]  # fmt: skip
    messages = request_messages("sys", [{"role": "user", "content": "q"}], value)
    kept = stored_messages(messages, value)
    a = _parts("a")
    assert [m.get("content") for m in messages if m["role"] == "tool"] == [a, a, "a.txt"]
    assert [m.get("content") for m in kept if m["role"] == "tool"] == [a, "", "a.txt"]
    assert kept[:5] == messages[:5] and messages[5]["content"] == a  # the rendered ones kept
    assert stored_messages(messages[:3], "q") == messages[:3]


def test_function_and_custom_tools_render_as_vllms_function_definitions() -> None:
    """vLLM 0.33 shows a custom tool as a one-string function (``custom_tool_as_function_
    dict``) and dumps every tool as its ``FunctionDefinition``: name, description,
    parameters, then strict and defer_loading only when set; other fields dropped."""
    custom = {"type": "custom", "name": "shell", "description": "Run it.",
              "format": {"type": "text"}, "defer_loading": True}  # fmt: skip
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": None,
          "allowed_callers": ["direct"], "defer_loading": False, "output_schema": {}}  # fmt: skip
    tools, exact = chat_tools([custom, fn, {"type": "custom", "name": "raw"}])
    params = {
        "type": "object",
        "properties": {
            "input": {"type": "string", "description": "The freeform text payload for this tool."}
        },
        "required": ["input"],
        "additionalProperties": False,
    }
    assert exact and tools == [
        {"type": "function",
         "function": {"name": "shell", "description": "Run it.", "parameters": params}},
        {"type": "function",
         "function": {"name": "f", "description": None, "parameters": {"type": "object"},
                      "defer_loading": False}},
        {"type": "function",
         "function": {"name": "raw", "description": None, "parameters": params}},
    ]  # fmt: skip
    assert list(tools[1]["function"]) == ["name", "description", "parameters", "defer_loading"]
    strict = chat_tools([{**fn, "strict": True}])[0]
    assert strict is not None and list(strict[0]["function"])[3] == "strict"
    # what vLLM refuses: a grammar format (free-form text only), a malformed one
    for bad in (
        {"type": "grammar", "syntax": "lark", "definition": "start: /x/"},
        {"type": "regex"},
        "text",
    ):
        with pytest.raises(ResponsesInputError) as exc:
            chat_tools([{**custom, "format": bad}])
        assert exc.value.param == "tools"
    for tool in ({**custom, "name": 7}, {**custom, "description": 1}, {**fn, "strict": "maybe"}):
        with pytest.raises(ResponsesInputError):
            chat_tools([tool])


def test_namespace_tools_render_flattened_as_vllm_renders_them() -> None:
    """vLLM 0.33 (``get_function_tools``) shows a namespace tool's function tools in its
    place, each named ``<namespace>__<name>`` and dumped as a top-level function is; its
    custom tools and description are not rendered. Exact, so keyed (it was unkeyed)."""
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    lookup = {"type": "function", "name": "lookup", "description": "Find one.",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
              "strict": True, "defer_loading": False, "allowed_callers": ["direct"],
              "async": True, "output_schema": {}}  # fmt: skip
    grammar = {"type": "grammar", "syntax": "lark", "definition": "start: /x/"}
    crm = {"type": "namespace", "name": "crm", "description": "The CRM.",
           "tools": [lookup, {"type": "custom", "name": "note", "format": grammar},
                     {"type": "function", "name": "list"}]}  # fmt: skip
    tools, exact = chat_tools([fn, crm, {"type": "custom", "name": "raw"}])
    assert exact and tools is not None
    assert [t["function"]["name"] for t in tools] == ["f", "crm__lookup", "crm__list", "raw"]
    assert tools[1] == {"type": "function", "function": {
        "name": "crm__lookup", "description": "Find one.", "parameters": lookup["parameters"],
        "strict": True, "defer_loading": False}}  # fmt: skip
    assert tools[2]["function"] == {"name": "crm__list", "description": None, "parameters": None}
    # an empty namespace is rendered as the flat name says; one of custom tools renders an
    # empty list (construct_tool_dicts' [], over a server's default tools: H199)
    only_custom = {**crm, "name": "", "tools": [{"type": "custom", "name": "note"}]}
    assert chat_tools([only_custom]) == ([], True)
    assert chat_tools([]) == (None, True)  # no tools: None (construct_tool_dicts)
    flat = chat_tools([{**crm, "name": ""}])[0]
    assert flat is not None and flat[0]["function"]["name"] == "__lookup"
    # a named tool_choice renders nothing; "none" renders the tools, keyed (a server
    # with --exclude-tools-when-tool-choice-none renders none: render_request, H210)
    choice = {"type": "function", "name": "lookup"}
    assert chat_tools([crm], choice) == chat_tools([crm])
    assert chat_tools([crm], "none") == chat_tools([crm])
    # what vLLM refuses, naming tools: its request model's NamespaceTool, and parameters
    # that are no object (its rendering's ValueError)
    for bad in (
        {k: v for k, v in crm.items() if k != "description"},
        {**crm, "description": None},
        {**crm, "name": 3},
        {**crm, "tools": None},
        {**crm, "tools": [{"type": "web_search"}]},
        {**crm, "tools": ["lookup"]},
        {**crm, "tools": [{"type": "function", "name": None}]},
        {**crm, "tools": [{**lookup, "parameters": [1]}]},
        {**crm, "tools": [{**lookup, "strict": 2}]},
        {**crm, "tools": [{"type": "custom", "name": "n", "format": {"type": "grammar"}}]},
    ):
        with pytest.raises(ResponsesInputError) as exc:
            chat_tools([bad])
        assert exc.value.param == "tools" and "tools[0]" in str(exc.value), bad


def test_tool_flags_and_names_are_read_as_vllms_models_read_them() -> None:
    """vLLM's request model reads ``strict`` / ``defer_loading`` as pydantic's lax
    booleans and renders the boolean (``FunctionDefinition``'s dump); it takes an empty
    function or custom tool name; a custom tool's ``strict`` is an extra field it keeps
    unread, whatever its value."""
    fn = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    lax = [(True, True), ("yes", True), ("YES", True), ("on", True), ("t", True), ("y", True),
           ("1", True), (1, True), (1.0, True), ("True", True), (False, False), ("no", False),
           ("Off", False), ("f", False), ("n", False), ("0", False), (0, False),
           ("false", False), (0.0, False)]  # fmt: skip
    for value, want in lax:
        for flag in ("strict", "defer_loading"):
            tools, _ = chat_tools([{**fn, flag: value}])
            assert tools is not None and tools[0]["function"][flag] is want, (flag, value)
            custom = {"type": "custom", "name": "c", "defer_loading": value}
            inner = {"type": "namespace", "name": "ns", "description": "",
                     "tools": [{**fn, flag: value}, custom]}  # fmt: skip
            tools, _ = chat_tools([inner])
            assert tools is not None and tools[0]["function"][flag] is want, (flag, value)
    bad_values: list[Any] = ["maybe", "", " yes", "1.0", 2, 1.5, -1, [], {}]
    for value in bad_values:
        tool: dict[str, Any]
        for tool in ({**fn, "strict": value}, {**fn, "defer_loading": value},
                     {"type": "custom", "name": "c", "defer_loading": value}):  # fmt: skip
            with pytest.raises(ResponsesInputError) as exc:
                chat_tools([tool])
            assert exc.value.param == "tools", (tool, value)
    # empty names served (rendered as given); a custom tool's strict neither read nor shown
    tools, _ = chat_tools([{**fn, "name": ""}, {"type": "custom", "name": "", "strict": "x"}])
    assert tools is not None and [t["function"]["name"] for t in tools] == ["", ""]
    assert "strict" not in tools[1]["function"]
    for value in (True, [1], {"a": 1}, 7):
        assert chat_tools([{"type": "custom", "name": "c", "strict": value}])[0] is not None
    for bad in ({**fn, "name": None}, {"type": "custom", "name": 3}, {"type": "custom"}):
        with pytest.raises(ResponsesInputError):
            chat_tools([bad])


def test_a_named_tool_choice_naming_no_tool_is_refused_as_vllm_refuses_it() -> None:
    """vLLM 0.33's ``check_tool_usage``: a named ``tool_choice`` (type function or
    custom) needs tools and a name that is one tool's, or a namespaced local name in one
    namespace only; ``"required"`` needs tools. Each a 400 naming ``tool_choice``."""
    fn = {"type": "function", "name": "f"}
    ns = {"type": "namespace", "name": "crm", "description": "", "tools": [
        {"type": "function", "name": "lookup"}, {"type": "custom", "name": "note"}]}  # fmt: skip
    other = {**ns, "name": "erp"}
    missing = "Tool choice 'function' not found in 'tools' parameter."
    refused = [
        (None, {"type": "function", "name": "f"}, missing),
        ([], {"type": "custom", "name": "f"}, missing),
        (None, "required", "Tool choice 'required' must be specified with 'tools' parameter."),
        ([], "required", "Tool choice 'required' must be specified with 'tools' parameter."),
        ([fn], {"type": "function", "name": "g"}, missing),
        ([fn], {"type": "function"}, missing),
        ([fn], {"type": "function", "name": ""}, missing),
        ([fn], {"type": "function", "name": 5}, missing),
        ([fn, ns], {"type": "function", "name": "crm"}, missing),
        ([ns, other], {"type": "function", "name": "lookup"},
         "Tool choice 'lookup' is ambiguous: it is defined in more than one namespace "
         "(crm__lookup, erp__lookup). Select it by its full '<namespace>__<name>' name."),
        # checked before the tools themselves are (vLLM's before-validator runs first)
        ([{"type": "custom", "name": "c", "format": "bad"}], {"type": "function", "name": "x"},
         missing),
    ]  # fmt: skip
    for tools, choice, message in refused:
        with pytest.raises(ResponsesInputError) as exc:
            chat_tools(tools, choice)
        assert (exc.value.param, str(exc.value)) == ("tool_choice", message), (tools, choice)
    served = [
        (None, "auto"), (None, "none"), ([], "none"), ([fn], "required"),
        ([fn], {"type": "function", "name": "f"}), ([fn], {"type": "custom", "name": "f"}),
        ([ns], {"type": "function", "name": "lookup"}),
        ([ns], {"type": "function", "name": "crm__lookup"}),
        ([ns], {"type": "custom", "name": "note"}),
        ([ns, other], {"type": "function", "name": "erp__lookup"}),
        ([{"type": "web_search", "name": "w"}], {"type": "function", "name": "w"}),
        ([fn], {"type": "allowed_tools", "mode": "auto", "tools": []}),
        ([fn], {"type": "web_search_preview"}),
    ]  # fmt: skip
    for tools, choice in served:
        chat_tools(tools, choice)
    # a namespace vLLM's check cannot read skips it (refused as tools instead)
    with pytest.raises(ResponsesInputError) as exc:
        chat_tools([{**ns, "tools": None}], {"type": "function", "name": "nothing"})
    assert exc.value.param == "tools"


@pytest.mark.parametrize(
    ("item", "names"),
    [
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "call_id"),
        ({**CALL, "call_id": 7}, "call_id"),
        ({**CALL, "name": None}, "name"),
        ({**CALL, "arguments": {"q": 1}}, "arguments"),
        ({**CALL, "namespace": 7}, "namespace"),
        ({"type": "function_call_output", "output": "x"}, "call_id"),
        ({**OUT, "output": None}, "output"),
        ({**OUT, "output": [{"type": "output_text", "text": "x"}]}, "output_text"),
        ({**OUT, "output": [{"type": "input_image", "image_url": "u"}]}, "input_image"),
        ({**OUT, "output": [{"type": "input_text"}]}, "output"),
        ({**THOUGHT, "encrypted_content": "gAAA"}, "encrypted_content"),
        ({**THOUGHT, "encrypted_content": 7}, "encrypted_content"),
        ({**THOUGHT, "content": "long"}, "content"),
        ({**THOUGHT, "content": None, "summary": [{"type": "summary_text"}]}, "summary"),
        # what vLLM's request model refuses (or its reader fails on): refused here too
        ({**THOUGHT, "summary": [{"type": "x", "text": "s"}]}, "summary"),
        ({**THOUGHT, "content": [{"type": "output_text", "text": "t"}]}, "content"),
        ({"type": "reasoning", "id": "rs"}, "summary"),
        ({**THOUGHT, "id": None}, "id"),
        ({**THOUGHT, "status": "done"}, "status"),
        ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "output_text"),
        ({"role": "user", "content": [{"type": "text", "text": "x"}]}, "'text'"),
        ({"role": "system", "content": [{"type": "output_text", "text": "x"}]}, "output_text"),
        ({"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}, "id"),
        ({**SAID, "type": "message", "content": [{"type": "text", "text": "x"}]}, "'text'"),
        ({**SAID, "content": [*SAID["content"], *USER_PARTS]}, "all output_text"),
        ({**SAID, "content": []}, "needs a part"),
        ({**SAID, "status": None}, "status"),
        ({**SAID, "id": 7}, "id"),
        ({**CUSTOM, "input": None}, "input"),
        ({**CUSTOM, "call_id": 3}, "call_id"),
        ({k: v for k, v in CUSTOM.items() if k != "name"}, "name"),
        ({**CUSTOM, "id": 7}, "id"),
        ({**CUSTOM, "namespace": 5}, "namespace"),
        ({**CUSTOM_OUT, "call_id": None}, "call_id"),
        ({**CUSTOM_OUT, "output": None}, "output"),
        ({**CUSTOM_OUT, "id": None}, "id"),
        ({**CUSTOM_OUT, "output": [{"type": "input_image", "image_url": "u"}]}, "input_image"),
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
