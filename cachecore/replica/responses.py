"""The simulated replica's Responses API (``POST /v1/responses``, ``GET
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``) for text, as vLLM serves it (D30,
D33, docs/engine.md): the request model, the bounded per-replica store of responses (vLLM
keeps its own in memory, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``; lost on a restart),
background runs and their event logs, and the response object and streamed events."""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, model_validator

from cachecore.engine import RequestOutput
from cachecore.replica.protocol import APIError
from cachecore.replica.toolcalls import CallStream, PlannedCall, random_uuid


class ResponsesRequest(BaseModel):
    """vLLM's ``ResponsesRequest``, the fields the simulated engine acts on (others are
    ignored, as unknown fields are)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Any  # read by request_messages (vLLM checks tool_choice before it)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    # function tools render into the prompt (cachecore.responses.chat_tools); read by hand
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # echoed (vLLM's default True)
    # the prompt's rendering besides messages and tools (cachecore.responses.chat_fields)
    reasoning: Any = None
    chat_template_kwargs: Any = None
    cache_salt: Any = None  # validated by hand, as the other requests' (vLLM's message)
    # vLLM's: the engine request's id and the response's (resp_ + a uuid when absent)
    request_id: str | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _background_needs_store(cls, data: Any) -> Any:
        # vLLM's ResponsesRequest.validate_background: a 400 naming background
        if isinstance(data, dict) and data.get("background") and not data.get("store", True):
            raise APIError("background can only be used when `store` is true", param="background")
        return data

    def max_tokens(self) -> int | None:
        value = self.max_output_tokens
        if value is not None and value < 1:
            raise APIError(
                f"max_output_tokens must be at least 1, got {value}.", param="max_output_tokens"
            )
        return value


def response_id(req: ResponsesRequest) -> str:
    return req.request_id or f"resp_{uuid.uuid4().hex}"


def not_found(rid: str) -> APIError:
    """vLLM's answer for an id its store does not hold (a previous or retrieved one)."""
    return APIError(
        f"Response with id '{rid}' not found.", 404, "invalid_request_error", "response_id"
    )


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    # the messages the request was rendered from (vLLM's msg_store): a follow-up continues
    # them, less their system messages, then the response's output
    messages: list[dict[str, Any]]


TERMINAL_EVENTS = frozenset(("response.completed", "response.incomplete"))
"""The events that end vLLM's replay of a background stream
(``responses_background_stream_generator``)."""


@dataclass(slots=True)
class EventLog:
    """A background stream's events as sent (vLLM's ``event_store``): each with its type,
    at the index of its sequence number, so ``starting_after`` replays from an index."""

    events: list[tuple[str, bytes]]
    signal: asyncio.Event
    closed: bool = False

    def append(self, kind: str, data: bytes) -> None:
        self.events.append((kind, data))
        self.signal.set()

    def close(self) -> None:
        self.closed = True
        self.signal.set()


