"""The simulated model's tool calls: when a chat completion or a Responses request asks
for one, the replica answers a call of a function it offers, in vLLM's shapes (D31,
docs/engine.md).

The model has no weights, so the decision is a rule: ``tool_choice`` ``"required"`` calls
the first function tool, a named choice that function, and ``"auto"`` (or no choice) the
first function tool when the conversation's last message is the user's and holds
:data:`CALL_MARKER` (a tool's result after it is answered with text); ``"none"`` never.
The arguments are a JSON object with a value for each property of the function's
``parameters`` (by its JSON type; a string is ``<property>-<8 hex digits of the prompt>``),
so the same prompt makes the same call. The engine generates what vLLM's model would for
that choice (:func:`plan_call`): under a named choice the arguments alone, under
``"required"`` the JSON list vLLM's structured output forces (``[{"name", "parameters"}]``),
under ``"auto"`` a Hermes-style ``<tool_call>`` block (what vLLM's ``hermes`` parser
reads); those tokens are its output, so ``completion_tokens`` and the decode blocks are the
call's.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from cachecore.keys import tokens_to_bytes
from cachecore.tokenizer import HFTokenizer

CALL_MARKER = "[tool_call]"
"""In the conversation's last message, the user's, makes ``tool_choice: "auto"`` (or none)
call the first function tool: the simulated model's only reason to call one unasked."""

ToolForm = Literal["chat", "responses"]


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """A call the simulated model makes: the function, its arguments (JSON text), the text
    the engine generates for it with its token ids and each id's end offset in that text."""

    name: str
    arguments: str
    text: str
    ids: tuple[int, ...]
    ends: tuple[int, ...]
    named: bool  # a named tool_choice: OpenAI's finish_reason is "stop", not "tool_calls"
    forced: bool  # "required" or a named tool_choice (vLLM's _forces_tool_calls)
    id: str = field(default_factory=lambda: call_id())  # the call's id (vLLM's)

    @property
    def arguments_at(self) -> int:
        """Where the arguments start in :attr:`text`."""
        return self.text.index(self.arguments)

    @property
    def kind(self) -> Literal["named", "required", "auto"]:
        return "named" if self.named else "required" if self.forced else "auto"

    def shown(self, n_tokens: int) -> int:
        """How much of :attr:`text` the first ``n_tokens`` generated tokens hold."""
        return self.ends[n_tokens - 1] if n_tokens > 0 else 0

    def arguments_after(self, n_tokens: int) -> str:
        """The part of the arguments the first ``n_tokens`` generated tokens hold (what a
        tool parser can stream by then)."""
        end, start = self.shown(n_tokens), self.arguments_at
        return self.arguments[: max(0, min(end - start, len(self.arguments)))]

    def streamed_arguments(self, n_tokens: int) -> str:
        """The arguments vLLM's parser has streamed after ``n_tokens``: the Hermes parser
        reads a partial block stripped (``_extract_tool_call_jsons``), so a trailing space
        waits for the next token; the named and required paths send the text as is."""
        args = self.arguments_after(n_tokens)
        if self.kind == "auto" and len(args) < len(self.arguments):
            return args.rstrip()
        return args

    def opened_after(self, n_tokens: int) -> bool:
        """Whether vLLM's parser has opened the call (sent its id, type and name) after
        ``n_tokens``: a named one at the first output (extract_named_tool_call_streaming),
        a required one once the name is whole and the arguments begun
        (extract_required_tool_call_streaming: ``_RequiredToolCallSpan.ready``), an auto
        one once the Hermes block's name is whole (its ``"name": "..."`` closed)."""
        if self.kind == "named":
            return n_tokens > 0
        if self.kind == "required":
            return self.arguments_after(n_tokens) != ""
        key = '"name": '
        name_end = self.text.index(key) + len(key) + len(json.dumps(self.name, ensure_ascii=False))
        return self.shown(n_tokens) >= name_end

    def cut(self, n_tokens: int) -> bool:
        """Whether ``max_tokens`` stopped the call's tokens at ``n_tokens``."""
        return n_tokens < len(self.ids)

    def parse(self, n_tokens: int, text: str) -> tuple[str | None, str | None]:
        """What vLLM 0.33's non-streamed path answers for the call's first ``n_tokens``
        tokens, ``text`` their text: the message content and the call's arguments (None:
        no call), as ``Parser._extract_tool_calls`` then assemble_chat_message_fields
        (a forced call's content ``""``) make them. Whole, the call. Cut by
        ``max_tokens``: a named choice's partial arguments as its call (the path takes
        the text as the arguments); a required one's list no longer parses (no call); an
        auto one is the raw text unless the Hermes parser reads its block as JSON (cut
        after its object: the call, content null)."""
        if not self.cut(n_tokens):
            return ("" if self.forced else None), self.arguments
        if self.kind == "named":
            partial = self.arguments_after(n_tokens)
            return "", (partial if partial.strip() else None)
        if self.kind == "required":
            return "", None
        start = "<tool_call>"
        try:  # hermes_tool_parser.extract_tool_calls: an unclosed block's rest, as JSON
            block = json.loads(text[len(start) :]) if text.startswith(start) else None
        except ValueError:
            block = None
        if isinstance(block, dict) and "name" in block and "arguments" in block:
            return None, json.dumps(block["arguments"], ensure_ascii=False)
        return text, None


