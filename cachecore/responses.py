"""The Responses API's input as chat messages, read the same way by the simulated replica
(which renders them) and the gateway (which keys and sizes them) (D30, D31).

vLLM builds a Responses request's prompt as a chat: ``instructions`` as a system message,
then a stored previous response's conversation (its system messages dropped) and output,
then ``input`` (a string is one user message; a list holds items). The items are read as
vLLM's ``construct_input_messages`` / ``construct_chat_messages_with_tool_call``
(``vllm/entrypoints/openai/responses/utils.py``, formerly
``vllm/entrypoints/responses_utils.py``) turns them into chat messages for non-Harmony
models:

- a message ``{role, content}`` (content a string or ``input_text`` / ``output_text``
  parts): a user, system or developer one as that message (parts joined by newlines, as
  vLLM's chat parser joins them), with its string ``name`` and a developer's ``tools``
  (vLLM passes the item to its chat parser whole, which keeps both for the template); an
  assistant one as an assistant message of its *first* part's text (no name);
- ``function_call`` ``{call_id, name, arguments}``: an assistant message with
  ``tool_calls: [{id: call_id, function: {name, arguments}, type: "function"}]``;
- ``function_call_output`` ``{call_id, output}``: ``{role: "tool", content: output,
  tool_call_id: call_id}``;
- ``reasoning``: an assistant message with ``reasoning`` (its first content part's text,
  else its first summary part's, else empty).

An assistant item right after an assistant message read from the same ``input`` joins it
where that message lacks its part: a function call adds to its ``tool_calls`` (so
parallel calls, and a text answer followed by its calls, are one message), an assistant
text fills a missing ``content``, reasoning a missing ``reasoning``. Other item types,
media parts, encrypted reasoning and namespaced calls are refused, naming ``input``.
"""

from __future__ import annotations

import json
from typing import Any

_ROLES = frozenset(("user", "system", "developer", "assistant"))
_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))


class ResponsesInputError(ValueError):
    """A Responses request's input the reader refuses; ``param`` names the field."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages with string contents, assistant items grouped as vLLM
    groups them (see the module's docstring)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ResponsesInputError("'input' must be a string or a non-empty array of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ResponsesInputError(f"'input[{i}]' must be an item object")
        kind = item.get("type", "message")
        # vLLM joins an assistant item to the message before it only within this input,
        # never to the previous response's conversation
        prev = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "function_call":
            call = _function_call(item, i)
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ResponsesInputError(f"'input[{i}].call_id' must be a string")
            if not isinstance(output, str):
                raise ResponsesInputError(
                    f"'input[{i}].output' must be a string (an array of parts is not served here)"
                )
            out.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "reasoning":
            text = _reasoning_text(item, i)
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = text
            else:
                out.append({"role": "assistant", "reasoning": text})
        elif kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ResponsesInputError(
                    f"'input[{i}].role' must be one of {', '.join(sorted(_ROLES))}"
                )
            texts = _content_texts(item.get("content"), i)
            if role != "assistant":
                msg: dict[str, Any] = {"role": role, "content": "\n".join(t for t in texts if t)}
                # vLLM hands this item to its chat parser whole (its request model allows
                # extra fields, the items too), which keeps a string name and a
                # developer's tools for the template: rendered, they are prompt to size
                if isinstance(item.get("name"), str):
                    msg["name"] = item["name"]
                if role == "developer" and item.get("tools") is not None:
                    msg["tools"] = item["tools"]
                out.append(msg)
                continue
            text = texts[0] if texts else ""  # vLLM reads an assistant's first part only
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
            else:
                out.append({"role": "assistant", "content": text})
        else:
            raise ResponsesInputError(
                f"'input[{i}]': item type {kind!r} is not served here (messages, "
                "function_call, function_call_output and reasoning items only)"
            )
    return out


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call (vLLM's pydantic model requires the
    three strings)."""
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise ResponsesInputError(f"'input[{i}].{field}' must be a string")
    if item.get("namespace") is not None:
        # vLLM flattens a namespace into the name by a rule that varies by release
        raise ResponsesInputError(
            f"'input[{i}].namespace': namespaced function calls are not served here"
        )
    if item["arguments"]:
        # vLLM parses them to an object before its chat template sees them (an empty
        # string is {}), so text that is no JSON fails there: here, naming the item
        try:
            json.loads(item["arguments"])
        except ValueError:
            raise ResponsesInputError(f"'input[{i}].arguments' is not valid JSON") from None
    fn = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "function": fn, "type": "function"}


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    if item.get("encrypted_content") is not None:
        # vLLM refuses it ("Encrypted content is not supported") or ignores it, by how
        # pydantic resolved the item: refused here, as the gateway cannot tell which
        raise ResponsesInputError(
            f"'input[{i}].encrypted_content': encrypted reasoning is not served here"
        )
    for field in ("content", "summary"):
        parts = item.get(field)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts
        ):
            raise ResponsesInputError(
                f"'input[{i}].{field}' must be an array of parts with a string 'text'"
            )
        if parts:
            text: str = parts[0]["text"]
            return text
    return ""