class ResponseStore:
    """One replica's stored responses, least recently used evicted past ``cap``; its
    background runs (vLLM's ``background_tasks``, each removed when it ends) and the event
    logs of the streamed ones."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.runs: dict[str, asyncio.Task[None]] = {}
        self.events: dict[str, EventLog] = {}

    def run(self, rid: str, task: asyncio.Task[None]) -> None:
        self.runs[rid] = task
        task.add_done_callback(lambda _: self.runs.pop(rid, None))

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> StoredResponse | None:
        got = self._items.get(rid)
        if got is not None:
            self._items.move_to_end(rid)
        return got

    def put(self, rid: str, stored: StoredResponse) -> None:
        self._items[rid] = stored
        self._items.move_to_end(rid)
        while len(self._items) > self.cap:
            self._items.popitem(last=False)


def usage(last: RequestOutput | None) -> dict[str, Any] | None:
    if last is None:
        return None
    return {
        "input_tokens": last.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": last.num_cached_tokens},
        "output_tokens": last.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": last.num_prompt_tokens + last.num_output_tokens,
    }


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {
        "id": item_id, "type": "message", "role": "assistant", "status": status,
        "content": content,
    }  # fmt: skip


def call_item_id() -> str:
    """A ``function_call`` item's id, as vLLM's (``fc_`` + its random_uuid)."""
    return f"fc_{random_uuid()}"


def message_item_id() -> str:
    """A message item's id, as vLLM's (``msg_`` + its random_uuid)."""
    return f"msg_{random_uuid()}"


def function_call_item(
    item_id: str, call: PlannedCall, arguments: str, status: str
) -> dict[str, Any]:
    """The simulated model's call as vLLM's ``ResponseFunctionToolCall`` item."""
    return {
        "id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
        "arguments": arguments, "status": status,
    }  # fmt: skip


def call_output(call: PlannedCall, n_tokens: int, text: str) -> list[dict[str, Any]]:
    """A non-streamed response's output for the call's first ``n_tokens`` tokens, ``text``
    their text, as vLLM 0.33's build_response_output_items makes it of the parser's
    answer (:meth:`PlannedCall.parse`): a message for any content, then the call; the
    last item ``incomplete`` when ``max_tokens`` cut them (response_item_status). So a
    cut named call is its partial arguments, a cut required one no item at all."""
    content, arguments = call.parse(n_tokens, text)
    status = "incomplete" if call.cut(n_tokens) else "completed"
    out: list[dict[str, Any]] = []
    if content:
        last = "completed" if arguments is not None else status
        out.append(message_item(message_item_id(), content, last))
    if arguments is not None:
        out.append(function_call_item(call_item_id(), call, arguments, status))
    return out


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def response_object(
    rid: str,
    req: ResponsesRequest,
    model: str,
    created: int,
    output: list[dict[str, Any]],
    last: RequestOutput | None,
    queued: bool = False,
    stopped: bool = False,
) -> dict[str, Any]:
    """The response object; ``last`` None: still in progress (the stream's first events),
    or ``queued`` (a background one's first answer, vLLM's ``status="queued"``);
    ``stopped``: the model ended its output itself (a complete tool call), not at the
    cap, so ``completed``."""
    status, incomplete = "queued" if queued else "in_progress", None
    if last is not None:
        reason = last.finish_reason
        length = not stopped and reason is not None and reason.value == "length"
        status = "incomplete" if length else "completed"
        incomplete = {"reason": "max_output_tokens"} if length else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": status,
        "background": bool(req.background), "error": None, "incomplete_details": incomplete,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata, "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None, "service_tier": "auto", "store": bool(req.store),
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": {"format": {"type": "text"}}, "tool_choice": _tool_choice(req),
        "tools": req.tools or [],
        "top_logprobs": 0, "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled", "usage": usage(last), "user": req.user,
    }  # fmt: skip


def _tool_choice(req: ResponsesRequest) -> Any:
    """The response's ``tool_choice``, vLLM's echo of the request's after
    ResponsesRequest.check_tool_usage: ``"auto"`` when absent, ``"none"`` for a request
    with no tools that says ``"auto"`` or nothing."""
    choice = "auto" if req.tool_choice is None else req.tool_choice
    return "none" if not req.tools and choice == "auto" else choice


def sse_event(event: dict[str, Any]) -> bytes:
    """One event as vLLM writes it: ``event: <type>`` then its data (no ``[DONE]`` at the
    end of the stream: ``response.completed`` ends it)."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class EventSequence:
    """The stream's events in the Responses API's order, numbered."""

    def __init__(
        self,
        rid: str,
        req: ResponsesRequest,
        model: str,
        created: int,
        call: PlannedCall | None = None,
    ) -> None:
        self.rid, self.req, self.model, self.created = rid, req, model, created
        # the output item: the message, or the simulated model's call (vLLM's chat-path
        # SimpleStreamingEventProcessor: no content part, its arguments as deltas)
        self.call = call
        self.item_id = message_item_id() if call is None else call_item_id()
        self._parser = None if call is None else CallStream(call)
        self.opened = False  # the item's opening sent
        self._seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def opening(self) -> Iterator[dict[str, Any]]:
        """vLLM's responses_stream_generator sends these two before it reads the engine's
        first output: they come before the prefill."""
        pending = response_object(self.rid, self.req, self.model, self.created, [], None)
        yield self._event("response.created", response=pending)
        yield self._event("response.in_progress", response=pending)

    def item_opening(self) -> Iterator[dict[str, Any]]:
        """The message item's and its text part's opening, as vLLM's
        SimpleStreamingEventProcessor.open sends them: with the first delta, at the
        engine's first output. A call's item opens alone (emit_simple_tool_call_open)."""
        self.opened = True
        if self.call is not None:
            item = function_call_item(self.item_id, self.call, "", "in_progress")
            yield self._event("response.output_item.added", output_index=0, item=item)
            return
        yield self._event(
            "response.output_item.added", output_index=0,
            item=message_item(self.item_id, None, "in_progress"),
        )  # fmt: skip
        yield self._event(
            "response.content_part.added", item_id=self.item_id, output_index=0,
            content_index=0, part=output_text(""),
        )  # fmt: skip

    def output(self, text: str, n_tokens: int, finished: bool) -> Iterator[dict[str, Any]]:
        """The events for an engine output of ``text``, ``n_tokens`` generated so far: a
        message's (opened at the first) text delta, or what vLLM's parser makes of a
        call's tokens (:class:`CallStream`): the item's opening once the parser opens
        the call, then the arguments the output reveals, joined into one delta
        (SimpleStreamingEventProcessor.emit_delta)."""
        if self._parser is None:
            if not self.opened:
                yield from self.item_opening()
            yield self._event(
                "response.output_text.delta", item_id=self.item_id, output_index=0,
                content_index=0, delta=text, logprobs=[],
            )  # fmt: skip
            return
        entries = self._parser.step(n_tokens, finished)
        if entries and not self.opened:
            yield from self.item_opening()
        piece = "".join(e["function"].get("arguments") or "" for e in entries)
        if piece:
            yield self._event(
                "response.function_call_arguments.delta", item_id=self.item_id,
                output_index=0, delta=piece,
            )  # fmt: skip

    def items(self, text: str, last: RequestOutput | None) -> list[dict[str, Any]]:
        """The output the stream sent, the response's (vLLM's streamed_output_items): the
        message, or the call as its parser streamed it (none if it never opened), its
        status ``incomplete`` when ``max_tokens`` cut it (response_item_status)."""
        if self._parser is None:
            return [message_item(self.item_id, text, "completed")]
        if not self.opened:
            return []
        call, n = self._parser.call, last.num_output_tokens if last is not None else 0
        status = "incomplete" if call.cut(n) else "completed"
        return [function_call_item(self.item_id, call, self._parser.sent, status)]

    def closing(self, text: str, final: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if self._parser is not None:
            if self.opened:
                item = final["output"][0]
                yield self._event(
                    "response.function_call_arguments.done", item_id=self.item_id,
                    output_index=0, arguments=item["arguments"], name=item["name"],
                )  # fmt: skip
                yield self._event("response.output_item.done", output_index=0, item=item)
            # vLLM's terminal event says the response's status (the text path here still
            # ends every stream with response.completed)
            incomplete = final["status"] == "incomplete"
            kind = "response.incomplete" if incomplete else "response.completed"
            yield self._event(kind, response=final)
            return
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self._event("response.output_text.done", **at, text=text, logprobs=[])
        yield self._event("response.content_part.done", **at, part=output_text(text))
        yield self._event(
            "response.output_item.done", output_index=0,
            item=message_item(self.item_id, text, "completed"),
        )  # fmt: skip
        yield self._event("response.completed", response=final)
