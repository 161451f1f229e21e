"""The HTTP face of a simulated replica: vLLM's OpenAI-compatible endpoints plus the
SGLang/router helper endpoints and kvgate's debug/chaos endpoints.

Endpoints: ``/v1/chat/completions``, ``/v1/completions`` (JSON or SSE), ``/v1/embeddings``,
``/pooling``, ``/classify``, ``/score`` (``/v1/score``), ``/rerank`` (``/v1/rerank``,
``/v2/rerank``), ``/v1/responses`` (and ``GET /v1/responses/{id}``, ``POST
/v1/responses/{id}/cancel``), ``/v1/models``,
``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``, ``/v1/chat/completions/render``,
``/v1/completions/render``, ``/get_load``, ``/get_server_info`` (``/server_info``),
``/get_model_info`` (``/model_info``), ``/flush_cache`` and ``/reset_prefix_cache``,
``/version``; debug: ``GET /debug/blocks``, ``POST /debug/restart``, ``/debug/drop_events``,
``/debug/pause``, ``/debug/health``. See docs/engine.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from cachecore.engine import (
    DEFAULT_MAX_TOKENS,
    EngineRequest,
    RequestOutput,
    RequestRejectedError,
)
from cachecore.replica.driver import EngineDriver, EngineStoppedError, RequestHandle
from cachecore.replica.protocol import (
    CLASSIFY_LABELS,
    EMBEDDING_DIM,
    SSE_DONE,
    APIError,
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    PoolingInputRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
    batch_usage,
    chat_chunk,
    chat_response,
    class_probs,
    completion_batch_response,
    completion_chunk,
    completion_prompt_ids,
    completion_prompts,
    completion_response,
    embedding_response,
    embedding_vector,
    encode_floats,
    error_body,
    now_s,
    option_error,
    pair_score,
    pooling_usage,
    sse,
    tool_call,
    usage,
    usage_chunk,
    validate_common,
    validate_salt,
)
from cachecore.replica.responses import (
    TERMINAL_EVENTS,
    EventLog,
    EventSequence,
    ResponsesRequest,
    StoredResponse,
    call_output,
    message_item,
    message_item_id,
    not_found,
    response_id,
    response_object,
    sse_event,
)
from cachecore.replica.server import SimReplica
from cachecore.replica.toolcalls import (
    CallStream,
    PlannedCall,
    call_finish,
    plan_call,
)
from cachecore.responses import (
    ResponsesInputError,
    render_request,
    stored_messages,
)
from cachecore.tasks import cancel_and_wait
from cachecore.tokenizer import (
    UNLOCKED_ENCODE_CHARS,
    ChatOptions,
    SegmentCache,
    ServerChatDefaults,
    TokenizerError,
    score_template_kwargs,
    truncate_score_pairs,
    with_special_tokens,
)

logger = logging.getLogger(__name__)

# a /score or /rerank request's score template variables (vLLM's ScoringRequestMixin)
_TEMPLATE_FIELDS = {"chat_template_kwargs", "instruction"}

_Finish = Callable[[str, RequestOutput | None, list[dict[str, Any]] | None], dict[str, Any]]
"""A Responses request's end: its text, its last engine output, the output items a stream
sent (None: not streamed, built of the text) to the finished response object, stored."""


async def until_disconnect(request: Request) -> None:
    """Returns when the client of a request whose body was read disconnects (uvicorn
    answers ``receive`` with ``http.disconnect`` then, or once the response is sent)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


M = TypeVar("M", bound=BaseModel)