def _content_texts(content: Any, i: int) -> list[str]:
    """A message's text parts' texts, in order (a string content is one)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ResponsesInputError(f"'input[{i}].content' must be a string or an array of parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ResponsesInputError(
                f"'input[{i}].content': part {kind!r} is not served here (text parts only)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ResponsesInputError(f"'input[{i}].content': a text part needs its 'text'")
        texts.append(text)
    return texts


def request_messages(
    instructions: Any,
    prior: list[dict[str, Any]],
    value: Any,
    prior_output: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """A request's whole conversation as vLLM's ``construct_input_messages`` builds it:
    its instructions (a system message); the messages the previous response was rendered
    from (``prior``, vLLM's ``msg_store``) less their system messages, as instructions do
    not carry over from one response to the next (vLLM 0.33 and main: a follow-up that
    omits them runs without any); the previous response's ``output`` (``prior_output``):
    each part of each message item its own assistant message, other items (reasoning,
    function calls) left out; then its input."""
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesInputError("'instructions' must be a string", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    history = [m for m in prior if m.get("role") != "system"]
    said = [
        {"role": "assistant", "content": part.get("text")}
        for item in prior_output or ()
        if item.get("type") == "message"
        for part in item.get("content") or ()
    ]
    return [*head, *history, *said, *input_messages(value)]


def chat_tools(tools: Any, tool_choice: Any = None) -> tuple[list[dict[str, Any]] | None, bool]:
    """A Responses request's ``tools`` as vLLM renders them (non-Harmony models): each
    ``{type: "function", name, description, parameters, strict}`` in the chat-completions
    shape ``{type: "function", function: {name, description, parameters, ...}}`` (vLLM's
    ``convert_tool_responses_to_completions_format``: the tool less its ``type``, as a
    ``FunctionDefinition``), passed to the chat template as a chat completion's ``tools``.

    Returns ``(tools, exact)``: ``exact`` False when the rendering is not one this reader
    can reproduce: a tool of another type (vLLM's built-ins ``web_search``,
    ``file_search``, ``mcp``, ``code_interpreter``; ``custom``, ``namespace``: rendered,
    if at all, by rules that vary by vLLM version and model), or ``tool_choice: "none"``
    with tools (vLLM drops the tools from the prompt in some releases, keeps them in
    others). A malformed ``tools`` is refused, naming it."""
    if tools is None:
        return None, True
    if not isinstance(tools, list):
        raise ResponsesInputError("'tools' must be an array", "tools")
    out: list[dict[str, Any]] = []
    exact = True
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ResponsesInputError(f"'tools[{i}]' must be a tool object", "tools")
        kind = tool.get("type")
        if not isinstance(kind, str) or not kind:
            raise ResponsesInputError(f"'tools[{i}].type' must be a string", "tools")
        if kind != "function":
            exact = False
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ResponsesInputError(f"'tools[{i}].name' must be a non-empty string", "tools")
        desc, params = tool.get("description"), tool.get("parameters")
        if desc is not None and not isinstance(desc, str):
            raise ResponsesInputError(f"'tools[{i}].description' must be a string", "tools")
        if params is not None and not isinstance(params, dict):
            raise ResponsesInputError(f"'tools[{i}].parameters' must be an object", "tools")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ResponsesInputError(f"'tools[{i}].strict' must be a boolean", "tools")
        # FunctionDefinition's fields first (None when absent, as its model_dump gives
        # them), then the tool's other fields (strict) as its extra fields
        fn: dict[str, Any] = {"name": name, "description": desc, "parameters": params}
        fn.update((k, v) for k, v in tool.items() if k not in fn and k != "type")
        out.append({"type": "function", "function": fn})
    if out and tool_choice == "none":
        exact = False
    return out or None, exact
