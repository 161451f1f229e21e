"""The Responses API's input as chat messages, read the same way by the simulated replica
(which renders them) and the gateway (which keys and sizes them) (D30, D31).

vLLM builds a Responses request's prompt as a chat: ``instructions`` as a system message,
then a stored previous response's conversation (its system messages dropped) and output,
then ``input`` (a string is one user message; a list holds items). The items are read as
vLLM's ``construct_input_messages`` / ``construct_chat_messages_with_tool_call``
(``vllm/entrypoints/openai/responses/utils.py``, formerly
``vllm/entrypoints/responses_utils.py``) turns them into chat messages for non-Harmony
models:

- a message ``{role, content}`` (content a string or parts): a user, system or developer
  one (``input_text`` parts only: vLLM's request model refuses others) as that message
  (its parts as ``text`` parts, which the chat reader reads in the template's content
  format as vLLM's chat parser does: joined by newlines for a string template), with
  its string ``name``
  and a developer's ``tools`` (vLLM passes the item to its chat parser whole, which keeps
  both for the template); an assistant one (all ``output_text`` parts, with its ``type``
  or an ``id``; or all ``input_text`` parts) as an assistant message of its *first*
  part's text (no name);
- ``function_call`` ``{call_id, name, arguments[, namespace]}``: an assistant message
  with ``tool_calls: [{id: call_id, function: {name, arguments}, type: "function"}]``, a
  non-empty namespace flattened into the name as ``<namespace>__<name>``;
- ``custom_tool_call`` ``{call_id, name, input}``: as a function call whose arguments are
  vLLM's ``encode_custom_tool_input``, ``json.dumps({"input": input},
  ensure_ascii=False)`` (its ``namespace`` not read);
- ``function_call_output`` and ``custom_tool_call_output`` ``{call_id, output}``:
  ``{role: "tool", content: output, tool_call_id: call_id}`` (an array of ``input_text``
  parts: as ``text`` parts, which the chat reader joins as vLLM's chat parser joins a
  tool message's parts; a custom one's array is spent by that first rendering,
  :func:`stored_messages`);
- ``reasoning``: an assistant message with ``reasoning`` (its first content part's text,
  else its first summary part's, else empty); an empty ``encrypted_content`` is absent.

An assistant item right after an assistant message read from the same ``input`` joins it
where that message lacks its part: a function or custom tool call adds to its
``tool_calls`` (so
parallel calls, and a text answer followed by its calls, are one message), an assistant
text fills a missing ``content``, reasoning a missing ``reasoning``. Other item types,
media parts, encrypted reasoning and what vLLM's request model refuses are refused,
naming ``input``. A last message or reasoning item ``in_progress`` or ``incomplete`` is
continued (:func:`chat_fields`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cachecore.laxbool import lax_bool
from cachecore.tokenizer import REASONING_EFFORTS, ServerChatDefaults

_ROLES = frozenset(("user", "system", "developer", "assistant"))
_TEXT_PARTS = ("input_text", "output_text", "text")
_STATUSES = ("in_progress", "completed", "incomplete")
_PARTIAL = ("in_progress", "incomplete")
# vLLM's CUSTOM_TOOL_INPUT_KEY: a custom tool's free-form input as its function shim's one
# string parameter
CUSTOM_TOOL_INPUT_KEY = "input"


class ResponsesInputError(ValueError):
    """A Responses request's input the reader refuses; ``param`` names the field."""

    def __init__(self, message: str, param: str = "input") -> None:
        super().__init__(message)
        self.param = param


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages (a content a string, or ``text`` parts), assistant
    items grouped as vLLM groups them (see the module's docstring)."""
    return _read_input(value)[0]


def stored_messages(messages: list[dict[str, Any]], value: Any) -> list[dict[str, Any]]:
    """The conversation vLLM keeps for a follow-up (its ``msg_store``): ``messages``, the
    ones a response's prompt was rendered from (:func:`request_messages`, ``value`` its
    input), except a ``custom_tool_call_output`` item's array ``output``. vLLM's request
    model holds that one as the lazy iterator pydantic makes of the SDK's ``Iterable``
    (a function call output's is a list), which the first rendering consumes: the stored
    tool message renders with no content (``""``) in every follow-up."""
    read, spent = _read_input(value)
    if not spent:
        return messages
    start = len(messages) - len(read)
    out = list(messages)
    for j in spent:
        out[start + j] = {**out[start + j], "content": ""}
    return out


def _read_input(value: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """:func:`input_messages`, and the indices of the messages whose content vLLM reads
    from a one-shot iterator (:func:`stored_messages`)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], []
    if not isinstance(value, list) or not value:
        raise ResponsesInputError("'input' must be a string or a non-empty array of items")
    out: list[dict[str, Any]] = []
    spent: list[int] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ResponsesInputError(f"'input[{i}]' must be an item object")
        kind = item.get("type", "message")
        # vLLM joins an assistant item to the message before it only within this input,
        # never to the previous response's conversation
        prev = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind in ("function_call", "custom_tool_call"):
            call = _function_call(item, i) if kind == "function_call" else _custom_call(item, i)
            if prev is not None:
                prev.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise ResponsesInputError(f"'input[{i}].call_id' must be a string")
            if kind == "custom_tool_call_output" and not isinstance(item.get("id", ""), str):
                raise ResponsesInputError(f"'input[{i}].id' must be a string")
            if not isinstance(output, str):
                # vLLM hands the parts to its chat parser as the tool message's content,
                # which reads them in the template's content format (cachecore.tokenizer:
                # joined, empty ones dropped, for a string template)
                output = _text_parts(_parts_texts(output, i, "output", ("input_text",)))
                if kind == "custom_tool_call_output":
                    spent.append(len(out))
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
            if role != "assistant":
                kinds = _TEXT_PARTS if _referenced(item) else ("input_text",)
                texts = _content_texts(item, i, kinds)
                # a list of parts stays one, read by the chat reader in the template's
                # content format (joined by newlines for a string one) as vLLM reads it
                content = item["content"]
                if not isinstance(content, str):
                    content = _text_parts(texts)
                msg: dict[str, Any] = {"role": role, "content": content}
                # vLLM hands this item to its chat parser whole (its request model allows
                # extra fields, the items too), which keeps a string name and a
                # developer's tools for the template: rendered, they are prompt to size
                if isinstance(item.get("name"), str):
                    msg["name"] = item["name"]
                if role == "developer" and item.get("tools") is not None:
                    msg["tools"] = item["tools"]
                out.append(msg)
                continue
            said = _assistant_text(item, i)
            if said is None:
                # no parts and no type: vLLM passes the item on as a message of its own
                out.append({"role": "assistant", "content": ""})
            elif prev is not None and prev.get("content") is None:
                prev["content"] = said
            else:
                out.append({"role": "assistant", "content": said})
        else:
            raise ResponsesInputError(
                f"'input[{i}]': item type {kind!r} is not served here (messages, "
                "function_call, function_call_output, custom_tool_call, "
                "custom_tool_call_output and reasoning items only)"
            )
    return out, spent


def flat_namespace_name(namespace: str, name: str) -> str:
    """vLLM 0.33's ``flat_namespace_tool_name``: the one name a function inside a
    ``namespace`` tool is shown to the model (and called) by."""
    return f"{namespace}__{name}"


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call (vLLM's pydantic model requires the
    three strings; a ``namespace`` given is a string or null)."""
    _string_fields(item, i, ("call_id", "name", "arguments"), ("namespace",))
    name, namespace = item["name"], item.get("namespace")
    if namespace:
        name = flat_namespace_name(namespace, name)
    # the string as is: the chat reader makes the object the template sees, as vLLM's
    # chat parser does (text that is no JSON object rendered as {}, D31)
    fn = {"name": name, "arguments": item["arguments"]}
    return {"id": item["call_id"], "function": fn, "type": "function"}


def _custom_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    """A ``custom_tool_call`` item as vLLM 0.33 renders it: a function tool call whose
    arguments carry the free-form input as ``{"input": ...}`` (``encode_custom_tool_input``,
    the single-string function a ``custom`` tool is shown as, :func:`chat_tools`). Its
    request model requires the three strings; an ``id`` or ``namespace`` given is a
    string or null (the namespace is not rendered)."""
    _string_fields(item, i, ("call_id", "name", "input"), ("id", "namespace"))
    arguments = json.dumps({CUSTOM_TOOL_INPUT_KEY: item["input"]}, ensure_ascii=False)
    fn = {"name": item["name"], "arguments": arguments}
    return {"id": item["call_id"], "function": fn, "type": "function"}


def _string_fields(
    item: dict[str, Any], i: int, required: tuple[str, ...], optional: tuple[str, ...]
) -> None:
    """A call item's string fields as its request model types them, in order: each of
    ``required`` a string, then each of ``optional`` a string or null; the first that is
    not refused, naming it."""
    for field in required:
        if not isinstance(item.get(field), str):
            raise ResponsesInputError(f"'input[{i}].{field}' must be a string")
    for field in optional:
        if item.get(field) is not None and not isinstance(item[field], str):
            raise ResponsesInputError(f"'input[{i}].{field}' must be a string")


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    """A reasoning item's text as vLLM reads its ``ResponseReasoningItem`` (an item that
    does not validate as one is refused there, by its request model or as an unsupported
    item: here, naming the field)."""
    if "id" in item and not isinstance(item["id"], str):
        raise ResponsesInputError(f"'input[{i}].id' must be a string")  # absent: vLLM adds one
    status = item.get("status")
    if status is not None and status not in _STATUSES:
        raise ResponsesInputError(f"'input[{i}].status' must be one of {', '.join(_STATUSES)}")
    secret = item.get("encrypted_content")
    if secret is not None and not isinstance(secret, str):
        raise ResponsesInputError(f"'input[{i}].encrypted_content' must be a string")
    if secret:
        # vLLM: "Encrypted content is not supported." (an empty one is read as absent)
        raise ResponsesInputError(
            f"'input[{i}].encrypted_content': encrypted reasoning is not served here"
        )
    if not isinstance(item.get("summary"), list):
        raise ResponsesInputError(f"'input[{i}].summary' must be an array of parts")
    summary = _parts_texts(item["summary"], i, "summary", ("summary_text",))
    content = item.get("content")
    texts = [] if content is None else _parts_texts(content, i, "content", ("reasoning_text",))
    return (texts or summary or [""])[0]


def _assistant_text(item: dict[str, Any], i: int) -> str | None:
    """An assistant message item's text as vLLM reads it: a string content whole, else its
    first part's. Its parts all ``output_text`` (vLLM's ``ResponseOutputMessage``, which
    its request model builds from an item with its ``type``) or all ``input_text`` (an
    easy input message); other mixes are refused by vLLM's request model, unless it
    takes the item as a reference (:func:`_referenced`). None: no parts and no ``type``,
    which vLLM passes on as a message of its own (with its ``type``, vLLM fails on the
    missing first part)."""
    content = item.get("content")
    referenced = _referenced(item)
    texts = _content_texts(item, i, _TEXT_PARTS if referenced else ("output_text", "input_text"))
    if isinstance(content, str):
        return content
    typed = "type" in item
    if not content:
        if typed:
            raise ResponsesInputError(f"'input[{i}].content': an assistant message needs a part")
        return None
    if referenced:
        return texts[0]
    kinds = {part["type"] for part in content}
    if len(kinds) > 1:
        raise ResponsesInputError(
            f"'input[{i}].content': an assistant message's parts are all output_text or "
            "all input_text"
        )
    if kinds == {"output_text"}:
        # vLLM gives a typed item its id and status when absent; given, they must fit
        if not typed or not isinstance(item.get("id", ""), str):
            raise ResponsesInputError(
                f"'input[{i}].id': an assistant message of output_text parts needs its "
                "'type' (and a string 'id', if any) or a string 'id'"
            )
        if "status" in item and item["status"] not in _STATUSES:
            raise ResponsesInputError(f"'input[{i}].status' must be one of {', '.join(_STATUSES)}")
    return texts[0]


def _referenced(item: dict[str, Any]) -> bool:
    """Whether vLLM's request model takes the item as an item reference (``{id[, type:
    "item_reference"]}``, its extra fields allowed): an untyped item with a string ``id``
    validates so whatever else it holds, and vLLM's reader then reads it by its role
    (its text parts of any kind, as the chat parser reads them)."""
    return "type" not in item and isinstance(item.get("id"), str)


def _text_parts(texts: list[str]) -> list[dict[str, str]]:
    """Texts as the chat message parts the chat reader takes (``text`` parts, in order,
    empty ones kept: an openai-format template sees them)."""
    return [{"type": "text", "text": t} for t in texts]


def _content_texts(item: dict[str, Any], i: int, kinds: tuple[str, ...]) -> list[str]:
    """A message item's texts, in order: a string content is one, else its parts'."""
    content = item.get("content")
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ResponsesInputError(f"'input[{i}].content' must be a string or an array of parts")
    return _parts_texts(content, i, "content", kinds)


def _parts_texts(parts: Any, i: int, field: str, kinds: tuple[str, ...]) -> list[str]:
    """The texts of an item's array of parts, in order, each part of one of ``kinds``
    with a string ``text`` (vLLM's request model refuses other text parts there; media
    parts are not served here)."""
    if not isinstance(parts, list):
        raise ResponsesInputError(f"'input[{i}].{field}' must be an array of parts")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in kinds:
            raise ResponsesInputError(
                f"'input[{i}].{field}': part {kind!r} is not served here ({', '.join(kinds)} "
                "parts only)"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ResponsesInputError(f"'input[{i}].{field}': a {kind} part needs its 'text'")
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


def continues_final_message(value: Any) -> bool:
    """Whether vLLM continues the input's last message instead of starting a new turn
    (its ``should_continue_final_message``): the last item a message (of any role) or
    reasoning item whose ``status`` is ``in_progress`` or ``incomplete``."""
    if not isinstance(value, list) or not value or not isinstance(value[-1], dict):
        return False
    last = value[-1]
    return (
        last.get("type", "message") in ("message", "reasoning") and last.get("status") in _PARTIAL
    )


def chat_fields(value: Any, reasoning: Any, template_kwargs: Any) -> dict[str, Any]:
    """The chat completion fields besides messages and tools that render a Responses
    request's prompt as vLLM's ``ResponsesRequest.build_chat_params`` renders it, read by
    the chat path as a chat completion's (``cachecore.tokenizer.ChatOptions.from_body``, its
    ``"responses"`` form):
    ``add_generation_prompt`` and ``continue_final_message`` (a partial final message,
    :func:`continues_final_message`, is continued: no generation prompt, the chat cut
    after its content), ``reasoning_effort`` (``reasoning.effort``, when given) and the
    request's ``chat_template_kwargs``. A malformed one is refused, naming it."""
    cont = continues_final_message(value)
    fields: dict[str, Any] = {"add_generation_prompt": not cont, "continue_final_message": cont}
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise ResponsesInputError("'reasoning' must be an object", "reasoning")
        effort = reasoning.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ResponsesInputError(
                f"'reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}",
                "reasoning.effort",
            )
        if effort is not None:
            fields["reasoning_effort"] = effort
    if template_kwargs is not None:
        if not isinstance(template_kwargs, dict):
            raise ResponsesInputError(
                "'chat_template_kwargs' must be an object", "chat_template_kwargs"
            )
        fields["chat_template_kwargs"] = template_kwargs
    return fields


@dataclass(frozen=True, slots=True)
class RenderedRequest:
    """A Responses request as the chat vLLM renders it (:func:`render_request`)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # in the chat-completions shape (:func:`chat_tools`)
    exact: bool  # False: tools this reader cannot render as the engine does (no keys)
    fields: dict[str, Any]  # the chat completion's rendering fields (:func:`chat_fields`)


def render_request(
    body: Any,
    prior: list[dict[str, Any]],
    prior_output: list[dict[str, Any]] | None = None,
    server: ServerChatDefaults | None = None,
) -> RenderedRequest:
    """A Responses request's fields (``body``: a mapping, or an object with them as
    attributes, as the replica's parsed request) read in vLLM 0.33's order of refusals:
    :func:`check_tool_usage` (its first validators), the conversation
    (:func:`request_messages` over ``prior`` and ``prior_output``), the tools (none
    rendered where ``server``, the engine's flags, excludes them:
    :meth:`~cachecore.tokenizer.ServerChatDefaults.excludes_tools`), the rendering fields.
    The gateway (keys and size, with no prior conversation) and the simulated replica
    (its prompt) both read a request through this one function."""

    def get(name: str) -> Any:
        return body.get(name) if isinstance(body, Mapping) else getattr(body, name, None)

    tools, choice = get("tools"), get("tool_choice")
    check_tool_usage(tools, choice)
    messages = request_messages(get("instructions"), prior, get("input"), prior_output)
    rendered, exact = _render_tools(tools)
    if rendered is not None and server is not None and server.excludes_tools(choice):
        # construct_tool_dicts' None (validated first): the server's default tools render
        rendered = None
    fields = chat_fields(get("input"), get("reasoning"), get("chat_template_kwargs"))
    return RenderedRequest(messages, rendered, exact, fields)


def chat_tools(tools: Any, tool_choice: Any = None) -> tuple[list[dict[str, Any]] | None, bool]:
    """A Responses request's ``tools`` as vLLM 0.33 renders them (non-Harmony models: its
    ``construct_tool_dicts`` over ``get_function_tools``), in request order, each in the
    chat-completions shape ``{type: "function", function: {name, description, parameters
    [, strict][, defer_loading]}}`` (vLLM's ``FunctionDefinition`` dump: ``strict`` and
    ``defer_loading`` only when set, a tool's other fields dropped), passed to the chat
    template as a chat completion's ``tools``:

    - a ``function`` tool ``{name, description, parameters, strict, defer_loading}``;
    - a ``custom`` tool as the single-string function vLLM shows it as
      (``custom_tool_as_function_dict``): its name and description, parameters one
      required string ``input``; its ``defer_loading`` and ``format`` not rendered (a
      grammar ``format`` is vLLM's 400 naming ``tools``);
    - a ``namespace`` tool ``{name, description, tools}`` as its function tools, in their
      order at its place, each named ``<namespace>__<name>`` (:func:`flat_namespace_name`)
      and otherwise rendered as a top-level function tool; its custom tools and its own
      description are not rendered (:func:`_namespace_functions`).

    Returns ``(tools, exact)``: ``exact`` False when the rendering is not one this reader
    can reproduce: a tool of another type (vLLM's built-ins ``web_search``,
    ``file_search``, ``mcp``, ``code_interpreter``, not rendered for the model). Under
    ``tool_choice: "none"`` they render as any other (a server started with
    ``--exclude-tools-when-tool-choice-none`` renders none: :func:`render_request`). A
    named ``tool_choice`` renders nothing (vLLM resolves a namespaced function's local
    name to its flat one for its grammar, not for the prompt), but one vLLM refuses is
    refused first (:func:`check_tool_usage`). A malformed ``tools`` is refused, naming
    it. ``strict`` and ``defer_loading`` are read as pydantic's lax booleans
    (:func:`_lax_bool`) and rendered as the booleans vLLM's models make of them."""
    check_tool_usage(tools, tool_choice)
    return _render_tools(tools)


def _render_tools(tools: Any) -> tuple[list[dict[str, Any]] | None, bool]:
    """:func:`chat_tools` once :func:`check_tool_usage` has passed."""
    if tools is None:
        return None, True
    if not isinstance(tools, list):
        raise ResponsesInputError("'tools' must be an array", "tools")
    if not tools:  # construct_tool_dicts: no tools render none
        return None, True
    out: list[dict[str, Any]] = []
    exact = True
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = _tool_kind(tool, where)
        if kind == "namespace":
            out.extend(_namespace_functions(tool, where))
            continue
        if kind not in ("function", "custom"):
            exact = False
            continue
        name = tool.get("name")
        if not isinstance(name, str):  # an empty one is served, as vLLM's models take it
            raise ResponsesInputError(f"'{where}.name' must be a string", "tools")
        if kind == "custom":
            _check_tool_fields(tool, where)
            _check_custom_format(tool.get("format"), where)
            fn = {
                "name": name,
                "description": tool.get("description"),
                "parameters": _custom_tool_parameters(),
            }
        else:
            fn = _function_definition(tool, where, name)
        out.append({"type": "function", "function": fn})
    # tools of vLLM's built-in types alone render [] (construct_tool_dicts' list), which
    # preprocess_chat lays over a server's default tools: none rendered
    return out, exact


def _tool_kind(tool: Any, where: str) -> str:
    if not isinstance(tool, dict):
        raise ResponsesInputError(f"'{where}' must be a tool object", "tools")
    kind = tool.get("type")
    if not isinstance(kind, str) or not kind:
        raise ResponsesInputError(f"'{where}.type' must be a string", "tools")
    return kind


def check_tool_usage(tools: Any, choice: Any) -> None:
    """vLLM 0.33's first two checks of a Responses request, ahead of every other field
    (its request model's last before-validators, which pydantic runs first), so a
    request they refuse is refused naming what vLLM names: :func:`_check_tool_choice`,
    then a top-level custom tool with a grammar format (``check_custom_tool_format``, a
    400 naming ``tools``). Call it before reading the input."""
    _check_tool_choice(tools, choice)
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        fmt = tool.get("format") if isinstance(tool, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "grammar" and tool.get("type") == "custom":
            _check_custom_format(fmt, f"tools[{i}]")  # refused: a top-level tool's grammar


def _check_tool_choice(tools: Any, choice: Any) -> None:
    """The ``tool_choice`` vLLM 0.33's ``check_tool_usage`` refuses (a 400 naming
    ``tool_choice``, before its request model reads any other field): ``"required"``
    with no tools; a named choice (``{type: "function" | "custom", name}``) with no
    tools, with no name, or naming no tool. A name matches a tool's (a top-level tool of
    any type, or a namespaced function by its flat ``<namespace>__<name>``), else a
    namespaced tool's local name in exactly one namespace (in several: ambiguous).
    vLLM skips the check when a namespace has no string ``name`` or no ``tools`` array
    (refused as ``tools`` later); the type is not matched, only the name. A ``tools``
    that is no array is read as vLLM reads it, before its type is checked: an empty
    string or object is no tools, another string or object holds no tool (vLLM iterates
    its characters or keys); a number is left to the ``tools`` refusal."""
    if isinstance(tools, (bool, int, float)):
        return  # no len(): vLLM's check fails on it (not a 400 naming tool_choice)
    if not isinstance(tools, list):
        tools = [None] if tools else []  # entries that are no tool
    message = "Tool choice 'function' not found in 'tools' parameter."
    if not tools:
        if choice == "required":
            message = "Tool choice 'required' must be specified with 'tools' parameter."
        elif not _named_choice(choice):
            return
        raise ResponsesInputError(message, "tool_choice")
    if not _named_choice(choice):
        return
    name = choice.get("name")
    if not name or not isinstance(name, str):
        raise ResponsesInputError(message, "tool_choice")
    exact: set[str] = set()
    local: dict[str, list[str]] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue  # no name (refused as tools later)
        if tool.get("type") != "namespace":
            if isinstance(tool.get("name"), str):
                exact.add(tool["name"])
            continue
        namespace, inner = tool.get("name"), tool.get("tools")
        if not isinstance(namespace, str) or not isinstance(inner, list):
            return
        for sub in inner:
            sub_name = sub.get("name") if isinstance(sub, dict) else None
            if isinstance(sub_name, str):
                flat = flat_namespace_name(namespace, sub_name)
                exact.add(flat)
                local.setdefault(sub_name, []).append(flat)
    found = local.get(name, [])
    if name in exact or len(found) == 1:
        return
    if found:
        raise ResponsesInputError(
            f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(found)}). Select it by its full '<namespace>__<name>' name.",
            "tool_choice",
        )
    raise ResponsesInputError(message, "tool_choice")


def _named_choice(choice: Any) -> bool:
    return isinstance(choice, dict) and choice.get("type") in ("function", "custom")


def _lax_bool(value: Any, where: str) -> bool | None:
    """An optional boolean field as vLLM's pydantic models read it
    (:func:`cachecore.laxbool.lax_bool`); anything else refused, naming ``tools``. The
    boolean is what vLLM renders."""
    try:
        return lax_bool(value)
    except ValueError:
        raise ResponsesInputError(f"'{where}' must be a boolean", "tools") from None


def _check_tool_fields(tool: dict[str, Any], where: str) -> None:
    """The fields a function or custom tool shares, as vLLM's request model types them
    (a function's ``strict`` read with its rendering; a custom tool has none, so a
    ``strict`` there is an extra field the SDK's ``CustomTool`` keeps unread, whatever
    its value)."""
    if tool.get("description") is not None and not isinstance(tool["description"], str):
        raise ResponsesInputError(f"'{where}.description' must be a string", "tools")
    _lax_bool(tool.get("defer_loading"), f"{where}.defer_loading")


def _function_definition(tool: dict[str, Any], where: str, name: str) -> dict[str, Any]:
    """A function tool as vLLM's ``FunctionDefinition`` dumps it, under ``name``."""
    _check_tool_fields(tool, where)
    params = tool.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ResponsesInputError(f"'{where}.parameters' must be an object", "tools")
    fn = {"name": name, "description": tool.get("description"), "parameters": params}
    # FunctionDefinition's serializer: these two only when set (as the booleans pydantic
    # made of them), nothing else
    for flag in ("strict", "defer_loading"):
        value = _lax_bool(tool.get(flag), f"{where}.{flag}")
        if value is not None:
            fn[flag] = value
    return fn


def _namespace_functions(tool: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A ``namespace`` tool's function tools as vLLM 0.33 renders them
    (``get_function_tools``): each a ``FunctionTool`` named ``<namespace>__<name>`` with
    its other fields, so dumped as a top-level function is; its ``custom`` tools are not
    rendered (not even as the one-string function), nor its description. Refused, naming
    ``tools``, as vLLM's request model (the SDK's ``NamespaceTool``) refuses them: a
    ``name`` or ``description`` not a string (both required; an empty name is served, the
    flat name then ``__<name>``), ``tools`` not an array, an inner tool neither
    ``function`` nor ``custom``, an inner name not a string, a custom one's malformed
    ``format`` (a well-formed grammar is served here: vLLM's grammar check reads top-level
    tools only); and, as vLLM's rendering refuses it (a ``ValueError``, its 400), a
    function's ``parameters`` that is not an object (the SDK types it any value inside a
    namespace)."""
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str):
        raise ResponsesInputError(f"'{where}.name' must be a string", "tools")
    if not isinstance(tool.get("description"), str):
        raise ResponsesInputError(f"'{where}.description' must be a string", "tools")
    if not isinstance(inner, list):
        raise ResponsesInputError(f"'{where}.tools' must be an array", "tools")
    out: list[dict[str, Any]] = []
    for j, sub in enumerate(inner):
        at = f"{where}.tools[{j}]"
        kind = _tool_kind(sub, at)
        if kind not in ("function", "custom"):
            raise ResponsesInputError(
                f"'{at}.type' must be 'function' or 'custom' in a namespace", "tools"
            )
        name = sub.get("name")
        if not isinstance(name, str):
            raise ResponsesInputError(f"'{at}.name' must be a string", "tools")
        if kind == "custom":
            _check_tool_fields(sub, at)
            _check_custom_format(sub.get("format"), at, grammar_served=True)
            continue
        fn = _function_definition(sub, at, flat_namespace_name(namespace, name))
        out.append({"type": "function", "function": fn})
    return out


def _custom_tool_parameters() -> dict[str, Any]:
    """vLLM 0.33's ``custom_tool_parameters``: the schema of the one-string function a
    ``custom`` tool is shown to the model as (a fresh dict: the caller's to keep)."""
    return {
        "type": "object",
        "properties": {
            CUSTOM_TOOL_INPUT_KEY: {
                "type": "string",
                "description": "The freeform text payload for this tool.",
            }
        },
        "required": [CUSTOM_TOOL_INPUT_KEY],
        "additionalProperties": False,
    }


def _check_custom_format(fmt: Any, where: str, grammar_served: bool = False) -> None:
    """A custom tool's ``format`` as vLLM's request model takes it: absent, ``{type:
    "text"}``, or a grammar ``{definition, syntax: lark | regex}``, which vLLM refuses in a
    top-level tool (free-form text custom tools only) and serves inside a namespace."""
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "grammar" and not grammar_served:
        raise ResponsesInputError(
            f"'{where}.format': custom tools with a grammar format are not supported; "
            "only free-form text custom tools are accepted",
            "tools",
        )
    grammar = (
        kind == "grammar"
        and isinstance(fmt.get("definition"), str)
        and fmt.get("syntax") in ("lark", "regex")
    )
    if kind != "text" and not grammar:
        raise ResponsesInputError(
            f'\'{where}.format\' must be {{"type": "text"}} or a grammar', "tools"
        )
