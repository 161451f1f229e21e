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