class CallStream:
    """vLLM 0.33's tool parser over a call's tokens as the engine streams them
    (``Parser._extract_tool_calls_streaming``): each output's ``DeltaToolCall`` entries,
    as a chat chunk's ``delta.tool_calls`` holds them (unset fields left out, as vLLM's
    ``exclude_unset`` dump). Nothing until the parser opens the call
    (:meth:`PlannedCall.opened_after`); then its id, type and name with the arguments so
    far (the Hermes parser sends the name alone and the arguments as an entry of their
    own), then each output's new arguments (the required path names ``name: null``)."""

    def __init__(self, call: PlannedCall) -> None:
        self.call = call
        self.opened = False
        self.sent = ""  # the arguments streamed so far

    def step(self, n_tokens: int, finished: bool = False) -> list[dict[str, Any]]:
        """The entries for the output that brings the call to ``n_tokens``, the last one
        when ``finished``."""
        call = self.call
        if not self.opened and not call.opened_after(n_tokens):
            return []
        shown = call.streamed_arguments(n_tokens)
        piece, self.sent = shown[len(self.sent) :], shown
        if not self.opened:
            self.opened = True
            head = {"id": call.id, "type": "function", "index": 0}
            if call.kind != "auto":
                return [{**head, "function": {"name": call.name, "arguments": piece}}]
            entries: list[dict[str, Any]] = [{**head, "function": {"name": call.name}}]
            if piece:
                entries.append({"index": 0, "function": {"arguments": piece}})
            elif finished:
                # max_tokens cut the block right after its name: finalize_generation
                # appends the parser's unstreamed arguments, a call without any "{}"
                # (ToolParser.get_remaining_unstreamed_args)
                entries[0]["function"]["arguments"] = self.sent = "{}"
            return entries
        if not piece:
            return []
        fn = {"name": None, "arguments": piece} if call.kind == "required" else {"arguments": piece}
        return [{"index": 0, "function": fn}]


def random_uuid() -> str:
    """vLLM's ``random_uuid`` (vllm/utils): a uuid4's low 64 bits, 16 hex digits."""
    return f"{uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def call_id() -> str:
    """vLLM's tool call id (``make_tool_call_id``: ``chatcmpl-tool-`` + a random_uuid),
    which its chat path gives a chat completion's call and a Responses
    ``function_call``'s ``call_id`` alike."""
    return f"chatcmpl-tool-{random_uuid()}"


def _functions(tools: Any, form: ToolForm) -> list[tuple[str, Mapping[str, Any]]]:
    """The function tools offered (name, parameters), in order."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    if not isinstance(tools, list):
        return out
    for tool in tools:
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
            continue
        fn = tool.get("function") if form == "chat" else tool
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        out.append((fn["name"], params if isinstance(params, Mapping) else {}))
    return out


def _named(choice: Any, form: ToolForm) -> str | None:
    if not isinstance(choice, Mapping) or choice.get("type") != "function":
        return None
    fn = choice.get("function") if form == "chat" else choice
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return name if isinstance(name, str) else None


def _last_user_text(messages: Sequence[Any]) -> str:
    """The conversation's last message's text when the user sent it: after a tool's result
    (or any later turn) the model answers it, so an auto loop ends with text."""
    msg = messages[-1] if messages else None
    if not isinstance(msg, Mapping) or msg.get("role") != "user":
        return ""
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


_VALUES: dict[str, Any] = {
    "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}, "null": None,
}  # fmt: skip


def _arguments(params: Mapping[str, Any], prompt_ids: Sequence[int]) -> dict[str, Any]:
    digest = hashlib.blake2b(tokens_to_bytes(prompt_ids), digest_size=4).hexdigest()
    props = params.get("properties")
    out: dict[str, Any] = {}
    for prop, schema in props.items() if isinstance(props, Mapping) else ():
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        out[str(prop)] = (
            _VALUES[kind] if isinstance(kind, str) and kind in _VALUES else f"{prop}-{digest}"
        )
    return out


def plan_call(
    tok: HFTokenizer,
    tools: Any,
    tool_choice: Any,
    messages: Sequence[Any],
    prompt_ids: Sequence[int],
    form: ToolForm,
) -> PlannedCall | None:
    """The call the simulated model makes for a request offering ``tools`` (its own
    shape: a chat's ``{type, function: {name, parameters}}``, a Responses request's
    ``{type, name, parameters}``) under ``tool_choice``, ``messages`` its conversation and
    ``prompt_ids`` its prompt; None: it answers text."""
    functions = _functions(tools, form)
    if not functions or tool_choice == "none":
        return None
    named = _named(tool_choice, form)
    if named is not None:
        params = dict(functions).get(named)
        if params is None:
            return None
        name = named
    elif tool_choice == "required" or (
        tool_choice in (None, "auto") and CALL_MARKER in _last_user_text(messages)
    ):
        name, params = functions[0]
    else:
        return None
    args = _arguments(params, prompt_ids)
    arguments = json.dumps(args, ensure_ascii=False)
    if named is not None:
        text = arguments
    elif tool_choice == "required":
        text = json.dumps([{"name": name, "parameters": args}], ensure_ascii=False)
    else:
        # unescaped as the arguments are (their text must lie in it: arguments_at)
        block = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
        text = "<tool_call>\n" + block + "\n</tool_call>"
    ids, offsets = tok.encode_offsets(text)
    ends = tuple(e for _, e in offsets)
    forced = named is not None or tool_choice == "required"
    return PlannedCall(name, arguments, text, tuple(ids), ends, named is not None, forced)


def call_finish(call: PlannedCall, cut: bool = False) -> str:
    """A call's chat ``finish_reason``: vLLM's ``resolve_finish_reason``, ``length`` for a
    call ``max_tokens`` cut (a truncated call stays visible as one), else ``tool_calls``
    unless the client forced a named tool (OpenAI's ``stop``)."""
    if cut:
        return "length"
    return "stop" if call.named else "tool_calls"
