"""The Responses API's text input as chat messages, read the same way by the simulated
replica (which renders them) and the gateway (which keys and sizes them) (D30).

vLLM builds a Responses request's prompt as a chat: ``instructions`` as a system message,
then a stored previous response's conversation, then ``input`` (a string is one user
message; a list holds message items ``{role, content}`` whose content is a string or
parts of type ``input_text`` / ``output_text``). Only text messages are read here: other
item types (function calls and their outputs, reasoning) and media parts are refused,
naming ``input``.
"""

from __future__ import annotations

from typing import Any

_ROLES = frozenset(("user", "system", "developer", "assistant"))
_TEXT_PARTS = frozenset(("input_text", "output_text", "text"))


class ResponsesInputError(ValueError):
    """A Responses request's input the reader refuses; ``param`` names the field."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages with string contents (parts joined by newlines, as
    vLLM's chat parser joins a message's text parts)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ResponsesInputError("'input' must be a string or a non-empty array of messages")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ResponsesInputError(f"'input[{i}]' must be a message object")
        if item.get("type", "message") != "message":
            raise ResponsesInputError(
                f"'input[{i}]': item type {item.get('type')!r} is not served here (text "
                "messages only)"
            )
        role = item.get("role")
        if role not in _ROLES:
            raise ResponsesInputError(
                f"'input[{i}].role' must be one of {', '.join(sorted(_ROLES))}"
            )
        out.append({"role": role, "content": _content_text(item.get("content"), i)})
    return out


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
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
        if text:
            texts.append(text)
    return "\n".join(texts)


def request_messages(
    instructions: Any, prior: list[dict[str, Any]], value: Any
) -> list[dict[str, Any]]:
    """A request's whole conversation, in vLLM's order: its instructions (a system
    message), the previous response's conversation (``prior``), its input."""
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesInputError("'instructions' must be a string", "instructions")
    head = [{"role": "system", "content": instructions}] if instructions else []
    return [*head, *prior, *input_messages(value)]


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