async def _parse(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw else {}
    except ValueError as exc:
        raise APIError(f"invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def _options(req: Any, server: ServerChatDefaults) -> ChatOptions | None:
    """``req``'s chat options (``chat_options()``) on a replica started with ``server``'s
    flags, a refusal answered as the gateway's (``option_error``):
    a 400 naming the field its text quotes first, or none where vLLM names none."""
    try:
        opts: ChatOptions | None = req.chat_options(server)
    except TokenizerError as exc:
        raise option_error(exc) from exc
    return opts


def validation_error(exc: ValidationError) -> APIError:
    """A request model's refusal as vLLM's 400: the first field refused, ``param`` naming
    it. A field of several types (``stop``: a string or a list of strings) fails once per
    type, its locations tagged with the type: all are said, ``param`` the field alone."""
    errors = exc.errors()
    first = errors[0]
    top = first["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == top] if top else [first]
    said = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in same)
    param = ".".join(str(x) for x in (top if len(same) > 1 else first["loc"]))
    return APIError(said, param=param or None)


P = TypeVar("P", bound=PoolingInputRequest | ScoreRequest | RerankRequest)


class _ClientGone(Exception):
    """A pooling request whose client hung up before its answer (each engine request
    aborted): answered 499, which nobody reads."""


class _ResponsesStreamBroken(RuntimeError):
    """A Responses stream whose engine request failed: vLLM 0.33's
    responses_stream_generator turns the GenerationError into an ErrorResponse and
    validates it as a StreamingResponsesResponse, which it is not (no event type takes an
    ``{"error": ...}`` object): the ValidationError propagates out of the body after its
    200 head, and the connection ends without a terminal event, or any error event."""


@dataclass(frozen=True)
class _Pooled(Generic[P]):
    """A pooling request the engine ran: the request, its engine id, each prompt's ids,
    and the prompt tokens the engine counted (its usage)."""

    req: P
    rid: str
    ids: list[list[int]]
    n_prompt: int


def _json_bytes(data: dict[str, Any]) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


def create_app(replica: SimReplica) -> FastAPI:
    app = FastAPI(title=f"kvgate simulated replica {replica.index}", docs_url=None, redoc_url=None)
    tok = replica.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(_ClientGone)
    async def _client_gone(_: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the client is gone

    def check_model(name: str | None) -> str | None:
        try:
            return replica.resolve_model(name)
        except KeyError:
            raise APIError(
                f"The model `{name}` does not exist.", 404, "NotFoundError", "model"
            ) from None

    def engine_id(
        request: Request,
        req: ChatCompletionRequest
        | CompletionRequest
        | PoolingInputRequest
        | ScoreRequest
        | RerankRequest,
    ) -> str | None:
        # vLLM's order: the X-Request-Id header, then the body's request_id, else a uuid
        return request.headers.get("x-request-id") or req.request_id

    def submit(
        prefix: str,
        prompt_ids: list[int],
        max_tokens: int,
        salt: str | None,
        lora: str | None,
        rid: str | None,
        reads_cache: bool = True,
        pooling: bool = False,
        output: tuple[int, ...] = (),
    ) -> tuple[EngineDriver, RequestHandle]:
        driver = replica.driver
        request_id = f"{prefix}-{rid or uuid.uuid4().hex}"
        try:
            handle = driver.submit(
                EngineRequest(
                    request_id, prompt_ids, max_tokens, cache_salt=salt, lora_name=lora,
                    skip_reading_prefix_cache=not reads_cache, pooling=pooling,
                    output_token_ids=output,
                )
            )  # fmt: skip
        except RequestRejectedError as exc:
            raise APIError(str(exc)) from exc
        return driver, handle

    def call_run(
        call: PlannedCall | None, asked: int | None, default: int
    ) -> tuple[int, tuple[int, ...]]:
        """The engine's ``max_tokens`` and output for a request that may make ``call``
        (``asked``: the client's cap, None when it set none; ``default`` the cap then): the
        call's tokens, stopped at their end as a model stops at its EOS, or at the cap
        (answered as vLLM answers a cut call: :meth:`PlannedCall.parse`)."""
        if call is None:
            return (asked if asked is not None else default), ()
        n = len(call.ids)
        return (n if asked is None else min(asked, n)), call.ids

    async def collect(driver: EngineDriver, handle: RequestHandle) -> tuple[str, RequestOutput]:
        ids: list[int] = []
        last: RequestOutput | None = None
        try:
            async for out in handle.outputs():
                ids.extend(out.new_token_ids)
                last = out
        except EngineStoppedError as exc:
            raise APIError(str(exc), 503) from exc
        finally:
            driver.abort(handle.request_id)  # no-op once finished; frees on cancellation
        assert last is not None
        return replica.token_text(ids), last

    async def collect_unless_gone(
        request: Request, driver: EngineDriver, handle: RequestHandle
    ) -> tuple[str, RequestOutput] | None:
        """:func:`collect`, abandoned (the engine request aborted) if the client hangs up
        first, as vLLM's server cancels a non-streamed request whose client left. None
        then: there is nobody to answer."""
        work = asyncio.ensure_future(collect(driver, handle))
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                await cancel_and_wait(work)  # collect's finally aborts the engine request
            await cancel_and_wait(gone)
        if work.cancelled():
            return None
        return work.result()

    async def stream(
        driver: EngineDriver,
        handle: RequestHandle,
        model: str,
        chat: bool,
        include_usage: bool,
        continuous_usage: bool,
        call: PlannedCall | None = None,
    ) -> AsyncIterator[bytes]:
        created = now_s()
        rid = handle.request_id
        obj = "chat.completion.chunk" if chat else "text_completion"
        last: RequestOutput | None = None
        call_deltas = None if call is None else tool_call_deltas(call)
        try:
            async for out in handle.outputs():
                if chat and last is None:
                    # like vLLM: the role chunk goes out with the first token, so the time
                    # to the first chunk is the time to first token
                    role = {"role": "assistant", "content": ""}
                    yield sse(chat_chunk(rid, model, created, role, None))
                last = out
                finish = out.finish_reason.value if out.finish_reason else None
                if call_deltas is not None:
                    delta, finish = call_deltas(out)
                    if delta is None:
                        continue  # no argument text yet: nothing a parser streams
                    chunk = chat_chunk(rid, model, created, delta, finish)
                elif chat:
                    text = replica.token_text(out.new_token_ids)
                    chunk = chat_chunk(rid, model, created, {"content": text}, finish)
                else:
                    text = replica.token_text(out.new_token_ids)
                    chunk = completion_chunk(rid, model, created, text, finish)
                if continuous_usage:
                    chunk["usage"] = usage(out)
                yield sse(chunk)
            if include_usage and last is not None:
                yield sse(usage_chunk(rid, model, created, obj, last))
        except EngineStoppedError as exc:
            yield sse(error_body(str(exc), 503, "ServiceUnavailableError"))
        finally:
            driver.abort(rid)
        yield SSE_DONE

    def tool_call_deltas(
        call: PlannedCall,
    ) -> Callable[[RequestOutput], tuple[dict[str, Any] | None, str | None]]:
        """A streamed call's chunk deltas, one engine output at a time, as vLLM's chat
        stream sends them (:class:`CallStream`): nothing until its parser opens the call,
        the Hermes parser's with ``content: null``; the last with the finish reason (an
        empty delta when it carries nothing else). None: no chunk."""
        parser = CallStream(call)

        def step(out: RequestOutput) -> tuple[dict[str, Any] | None, str | None]:
            n, ended = out.num_output_tokens, out.finish_reason is not None
            finish = call_finish(call, call.cut(n)) if ended else None
            entries = parser.step(n, ended)
            if not entries:
                return ({} if finish else None), finish
            if call.kind == "auto":  # the hermes parser's DeltaMessage(content=None, ...)
                return {"content": None, "tool_calls": entries}, finish
            return {"tool_calls": entries}, finish

        return step

    def stream_flags(req: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
        so = req.stream_options
        if so is None:
            return False, False
        return bool(so.include_usage), bool(so.continuous_usage_stats)

    # ``salt``: the request's cache salt as validate_common returned it (the cache scope)
    async def chat_prompt(req: ChatCompletionRequest, salt: str | None) -> list[int]:
        try:
            text = tok.apply_chat_template(
                req.messages, req.add_generation_prompt, _options(req, replica.chat_defaults)
            )
        except TokenizerError as exc:
            raise APIError(str(exc), param="messages") from exc
        ids = await encode(text, salt or "")
        keep = req.truncation(replica.core.max_model_len)
        if not req.add_special_tokens:
            return req.truncate(ids, keep, ((), ()))
        return req.truncate(with_special_tokens(tok, ids), keep, tok.special_affixes)

    async def completion_ids(req: CompletionRequest, salt: str | None, prompt: Any) -> list[int]:
        """The ids the engine runs for ``prompt``, one of the request's
        (:func:`completion_prompts`)."""
        if isinstance(prompt, str) and len(prompt) >= UNLOCKED_ENCODE_CHARS:
            ids = await encode(prompt, salt or "")
        else:
            ids = completion_prompt_ids(prompt, tok.encode, tok.vocab_size)
        # a text prompt gets the tokenizer's special tokens, as vLLM adds them (token ids
        # are the client's own); then vLLM's truncate_prompt_tokens
        keep = req.truncation(replica.core.max_model_len)
        if isinstance(prompt, str) and req.add_special_tokens:
            return req.truncate(with_special_tokens(tok, ids), keep, tok.special_affixes)
        return req.truncate(ids, keep, ((), ()))

    async def completion_batch(
        request: Request,
        req: CompletionRequest,
        prompts: list[Any],
        salt: str | None,
        lora: str | None,
        model: str,
    ) -> Response:
        """A batch of prompts as vLLM serves it: one engine request per prompt (ids
        ``<id>-<i>``), one choice each (``index`` i), usage summed (:func:`batch_usage`)."""
        ids = [await completion_ids(req, salt, p) for p in prompts]
        rid = engine_id(request, req) or uuid.uuid4().hex
        handles: list[tuple[EngineDriver, RequestHandle]] = []
        try:
            for i, prompt_ids in enumerate(ids):
                request_id = f"{rid}-{i}"
                reads = req.reads_prefix_cache()
                max_tokens = req.requested_max_tokens()
                handles.append(
                    submit("cmpl", prompt_ids, max_tokens, salt, lora, request_id, reads)
                )
        except APIError:
            for driver, handle in handles:  # refused as a whole, as vLLM validates first
                driver.abort(handle.request_id)
            raise
        if req.stream:
            inc, cont = stream_flags(req)
            return StreamingResponse(
                stream_batch(handles, f"cmpl-{rid}", model, inc, cont),
                media_type="text/event-stream",
            )
        work = asyncio.gather(*(collect(driver, handle) for driver, handle in handles))
        got = await gather_unless_gone(request, work)
        if got is None:
            return Response(status_code=499)
        return JSONResponse(completion_batch_response(f"cmpl-{rid}", model, got, now_s()))

    async def gather_unless_gone(
        request: Request, work: asyncio.Future[list[tuple[str, RequestOutput]]]
    ) -> list[tuple[str, RequestOutput]] | None:
        """``work`` (a batch's collects), abandoned if the client hangs up first: each
        collect's finally aborts its engine request. None then."""
        gone = asyncio.ensure_future(until_disconnect(request))
        abandoned = False
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                abandoned = True
                await cancel_and_wait(work)
            await cancel_and_wait(gone)
        # a cancelled gather is not cancelled(): it holds a CancelledError as its exception
        if abandoned or work.cancelled():
            return None
        return work.result()

    async def stream_batch(
        handles: list[tuple[EngineDriver, RequestHandle]],
        rid: str,
        model: str,
        include_usage: bool,
        continuous_usage: bool,
    ) -> AsyncIterator[bytes]:
        """A batch's stream: each prompt's chunks as they come, ``index`` the prompt's
        place; one usage chunk for the batch at the end (vLLM's)."""
        created = now_s()
        queue: asyncio.Queue[tuple[int, RequestOutput | EngineStoppedError | None]]
        queue = asyncio.Queue()

        async def pump(i: int, handle: RequestHandle) -> None:
            try:
                async for out in handle.outputs():
                    queue.put_nowait((i, out))
            except EngineStoppedError as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, h)) for i, (_, h) in enumerate(handles)]
        lasts: list[RequestOutput | None] = [None] * len(handles)
        try:
            open_ = len(handles)
            while open_:
                i, item = await queue.get()
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, EngineStoppedError):
                    yield sse(error_body(str(item), 503, "ServiceUnavailableError"))
                    break
                lasts[i] = item
                text = replica.token_text(item.new_token_ids)
                finish = item.finish_reason.value if item.finish_reason else None
                chunk = completion_chunk(rid, model, created, text, finish)
                chunk["choices"][0]["index"] = i
                if continuous_usage:
                    chunk["usage"] = usage(item)
                yield sse(chunk)
            else:
                done = [o for o in lasts if o is not None]
                if include_usage and len(done) == len(lasts):
                    chunk = usage_chunk(rid, model, created, "text_completion", done[-1])
                    chunk["usage"] = batch_usage(done)
                    yield sse(chunk)
        finally:
            for task in tasks:
                await cancel_and_wait(task)
            for driver, handle in handles:
                driver.abort(handle.request_id)
        yield SSE_DONE

    # A router that renders every request on every replica (vllm-router ``cache_aware``)
    # has each replica tokenize the same long shared prefixes over and over, ~4 ms of CPU
    # each: on a small machine that burst delays the engines' step timers. Segments of
    # rendered text are cached per scope (the cache salt, like the prefix cache), so a
    # known system prompt is one dict probe. Only worker threads touch the cache.
    segments = app.state.segments = SegmentCache(tok)
    segments_lock = threading.Lock()

    def encode_cached(text: str, scope: str) -> list[int]:
        with segments_lock:
            return segments.encode(text, scope)

    async def encode(text: str, scope: str = "") -> list[int]:
        # ~3 us per token in Rust, without the GIL from UNLOCKED_ENCODE_CHARS on: long
        # prompts go to a thread so tokenization does not stall the engine loop
        if len(text) < UNLOCKED_ENCODE_CHARS:
            return tok.encode(text)
        return await asyncio.to_thread(encode_cached, text, scope)

    # ------------------------------------------------------------------ generation
    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        lora = check_model(req.model)
        salt = validate_common(req)
        ids = await chat_prompt(req, salt)
        model = req.model or replica.model
        max_tokens = req.requested_max_tokens()
        asked = None if req.max_completion_tokens is None and req.max_tokens is None else max_tokens
        call = plan_call(tok, req.tools, req.tool_choice, req.messages, ids, "chat")
        max_tokens, output = call_run(call, asked, max_tokens)
        driver, handle = submit(
            "chatcmpl", ids, max_tokens, salt, lora, engine_id(request, req),
            req.reads_prefix_cache(), output=output,
        )  # fmt: skip
        if req.stream:
            inc, cont = stream_flags(req)
            return StreamingResponse(
                stream(driver, handle, model, True, inc, cont, call),
                media_type="text/event-stream",
            )
        got = await collect_unless_gone(request, driver, handle)
        if got is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        text, last = got
        if call is not None:
            n = last.num_output_tokens
            content, arguments = call.parse(n, text)
            calls = [] if arguments is None else [tool_call(call.id, call.name, arguments)]
            answer = chat_response(
                handle.request_id, model, content, last, now_s(), calls,
                call_finish(call, call.cut(n)),
            )  # fmt: skip
            return JSONResponse(answer)
        return JSONResponse(chat_response(handle.request_id, model, text, last, now_s()))

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        lora = check_model(req.model)
        salt = validate_common(req)
        prompts = completion_prompts(req.prompt)
        model = req.model or replica.model
        if len(prompts) > 1:
            return await completion_batch(request, req, prompts, salt, lora, model)
        ids = await completion_ids(req, salt, prompts[0])
        driver, handle = submit(
            "cmpl", ids, req.requested_max_tokens(), salt, lora, engine_id(request, req),
            req.reads_prefix_cache(),
        )  # fmt: skip
        if req.stream:
            inc, cont = stream_flags(req)
            return StreamingResponse(
                stream(driver, handle, model, False, inc, cont), media_type="text/event-stream"
            )
        got = await collect_unless_gone(request, driver, handle)
        if got is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        text, last = got
        return JSONResponse(completion_response(handle.request_id, model, text, last, now_s()))

    # ------------------------------------------------------------------ responses
    # vLLM's Responses API for text (D30): the conversation (instructions, a stored
    # previous response's messages less their system ones and its output, the input,
    # cachecore.responses.request_messages) rendered with the chat template
    # and run as a chat completion is, so prefix caching, KV events and metrics see it
    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> Response:
        req = await _parse(request, ResponsesRequest)
        lora = check_model(req.model)
        salt = validate_salt(req.cache_salt)
        max_tokens = req.max_tokens()
        prior: list[dict[str, Any]] = []
        prior_output: list[dict[str, Any]] | None = None
        if req.previous_response_id is not None:
            prev = replica.responses.get(req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id)
            prior, prior_output = prev.messages, prev.response["output"]
        try:
            # in vLLM's order of refusals, as the gateway reads it: the function tools
            # render whatever tool_choice says but "none" under the server's
            # --exclude-tools-when-tool-choice-none, other types do not
            rendered = render_request(req, prior, prior_output, replica.chat_defaults)
        except ResponsesInputError as exc:
            raise APIError(str(exc), param=exc.param) from exc
        messages, fields = rendered.messages, rendered.fields
        try:
            opts = ChatOptions.from_body(
                {**fields, "tools": rendered.tools}, "responses", replica.chat_defaults
            )
        except TokenizerError as exc:
            raise option_error(exc) from exc
        try:
            text = tok.apply_chat_template(messages, fields["add_generation_prompt"], opts)
        except TokenizerError as exc:
            raise APIError(str(exc), param="input") from exc
        ids = await encode(text, salt or "")
        rid = response_id(req)
        model = req.model or replica.model
        call = plan_call(tok, req.tools, req.tool_choice, messages, ids, "responses")
        run_tokens, output = call_run(call, max_tokens, DEFAULT_MAX_TOKENS)
        driver, handle = submit(
            "resp", ids, run_tokens, salt, lora, rid.removeprefix("resp_"), output=output
        )
        created = now_s()

        def finish(
            text: str, last: RequestOutput | None, streamed: list[dict[str, Any]] | None
        ) -> dict[str, Any]:
            """The finished response, its output what the stream sent (``streamed``) or
            else ``text`` as a message or what vLLM's parser makes of the call
            (:func:`call_output`), stored: every way a response ends."""
            n = last.num_output_tokens if last is not None else 0
            if streamed is not None:
                output = streamed
            elif call is not None:
                output = call_output(call, n, text)
            else:
                output = [message_item(message_item_id(), text, "completed")]
            # the model stopped itself (completed) at a whole call's end, not at the cap
            stopped = call is not None and not call.cut(n)
            final = response_object(rid, req, model, created, output, last, stopped=stopped)
            # vLLM keeps the messages this prompt was rendered from (a custom tool output's
            # parts spent by this rendering: stored_messages) and the response, whose
            # output a follow-up appends (request_messages); a cancelled one stays
            # cancelled (responses_full_generator)
            if req.store:
                kept = stored_messages(messages, req.input)
                was = replica.responses.get(rid)
                if was is None or was.response["status"] != "cancelled":
                    replica.responses.put(rid, StoredResponse(final, kept))
            return final

        if req.background:
            # vLLM's create_responses: a queued response stored at once, the request run
            # by a task of its own (not the connection's); streamed, its events kept for a
            # replay and this answer one (responses_background_stream_generator)
            queued = response_object(rid, req, model, created, [], None, queued=True)
            kept = stored_messages(messages, req.input)
            replica.responses.put(rid, StoredResponse(queued, kept))
            if req.stream:
                log = replica.responses.events[rid] = EventLog([], asyncio.Event())
                run = background_stream(driver, handle, rid, req, model, created, finish, log, call)
            else:
                run = background_run(driver, handle, rid, finish)
            replica.responses.run(rid, asyncio.ensure_future(run))
            if req.stream:
                return StreamingResponse(replay(rid, None), media_type="text/event-stream")
            return _json_bytes(queued)

        if req.stream:
            return StreamingResponse(
                response_events(driver, handle, rid, req, model, created, finish, call),
                media_type="text/event-stream",
            )
        got = await collect_unless_gone(request, driver, handle)
        if got is None:
            return Response(status_code=499)
        out, last = got
        return _json_bytes(finish(out, last, None))

    async def response_events(
        driver: EngineDriver,
        handle: RequestHandle,
        rid: str,
        req: ResponsesRequest,
        model: str,
        created: int,
        finish: _Finish,
        call: PlannedCall | None = None,
    ) -> AsyncIterator[bytes]:
        seq = EventSequence(rid, req, model, created, call)
        texts: list[str] = []
        last: RequestOutput | None = None
        try:
            for event in seq.opening():
                yield sse_event(event)
            async for out in handle.outputs():
                last = out
                piece = replica.token_text(out.new_token_ids)
                texts.append(piece)
                ended = out.finish_reason is not None
                for event in seq.output(piece, out.num_output_tokens, ended):
                    yield sse_event(event)
            if not seq.opened and call is None:
                for event in seq.item_opening():
                    yield sse_event(event)
            text = "".join(texts)
            final = finish(text, last, seq.items(text, last))
            for event in seq.closing(text, final):
                yield sse_event(event)
        except EngineStoppedError as exc:
            raise _ResponsesStreamBroken(f"engine request failed: {exc}") from exc
        finally:
            driver.abort(handle.request_id)

    async def background_run(
        driver: EngineDriver, handle: RequestHandle, rid: str, finish: _Finish
    ) -> None:
        """vLLM's _run_background_request: the stored response stays ``queued`` until it
        ends (vLLM never stores ``in_progress``); an engine failure makes it ``failed``
        unless completed or cancelled meanwhile."""
        try:
            out, last = await collect(driver, handle)
        except APIError:
            got = replica.responses.get(rid)
            if got is not None and got.response["status"] not in ("completed", "cancelled"):
                got.response["status"] = "failed"
            return
        finish(out, last, None)

    async def background_stream(
        driver: EngineDriver,
        handle: RequestHandle,
        rid: str,
        req: ResponsesRequest,
        model: str,
        created: int,
        finish: _Finish,
        log: EventLog,
        call: PlannedCall | None,
    ) -> None:
        """vLLM's _run_background_request_stream: the stream's events into ``log``. A run
        that fails records no error event (:class:`_ResponsesStreamBroken`: vLLM's task
        raises), so the stored response stays ``queued`` and the stream just stops
        (vLLM's replay then waits; this one ends, as :func:`replay`)."""
        try:
            events = response_events(driver, handle, rid, req, model, created, finish, call)
            async for data in events:
                kind = data.split(b"\n", 1)[0].removeprefix(b"event: ").decode()
                log.append(kind, data)
        except _ResponsesStreamBroken:
            pass  # vLLM's task ends on it; nothing awaits it to read it
        finally:
            log.close()

    async def replay(rid: str, starting_after: int | None) -> AsyncIterator[bytes]:
        """vLLM's responses_background_stream_generator: the events after
        ``starting_after`` (from the first without), then each as it comes, to
        ``response.completed`` or ``response.incomplete``. vLLM waits on for ever after a
        run that ended without one (cancelled, failed); this ends the stream there. An id
        without a streamed run fails inside the stream, after its 200 head, as vLLM's."""
        log = replica.responses.events.get(rid)
        if log is None:
            raise APIError(f"Unknown response_id: {rid}", param="response_id")
        at = 0 if starting_after is None else starting_after + 1
        while True:
            log.signal.clear()
            while at < len(log.events):
                kind, data = log.events[at]
                yield data
                if kind in TERMINAL_EVENTS:
                    return
                at += 1
            if log.closed:
                return
            await log.signal.wait()

    @app.get("/v1/responses/{rid}", response_model=None)
    async def retrieve_response(
        rid: str, starting_after: int | None = None, stream: bool | None = False
    ) -> Response:
        got = replica.responses.get(rid)
        if got is None:
            raise not_found(rid)
        if stream:
            return StreamingResponse(replay(rid, starting_after), media_type="text/event-stream")
        return _json_bytes(got.response)

    @app.post("/v1/responses/{rid}/cancel", response_model=None)
    async def cancel_response(rid: str) -> Response:
        # vLLM's cancel_responses: an unknown id its 404; one no longer queued or in
        # progress (finished, a synchronous one) a 400; else cancelled, its run aborted
        got = replica.responses.get(rid)
        if got is None:
            raise not_found(rid)
        if got.response["status"] not in ("queued", "in_progress"):
            raise APIError(
                "Cannot cancel a synchronous response.",
                err_type="invalid_request_error",
                param="response_id",
            )
        got.response["status"] = "cancelled"
        task = replica.responses.runs.get(rid)
        if task is not None:
            await cancel_and_wait(task)  # its collect/stream aborts the engine request
        return _json_bytes(got.response)

    # ------------------------------------------------------------------ pooling
    # vLLM serves these for pooling models only (each model its own tasks: embed, classify,
    # score); the simulated model answers them all. Each prompt (an input, or a pair of
    # texts) is one prefill-only engine request under the request's cache salt, so it
    # takes modelled prefill time, occupies the batch and shows in /metrics and /get_load.
    async def input_ids(req: PoolingInputRequest, salt: str | None) -> list[list[int]]:
        """The ids of each prompt of a pooling request over inputs: each input (a text
        with the tokenizer's special tokens when asked, token ids as they are), or the chat
        form's messages rendered with the chat template, as one prompt."""
        prompts = req.prompts()  # a 400 when neither form is given
        keep = req.truncation(replica.core.max_model_len)
        special = req.special_tokens()
        if req.chat:
            ids = []
            conversations = req.conversations()  # a batch's: each its engine request
            opts = _options(req, replica.chat_defaults)  # one reading for all of them
            for conversation in conversations:
                try:
                    rendered = tok.apply_chat_template(
                        conversation, req.add_generation_prompt, opts
                    )
                except TokenizerError as exc:
                    raise APIError(str(exc), param="messages") from exc
                got = await encode(rendered, salt or "")
                if special:
                    got = with_special_tokens(tok, got)
                # the template's own text is no special token the tokenizer added
                ids.append(req.truncate(got, keep, tok.special_affixes if special else ((), ())))
            return ids
        ids = []
        for prompt in prompts:
            if isinstance(prompt, str) and len(prompt) >= UNLOCKED_ENCODE_CHARS:
                got = await encode(prompt, salt or "")
            else:
                got = completion_prompt_ids(prompt, tok.encode, tok.vocab_size, "input")
            text = isinstance(prompt, str)
            if text and special:
                got = with_special_tokens(tok, got)
            ids.append(req.truncate(got, keep, tok.special_affixes if text else ((), ())))
        return ids

    async def pair_ids(req: ScoreRequest | RerankRequest, salt: str | None) -> list[list[int]]:
        """The ids of each pair: both texts' tokens as one prompt laid out by the
        tokenizer's pair template (vLLM 0.33's cross-encoder ``tokenizer(text_1,
        text_pair=text_2)``: RoBERTa's ``<s> a </s></s> b </s>``); a text shared by many
        pairs (a rerank's query) tokenized once. With a score template (a vLLM
        cross-encoder's ``--chat-template``), each pair is its rendering, tokenized with
        the special tokens and truncated as one text, as vLLM 0.33's ``get_score_prompt``
        runs it."""
        pairs = req.pairs()  # a 400 for vLLM's refusals
        keep = req.truncation(replica.core.max_model_len)
        per_query, per_doc = req.token_limits(replica.core.max_model_len)
        # each query and document cut before pairing or templating, as vLLM cuts them
        pairs = truncate_score_pairs(tok, pairs, per_query, per_doc)
        template = replica.score_template
        if template is not None:
            try:
                kwargs = score_template_kwargs(req.model_dump(include=_TEMPLATE_FIELDS))
                texts = template.render_pairs(tok, pairs, kwargs)
            except TokenizerError as exc:
                raise option_error(exc) from exc
            rendered = [with_special_tokens(tok, await encode(t, salt or "")) for t in texts]
            return [req.truncate(ids, keep, tok.special_affixes) for ids in rendered]
        seen: dict[str, list[int]] = {}
        for text in {t for pair in pairs for t in pair}:
            seen[text] = await encode(text, salt or "")
        return [req.truncate_pair(tok, seen[a], seen[b], keep, per_doc) for a, b in pairs]

    async def run_pooled(
        request: Request,
        prefix: str,
        rid: str,
        ids: list[list[int]],
        salt: str | None,
        lora: str | None,
    ) -> list[tuple[str, RequestOutput]] | None:
        """Each prompt one prefill-only engine request (``<prefix>-<rid>-<i>``), refused as
        a whole (vLLM validates first); None when the client left first (each aborted)."""
        handles: list[tuple[EngineDriver, RequestHandle]] = []
        try:
            for i, prompt_ids in enumerate(ids):
                handles.append(submit(prefix, prompt_ids, 1, salt, lora, f"{rid}-{i}", True, True))
        except APIError:
            for driver, handle in handles:
                driver.abort(handle.request_id)
            raise
        work = asyncio.gather(*(collect(driver, handle) for driver, handle in handles))
        return await gather_unless_gone(request, work)

    async def pooled(request: Request, model: type[P], prefix: str) -> _Pooled[P]:
        """What every pooling endpoint does before it shapes its answer, in vLLM's order:
        the body parsed (its 400s), the model (404), the salt, the endpoint's own field
        checks, each prompt's ids (an input's, or a pair's), one engine request each
        (:func:`run_pooled`). A client that left first is :class:`_ClientGone` (a 499,
        each engine request aborted)."""
        req = await _parse(request, model)
        lora = check_model(req.model)
        salt = validate_salt(req.cache_salt)
        req.check_fields()
        if isinstance(req, PoolingInputRequest):
            ids = await input_ids(req, salt)
        else:
            ids = await pair_ids(req, salt)
        pad = req.padded_len(replica.core.max_model_len)
        if pad is not None:  # the tokenizer's pad token (its EOS), after any truncation
            ids = [p + [tok.eos_token_id] * (pad - len(p)) for p in ids]
        rid = engine_id(request, req) or uuid.uuid4().hex
        got_all = await run_pooled(request, prefix, rid, ids, salt, lora)
        if got_all is None:
            raise _ClientGone
        return _Pooled(req, rid, ids, sum(last.num_prompt_tokens for _, last in got_all))

    def pooled_list(kind: str, got: _Pooled[Any], data: list[dict[str, Any]]) -> Response:
        """vLLM's ``object: list`` answer of /pooling, /classify and /score: ``data`` and
        the usage of the prompts the engine computed."""
        return _json_bytes(
            {
                "id": f"{kind}-{got.rid}", "object": "list", "created": now_s(),
                "model": got.req.model or replica.model, "data": data,
                "usage": pooling_usage(got.n_prompt),
            }
        )  # fmt: skip

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(request: Request) -> Response:
        """vLLM's embeddings endpoint, either form (``input`` or ``messages``); the vectors
        are :func:`embedding_vector`'s."""
        got = await pooled(request, EmbeddingRequest, "embd")
        req = got.req
        vectors = [embedding_vector(p, req.output_dimensions()) for p in got.ids]
        return _json_bytes(
            embedding_response(
                f"embd-{got.rid}",
                req.model or replica.model,
                vectors,
                got.n_prompt,
                req.encoding_format,
                now_s(),
            )
        )

    @app.post("/pooling", response_model=None)
    async def pooling(request: Request) -> Response:
        """vLLM's /pooling: each input's pooled hidden state (the full-size
        :func:`embedding_vector`), ``data[i].data``."""
        got = await pooled(request, PoolingRequest, "pool")
        data = [
            {
                "index": i,
                "object": "pooling",
                "data": encode_floats(embedding_vector(p, EMBEDDING_DIM), got.req.encoding_format),
            }
            for i, p in enumerate(got.ids)
        ]
        return pooled_list("pool", got, data)

    @app.post("/classify", response_model=None)
    async def classify(request: Request) -> Response:
        """vLLM's /classify: each input's probabilities over :data:`CLASSIFY_LABELS` and
        its most probable label."""
        got = await pooled(request, ClassificationRequest, "classify")
        data = []
        for i, p in enumerate(got.ids):
            probs = class_probs(p)
            label = CLASSIFY_LABELS[max(range(len(probs)), key=probs.__getitem__)]
            data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
        return pooled_list("classify", got, data)

    async def score(request: Request) -> Response:
        """vLLM's /score (and /v1/score): each pair's :func:`pair_score`."""
        got = await pooled(request, ScoreRequest, "score")
        data = [
            {"index": i, "object": "score", "score": pair_score(p)} for i, p in enumerate(got.ids)
        ]
        return pooled_list("score", got, data)

    async def rerank(request: Request) -> Response:
        """vLLM's /rerank (and /v1/rerank, /v2/rerank): the documents by the score of the
        query paired with each, best first, the first ``top_n`` (0: all)."""
        got = await pooled(request, RerankRequest, "rerank")
        req = got.req
        results = sorted(
            (
                {
                    "index": i,
                    "document": {"text": req.documents[i]},
                    "relevance_score": pair_score(p),
                }
                for i, p in enumerate(got.ids)
            ),
            key=lambda r: -cast(float, r["relevance_score"]),
        )
        if 0 < req.top_n < len(results):
            results = results[: req.top_n]
        n_prompt = got.n_prompt
        return _json_bytes(
            {
                "id": f"rerank-{got.rid}", "model": req.model or replica.model,
                "usage": {"prompt_tokens": n_prompt, "total_tokens": n_prompt},
                "results": results,
            }
        )  # fmt: skip

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, score, methods=["POST"], response_model=None)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], response_model=None)

    # ------------------------------------------------------------------ tokenization
    # token-id answers are serialized by orjson: FastAPI's encoder walks every id in Python
    # (milliseconds for a long prompt, on the engine loop; a router that renders every
    # request on every replica makes that the replicas' largest cost)
    @app.post("/v1/chat/completions/render", response_model=None)
    async def render_chat(request: Request) -> Response:
        req = await _parse(request, ChatCompletionRequest)
        check_model(req.model)
        ids = await chat_prompt(req, validate_common(req))
        return _json_bytes(
            {"token_ids": ids, "prompt_token_ids": ids, "model": req.model or replica.model}
        )

    @app.post("/v1/completions/render", response_model=None)
    async def render_completion(request: Request) -> Response:
        req = await _parse(request, CompletionRequest)
        check_model(req.model)
        salt = req.cache_salt  # not validated on this endpoint: a bad one is no scope
        scope = salt if isinstance(salt, str) else None
        model = req.model or replica.model
        rendered = []
        for prompt in completion_prompts(req.prompt):  # a batch: one render per prompt
            ids = await completion_ids(req, scope, prompt)
            rendered.append({"token_ids": ids, "prompt_token_ids": ids, "model": model})
        return Response(
            orjson.dumps(rendered[0] if len(rendered) == 1 else rendered),
            media_type="application/json",
        )

    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> Response:
        req = await _parse(request, TokenizeRequest)
        check_model(req.model)
        if req.messages is not None:
            try:
                text = tok.apply_chat_template(
                    req.messages, req.add_generation_prompt, _options(req, replica.chat_defaults)
                )
            except TokenizerError as exc:
                raise APIError(str(exc), param="messages") from exc
            ids = await encode(text, req.cache_scope())
            if req.add_special_tokens:
                ids = with_special_tokens(tok, ids)
        elif req.prompt is not None:
            ids = await encode(req.prompt, req.cache_scope())
            if req.add_special_tokens is not False:
                ids = with_special_tokens(tok, ids)
        else:
            raise APIError("either 'prompt' or 'messages' is required")
        strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return _json_bytes(
            {
                "count": len(ids),
                "max_model_len": replica.core.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await _parse(request, DetokenizeRequest)
        check_model(req.model)
        if any(not 0 <= t < tok.vocab_size for t in req.tokens):
            raise APIError(f"token ids must be in [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}

    # ------------------------------------------------------------------ info
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(replica.start_time)
        max_len = replica.core.max_model_len
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": None if name == replica.model else replica.model,
                "max_model_len": max_len,
            }
            for name in replica.served_models
        ]
        return {"object": "list", "data": data}

    @app.get("/health", response_model=None)
    async def health() -> Response:
        return Response(status_code=200 if replica.healthy else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "kvgate-sim"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(replica.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [replica.load()]

    def server_info() -> dict[str, Any]:
        core, s = replica.core, replica.settings
        return {
            "model_path": replica.model,
            "served_model_name": replica.model,
            "tokenizer_path": replica.tokenizer_path,
            "profile": s.profile,
            "block_size": core.block_size,
            "page_size": core.block_size,
            "num_gpu_blocks": core.pool.num_blocks,
            "max_num_seqs": core.max_num_seqs,
            "max_running_requests": core.max_num_seqs,
            "max_num_batched_tokens": core.max_num_batched_tokens,
            "chunked_prefill_size": core.max_num_batched_tokens,
            "max_model_len": core.max_model_len,
            "context_length": core.max_model_len,
            "time_scale": s.time_scale,
            "prefix_caching_hash_algo": s.hash_algo.value,
            "hash_seed": s.hash_seed,
            "lora": list(s.lora),
            "dp_size": s.data_parallel_size,
            "tp_size": 1,
            "process_start_time": replica.start_time,
            "kv_events": {
                "endpoint": replica.endpoints.events_endpoint,
                "replay_endpoint": replica.endpoints.replay_endpoint,
                "topic": s.events_topic,
                "encoding": s.event_encoding.value,
                "hash_format": s.event_hash_format.value,
                "enabled": s.publish_events,
            },
        }

    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    def model_info() -> dict[str, Any]:
        return {
            "model_path": replica.model,
            "tokenizer_path": replica.tokenizer_path,
            "is_generation": True,
        }

    app.get("/get_model_info")(model_info)
    app.get("/model_info")(model_info)

    # ------------------------------------------------------------------ cache control
    async def flush() -> dict[str, Any]:
        await replica.driver.between_steps()
        core = replica.core
        if not core.reset_prefix_cache():
            raise APIError(
                "Cache not flushed: "
                f"{len(core.running)} running request(s) still hold KV blocks; retry when idle.",
                400,
            )
        await replica.driver.publish_now()
        return {"flushed": True, "message": "Cache flushed."}

    app.api_route("/flush_cache", methods=["GET", "POST"])(flush)  # SGLang's: 400 when busy

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        # vLLM's (dev mode) answers 200 {"success": false} while blocks are held: callers
        # retry on the flag, not on the status
        await replica.driver.between_steps()
        ok = replica.core.reset_prefix_cache()
        if ok:
            await replica.driver.publish_now()
        return {"success": ok}

    # ------------------------------------------------------------------ debug / chaos
    @app.get("/debug/blocks")
    async def debug_blocks() -> dict[str, Any]:
        core = replica.core
        pool = core.pool
        blocks = [
            {
                "block_id": b.block_id,
                "block_hash": b.block_hash,
                "block_hash_hex": b.digest.hex(),
                "parent_block_hash": b.parent_block_hash,
                "token_ids": b.token_ids,
                "extra_keys": list(b.extra_keys) if b.extra_keys is not None else None,
                "ref_cnt": b.ref_cnt,
                "in_use": b.in_use,
            }
            for b in core.cached_blocks()
        ]
        pub = replica.publisher
        return {
            "replica": replica.index,
            "model": replica.model,
            "block_size": core.block_size,
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "num_cached_blocks": pool.num_cached_blocks,
            "hash_algo": core.config.hash_algo.value,
            "event_hash_format": core.config.wire_hash_format.value,
            "process_start_time": replica.start_time,
            # the dump includes every published batch (seq < next_event_seq) and, when
            # step_in_flight, the events of that step, published next
            "next_event_seq": pub.next_seq if pub is not None else None,
            "step_in_flight": replica.driver.step_in_flight,
            "num_running": len(core.running),
            "num_waiting": len(core.waiting),
            "blocks": blocks,
        }

    async def json_body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            data = orjson.loads(raw) if raw else {}
        except ValueError as exc:
            raise APIError(f"invalid JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise APIError("the request body must be a JSON object")
        return data

    def number(data: dict[str, Any], key: str, default: float | None = None) -> float:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise APIError(f"'{key}' must be a non-negative number", param=key)
        return float(value)

    @app.post("/debug/restart")
    async def debug_restart() -> dict[str, Any]:
        await replica.restart()
        return {"restarted": True, "process_start_time": replica.start_time}

    @app.post("/debug/drop_events")
    async def debug_drop_events(request: Request) -> dict[str, Any]:
        n = int(number(await json_body(request), "n", 1))
        if replica.publisher is None:
            raise APIError("events are disabled on this replica", 409)
        replica.publisher.drop_next(n)
        return {"dropping": n, "next_seq": replica.publisher.next_seq}

    @app.post("/debug/pause")
    async def debug_pause(request: Request) -> dict[str, Any]:
        seconds = number(await json_body(request), "seconds")
        replica.driver.pause(seconds)
        return {"paused_s": seconds}

    @app.post("/debug/health")
    async def debug_health(request: Request) -> dict[str, Any]:
        healthy = (await json_body(request)).get("healthy", True)
        if not isinstance(healthy, bool):
            raise APIError("'healthy' must be a boolean", param="healthy")
        replica.healthy = healthy
        return {"healthy": healthy}

    @app.get("/", response_class=PlainTextResponse)
    async def root() -> str:
        return f"kvgate simulated replica {replica.index} serving {replica.model}\n"

    return app
