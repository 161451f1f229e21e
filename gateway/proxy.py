"""The upstream exchange: send a routed request to its replica and relay the answer.

An :class:`UpstreamExchange` writes its answer to a :class:`ClientConnection`: the
gateway's own HTTP protocol (:mod:`gateway.hotpath`, what ``kvgate serve`` runs) or, under
any other ASGI server, :class:`AsgiConnection`. Either way, when the client goes away the
exchange's task is cancelled, which closes the upstream connection, which makes the engine
abort the request. SSE is relayed event by event as it arrives (never buffered whole).
Guarantees:

* a connection failure before the first upstream byte is retried on another replica;
* a replica dying mid-stream ends the client's stream with an SSE error event and
  ``data: [DONE]``, never a hang;
* the usage chunk the gateway asked for (to read ``cached_tokens``) reaches the client only
  if the client asked for it too;
* :meth:`Gateway.finish` runs exactly once per exchange, whatever happened;
* a client that reads nothing of its answer for ``KVGATE_CLIENT_WRITE_TIMEOUT_S`` is cut
  off as one that left (outcome 499, the upstream request cancelled), counted in
  ``kvgate_client_write_timeouts`` and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import httpx
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from cachecore.httpread import AnswerTooLarge
from gateway.core import (
    BODY_TOO_LARGE,
    EVENT_TOO_LARGE,
    RESPONSE_READS,
    UNSENT,
    Dispatch,
    Gateway,
    Outcome,
)
from gateway.errors import GatewayError, engine_error_body, error_body, sse_error_event
from gateway.settings import GatewaySettings
from gateway.upstream import MalformedResponseError, UpstreamResponse

log = logging.getLogger(__name__)

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
# a Responses stream ends with its terminal event, not [DONE] (vLLM sends none)
_RESPONSE_END = re.compile(rb'"type"\s*:\s*"response\.(completed|incomplete|failed)"')
_EVENT_SEP = re.compile(rb"\r?\n\r?\n")
# a Responses stream's events that are no output of the engine's: vLLM 0.33's
# responses_stream_generator sends response.created and response.in_progress before it
# reads the engine's first output (OpenAI's response.queued: vLLM sends none), and a
# stream may end, or break off, without any output (its terminal event, an error event)
_NO_OUTPUT = frozenset(
    (b"response.created", b"response.in_progress", b"response.queued", b"response.completed",
     b"response.incomplete", b"response.failed", b"error")
)  # fmt: skip
# a replayed follow-up's events name its previous response by the engine's id (D33)
_PREVIOUS_ID = re.compile(rb'"previous_response_id"\s*:\s*"(resp_[0-9A-Za-z_-]+)"')
_RETRYABLE = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)
# failures after the request was handed to a connection the replica had accepted: it
# may have the request, and may have died of it
_SENT = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_JSON = b"application/json"
# an error body is read to at most this much: an engine's is a short JSON message (vLLM
# 0.33 cuts a validation error's text at 1000 characters an error, validation.py's
# _format_error), and it is relayed whole or summarised
_ERROR_BODY_CAP = 1 << 20
# an answer over this many bytes that is no Responses object is not parsed whole when its
# usage can be read off its tail (:func:`_usage_tail`): parsed whole, an embeddings
# batch's floats cost 1.5 times its size more in RSS (5M float objects for 100 MiB), and
# about as much CPU as the rest of its relay
_PARSE_WHOLE_MAX = 1 << 20
# how far from its end a large answer's top-level usage is looked for, and parsed from
_USAGE_TAIL_MAX = 1 << 16
_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")
_WS = b" \t\r\n"


def _refused(exc: Exception) -> bool:
    """The connection could not be made at all (a definitive failure for ejection): the
    upstream transport raises ``ConnectError`` for a refused or failed connect, with the
    ``OSError`` as its cause (also accepted alone, for transports that wrap it in a
    timeout type)."""
    return isinstance(exc, httpx.ConnectError) or isinstance(exc.__cause__, OSError)


def _timeouts(s: GatewaySettings, stream: bool) -> dict[str, float]:
    """Per-request upstream timeouts (httpx's ``timeout`` extension keys). A non-streamed
    answer's head comes after the whole generation, so it has its own, longer bound."""
    return {
        "connect": s.connect_timeout_s,
        # the response head and a stream's first chunk
        "first_byte": s.first_byte_timeout_s if stream else s.response_timeout_s,
        "read": s.read_timeout_s,  # between two chunks after that
        "write": 30.0,
        "pool": s.connect_timeout_s,
    }


class Usage:
    __slots__ = ("cached", "completion", "prompt")

    def __init__(self) -> None:
        self.prompt: int | None = None
        self.cached: int | None = None
        self.completion: int | None = None

    def read(self, usage: Any) -> None:
        """A completion's usage, or a Responses object's (``input_tokens``,
        ``input_tokens_details.cached_tokens``, ``output_tokens``: D30)."""
        if not isinstance(usage, dict):
            return
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        if p is None and "input_tokens" in usage:
            p, c = usage.get("input_tokens"), usage.get("output_tokens")
            details = usage.get("input_tokens_details")
        self.prompt = p if isinstance(p, int) else self.prompt
        self.completion = c if isinstance(c, int) else self.completion
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached = details["cached_tokens"]
        elif self.prompt is not None and self.cached is None:
            self.cached = None  # the engine does not report cached tokens


class ClientWriteTimeout(Exception):
    """A write waited ``client_write_timeout_s`` for the client to take bytes it never took
    (it keeps its connection and reads nothing). Raised by a :class:`ClientConnection`,
    which writes nothing more; the exchange ends as if the client had left."""


class ClientConnection(Protocol):
    """Where an exchange writes its answer. Each method returns once the bytes are handed to
    the transport (after waiting out back-pressure, at most the client write timeout, past
    which it raises :class:`ClientWriteTimeout`); after the client went away they write
    nothing."""

    @property
    def disconnected(self) -> bool:
        """The client went away before the answer was complete: set before the exchange's
        task is cancelled for it, so a cancellation without it is the server's own (its
        drain timeout ran out)."""

    async def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | list[bytes]
    ) -> None:
        """A whole answer; ``headers`` without its length; ``body`` its bytes, or the
        chunks it was read in (a large answer is written as it came, never joined)."""

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The head of an answer whose body follows in pieces."""

    async def stream(self, data: bytes) -> None:
        """One piece of a streamed body."""

    async def end_stream(self) -> None:
        """The end of a streamed body."""


class AsgiConnection:
    """A :class:`ClientConnection` over an ASGI ``send``. A server's ``send`` waits out the
    client's back-pressure without a bound (uvicorn's does), so each is bounded here."""

    __slots__ = ("_send", "disconnected", "write_timeout_s")

    def __init__(self, send: Send, write_timeout_s: float) -> None:
        self._send = send
        self.write_timeout_s = write_timeout_s
        self.disconnected = False  # set by UpstreamExchange.__call__'s watcher

    async def send(self, message: Any) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self._send(message)
        except TimeoutError:
            # no transport to abort through ASGI: the server closes the connection when
            # the app returns with the answer incomplete
            raise ClientWriteTimeout from None

    async def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | list[bytes]
    ) -> None:
        size = len(body) if isinstance(body, bytes) else sum(map(len, body))
        headers = [*headers, (b"content-length", b"%d" % size)]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        if isinstance(body, bytes):
            await self.send({"type": "http.response.body", "body": body, "more_body": False})
            return
        # chunks, each a body message: the server waits out the client's back-pressure
        # before each, so they are not all in its transport's buffer at once
        last = len(body) - 1
        for i, part in enumerate(body):
            await self.send({"type": "http.response.body", "body": part, "more_body": i < last})
        if last < 0:
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def stream(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self) -> None:
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


def _nothing() -> None:
    pass


class UpstreamExchange(Response):
    """One routed request's trip upstream and back. :meth:`run` runs it against a client
    connection; as a starlette Response (ASGI) it watches for the client's disconnect
    itself. ``on_done`` runs exactly once, when the exchange is over."""

    def __init__(self, gw: Gateway, d: Dispatch, on_done: Callable[[], None]) -> None:
        # deliberately not Response.__init__: there is no body to render up front
        self.background = None
        self.status_code = 200
        self.gw = gw
        self.d = d
        self.on_done = on_done
        self._finished = False
        self._settled = False  # the last message is being sent: a disconnect is normal now
        # the answer's status: its head's while it runs, the outcome's once finished
        self.status = 0

    async def run(self, conn: ClientConnection) -> None:
        """Run the exchange; the caller cancels this coroutine's task when the client goes
        away before the answer is complete."""
        try:
            await self._run(conn)
        finally:
            self._settled = True
            # dropped once called: the caller's callback usually closes over this
            # exchange, a cycle that would keep the request's whole graph (its prompt
            # too) alive until a GC pass instead of freeing it here
            on_done, self.on_done = self.on_done, _nothing
            on_done()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The exchange runs in this task; a watcher task cancels it if the client goes
        # away first. ``_settled`` is set before the last send, after which the server
        # reports a "disconnect" for every finished response.
        me = asyncio.current_task()
        assert me is not None
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        conn = AsgiConnection(send, self.gw.settings.client_write_timeout_s)

        def on_disconnect(_: object) -> None:
            if not self._settled and not watch.cancelled():
                conn.disconnected = True
                me.cancel()

        watch.add_done_callback(on_disconnect)
        try:
            await self.run(conn)
        except asyncio.CancelledError:
            if not conn.disconnected:
                raise  # the server's own cancellation (shutdown): not ours to swallow
            me.uncancel()
        finally:
            watch.remove_done_callback(on_disconnect)
            if not watch.done():
                watch.cancel()

    # ------------------------------------------------------------------ helpers
    def _dispatched(self) -> None:
        """The request is on its way to (or connecting to) ``d.replica``: count it there and
        record its pending entries (every attempt; a failed one was released by reroute)."""
        c0 = time.perf_counter_ns()
        self.gw.on_dispatch(self.d)
        self.gw.stages.add("proxy", time.perf_counter_ns() - c0)

    def _finish(self, out: Outcome) -> None:
        if not self._finished:
            self._finished = True
            # from here ``status`` is the outcome's (what the trace and span say), not the
            # head's: a stream that broke (502), was cut (503) or lost its client (499)
            # after a 200 head counts as what it came to in kvgate_requests
            self.status = out.status
            self.gw.finish(self.d, out)

    def _resp_headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type), (b"x-request-id", self.d.request_id.encode())]
        if self.gw.settings.expose_replica:
            headers.append((b"x-kvgate-replica", self.d.replica.encode()))
            if not self.d.ephemeral and not self.d.unkeyed:
                # the prediction under the caller's own scope: lets benchmarks measure the
                # precision per request (sensitive and media requests have none)
                predicted = str(self.d.decision.predicted_cached_tokens).encode()
                headers.append((b"x-kvgate-predicted-cached-tokens", predicted))
        return headers

    async def _send_error(
        self,
        conn: ClientConnection,
        status: int,
        message: str,
        code: str,
        extra: Mapping[str, str] | None = None,
    ) -> None:
        """``extra``: more headers (a 503 ``no_replica``'s ``Retry-After``)."""
        self.status = status
        body = orjson.dumps(error_body(status, message, code))
        self._settled = True
        headers = [(b"content-type", _JSON), (b"x-request-id", self.d.request_id.encode())]
        for name, value in (extra or {}).items():
            headers.append((name.lower().encode("latin-1"), value.encode("latin-1")))
        await conn.answer(status, headers, body)

    async def _send_refusal(self, conn: ClientConnection, err: GatewayError) -> None:
        """``err`` answered as :meth:`prepare`'s refusals are (its param and type too)."""
        self.status = err.status
        self._settled = True
        await conn.answer(err.status, err.header_pairs(self.d.request_id), orjson.dumps(err.body()))

    # ------------------------------------------------------------------ exchange
    async def _run(self, conn: ClientConnection) -> None:
        gw, d = self.gw, self.d
        assert gw.upstream is not None and gw.pool is not None
        s = gw.settings
        timeouts = _timeouts(s, d.stream)
        # vLLM takes the engine's request id from this header before the body's
        headers = [(b"content-type", _JSON), (b"x-request-id", d.upstream_id.encode())]
        if s.upstream_api_key is not None:
            auth = "Bearer " + s.upstream_api_key.get_secret_value()
            headers.append((b"authorization", auth.encode()))
        t0 = d.t_start
        resp: UpstreamResponse | None = None
        try:
            while True:
                c0 = time.perf_counter_ns()
                rep = d.target = gw.pool.get(d.replica)
                if rep is None:  # removed meanwhile
                    if gw.reroute(d, d.replica):
                        continue
                    err = gw.replica_gone(d)
                    await self._send_refusal(conn, err)
                    e2e = time.perf_counter() - t0
                    self._finish(Outcome(err.status, None, e2e, None, None, None, UNSENT))
                    return
                payload = gw.upstream_body(d)
                sent = headers
                if rep.dp_rank is not None:  # one rank of an engine that serves several
                    sent = [*headers, (b"x-data-parallel-rank", b"%d" % rep.dp_rank)]
                gw.stages.add("proxy", time.perf_counter_ns() - c0)
                try:
                    resp = await gw.upstream.post(
                        rep.url, d.path, sent, payload, timeouts, self._dispatched, d.method
                    )
                    break
                except _RETRYABLE as exc:
                    failed = d.replica
                    # the pool's timeout is the gateway's own connection cap, all busy: no
                    # fault of the replica (held against it, a busy fleet was ejected)
                    busy = isinstance(exc, httpx.PoolTimeout)
                    if not busy:
                        gw.pool.record_failure(failed, definitive=_refused(exc))
                    dropped = isinstance(exc, _SENT)
                    if dropped:
                        d.drops += 1  # (an idle keep-alive close is resent by upstream)
                    gw.metrics.upstream_errors.labels(failed, "pool" if busy else "connect").inc()
                    log.warning(
                        "upstream failed before the first byte",
                        extra={"replica": failed, "request_id": d.request_id, "error": repr(exc)},
                    )
                    if gw.reroute(d, failed, dropped):
                        continue
                    if busy:
                        status, code = 503, "upstream_busy"
                        message = (
                            "no upstream connection free in time: the gateway's limit of "
                            f"{s.max_connections} connections per replica "
                            "(KVGATE_MAX_CONNECTIONS) is reached"
                        )
                    elif d.drops > s.drop_retries:
                        status, code = 502, "upstream_unreachable"
                        message = (
                            f"{d.drops} replicas closed the connection without an answer to "
                            "this request: not retried further (KVGATE_DROP_RETRIES)"
                        )
                    else:
                        status, code = 502, "upstream_unreachable"
                        message = f"upstream replica unreachable: {type(exc).__name__}"
                    await self._send_error(conn, status, message, code)
                    self._finish(
                        Outcome(status, None, time.perf_counter() - t0, None, None, None, "connect")
                    )
                    return
                except httpx.TimeoutException:
                    # no response head in time: the engine has the request (not resent);
                    # finish counts it towards ejection, so a wedged engine is taken out
                    await self._upstream_failed(
                        conn, t0, 504, "upstream replica timed out", "timeout", "timeout"
                    )
                    return
                except MalformedResponseError as exc:
                    await self._upstream_failed(
                        conn, t0, 502, f"upstream replica sent an invalid response: {exc}",
                        "upstream_error", "protocol",
                    )  # fmt: skip
                    return
            if resp.status_code != 200 or not d.stream:
                # a JSON answer (or error) arrives whole; only an answer is engine progress
                gw.on_first_token(d, resp.status_code == 200)
            if resp.status_code != 200:
                await self._relay_error(conn, resp, t0)
            elif d.stream:
                await self._relay_stream(conn, resp, t0)
            else:
                await self._relay_json(conn, resp, t0)
        except ClientWriteTimeout:
            self._client_stalled()
        except asyncio.CancelledError:
            e2e = time.perf_counter() - t0
            if conn.disconnected:  # the client went away
                self._finish(Outcome(499, None, e2e, None, None, None, None))
            else:
                # the server's own cut (the drain timeout ran out): the gateway's 503, as the
                # server answers it (hotpath's 503 ``draining``, or the SSE error event of a
                # stream begun); no error, so it counts against no replica. An exchange
                # already finished keeps its outcome.
                self._finish(Outcome(503, None, e2e, None, None, None, None))
            raise
        finally:
            if resp is not None:
                with contextlib.suppress(Exception):
                    await resp.aclose()
            if not self._finished:
                self._finish(Outcome(500, None, time.perf_counter() - t0, None, None, None))

    def _client_stalled(self) -> None:
        """The client kept its connection and read nothing for the client write timeout:
        a client failure, like a client that left (499; no error, so it counts against no
        replica). The connection is closed and, in ``_run``'s ``finally``, the upstream
        response, so the engine aborts the request instead of generating for no one."""
        gw, d = self.gw, self.d
        self._settled = True
        gw.metrics.client_write_timeouts.inc()
        log.warning(
            "client read nothing of its answer for KVGATE_CLIENT_WRITE_TIMEOUT_S: connection "
            "closed, upstream request cancelled",
            extra={
                "replica": d.replica,
                "request_id": d.request_id,
                "tenant": d.tenant,
                "timeout_s": gw.settings.client_write_timeout_s,
            },
        )
        self._finish(Outcome(499, None, time.perf_counter() - d.t_start, None, None, None, None))

    async def _upstream_failed(
        self,
        conn: ClientConnection,
        t0: float,
        status: int,
        message: str,
        code: str,
        kind: str,
        error: str | None = None,
    ) -> None:
        """The replica failed this request after taking it: count it by ``kind``, answer
        the client, finish with the error (which counts towards the replica's ejection)."""
        self.gw.metrics.upstream_errors.labels(self.d.replica, kind).inc()
        await self._send_error(conn, status, message, code)
        self._finish(
            Outcome(status, None, time.perf_counter() - t0, None, None, None, error or kind)
        )

    async def _read_failed(self, conn: ClientConnection, exc: httpx.HTTPError, t0: float) -> None:
        """A response body that broke off or stalled after its head: 504 for a stall, else
        502."""
        if isinstance(exc, httpx.TimeoutException):
            await self._upstream_failed(
                conn, t0, 504, "upstream replica timed out", "timeout", "timeout", repr(exc)
            )
        else:
            await self._upstream_failed(
                conn, t0, 502, "upstream replica failed mid-response", "upstream_error", "read",
                repr(exc),
            )  # fmt: skip

    def _too_large(self, exc: AnswerTooLarge, bound: int) -> None:
        """An upstream body refused at ``bound`` (read no further, its connection closed)."""
        d = self.d
        self.gw.body_too_large(d.replica, exc, "not relayed", request_id=d.request_id, bound=bound)

    async def _relay_error(self, conn: ClientConnection, resp: UpstreamResponse, t0: float) -> None:
        status = resp.status_code
        if status < 400:
            # no completion and no error (a 204, a redirect): relayed, its status would
            # carry our error body, and a 204's or 304's body breaks the client's framing
            await self._upstream_failed(
                conn, t0, 502, f"upstream replica returned HTTP {status} instead of a completion",
                "upstream_error", "protocol",
            )  # fmt: skip
            return
        cap = min(self.gw.settings.max_upstream_body_bytes, _ERROR_BODY_CAP)
        try:
            raw = await resp.aread(cap)
        except httpx.HTTPError as exc:  # the error body broke off: an upstream failure
            await self._read_failed(conn, exc, t0)
            return
        except AnswerTooLarge as exc:
            # answered as an error body that is not the engine's (below): the status
            # stands, a 4xx no failure and a 5xx one, whatever its body
            self._too_large(exc, cap)
            raw = b""
        raw = _rewritten(raw, self.gw.answer_rewrites(self.d))  # D30: no engine id shown
        try:
            parsed = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        shaped = engine_error_body(parsed, status)
        if shaped is not None and shaped is not parsed:
            raw = orjson.dumps(shaped)  # the engine's words, in OpenAI's shape
        if shaped is None:
            if status >= 500:
                status = 502
            raw = orjson.dumps(
                error_body(status, f"upstream replica returned HTTP {resp.status_code}",
                           "upstream_error")
            )  # fmt: skip
        if resp.status_code >= 500:
            self.gw.metrics.upstream_errors.labels(self.d.replica, f"http_{resp.status_code}").inc()
        self.status = status
        self._settled = True
        headers = self._resp_headers(_JSON)
        # an engine's (or its rate limiter's) 429/503 says when to come back: the SDKs
        # wait that long before their retry, rather than their own short backoff
        headers += [(b"retry-after", v) for k, v in resp.headers if k.lower() == b"retry-after"][:1]
        await conn.answer(status, headers, raw)
        # an engine 5xx counts towards passive outlier ejection; a 4xx is the client's
        err = f"http_{resp.status_code}" if resp.status_code >= 500 else None
        self._finish(Outcome(status, None, time.perf_counter() - t0, None, None, None, err))

    async def _relay_json(self, conn: ClientConnection, resp: UpstreamResponse, t0: float) -> None:
        bound = self.gw.settings.max_upstream_body_bytes
        try:
            parts = await resp.aread_parts(bound)
        except httpx.HTTPError as exc:
            await self._read_failed(conn, exc, t0)
            return
        except AnswerTooLarge as exc:
            # the engine computed it, so its charge stays (a 502, no refusal); no failure
            # of the replica's (BODY_TOO_LARGE: the request chose its size)
            self._too_large(exc, bound)
            await self._send_error(
                conn, 502, f"upstream answer over the gateway's bound of {bound} bytes "
                "(KVGATE_MAX_UPSTREAM_BODY_BYTES)", "upstream_error",
            )  # fmt: skip
            self._finish(
                Outcome(502, None, time.perf_counter() - t0, None, None, None, BODY_TOO_LARGE)
            )
            return
        # read whole: its connection goes back to the pool now, not once the client has
        # taken the answer (a large one is written as fast as the client reads it)
        await resp.aclose()
        c0 = time.perf_counter_ns()
        usage = Usage()
        d = self.d
        # a Responses object's status and ids are read too: parsed whole at any size
        large = sum(map(len, parts)) > _PARSE_WHOLE_MAX and d.response_id is None
        parsed = _usage_tail(_last_bytes(parts, _USAGE_TAIL_MAX + 64), parts[0]) if large else None
        # read off its tail, the answer is written in the chunks it came in: their join was
        # a copy of it (H209)
        raw: bytes | list[bytes] = parts
        if parsed is None:
            raw = parts[0] if len(parts) == 1 else b"".join(parts)
            try:
                parsed = orjson.loads(raw)
            except orjson.JSONDecodeError:
                parsed = None
        if not isinstance(parsed, dict):
            # no completion (a web server that is not the engine, truncated JSON): the
            # client could not parse it, and it counts against the replica
            await self._upstream_failed(
                conn, t0, 502, "upstream replica sent an invalid response: not a JSON object",
                "upstream_error", "protocol",
            )  # fmt: skip
            return
        if d.response_id is not None and isinstance(parsed.get("status"), str):
            d.response_status = parsed["status"]  # a background one's "queued" (D33)
        if d.endpoint in RESPONSE_READS:  # a retrieval's usage is an earlier request's
            d.response_usage = usage_pair(parsed.get("usage"))
        else:
            usage.read(parsed.get("usage"))
        if d.response_id is not None:  # a Responses object: parsed whole, ``raw`` its bytes
            assert isinstance(raw, bytes)
            raw = _rewritten(raw, self.gw.answer_rewrites(d, parsed))
        # not held while the client takes the answer: the parsed answer costs about its size
        # again (text) or more (an embedding's floats)
        del parsed
        self.status = 200
        headers = self._resp_headers(_JSON)
        spent = time.perf_counter_ns() - c0  # the write below is the server's, not ours
        # the engine's answer, read whole: a large one is written as fast as the client
        # reads it, and that time is the client's (the e2e is the replica's latency, and a
        # one-token answer's fits the cost model's prefill)
        e2e = time.perf_counter() - t0
        self._settled = True
        try:
            await conn.answer(200, headers, raw)
        except (asyncio.CancelledError, ClientWriteTimeout) as exc:
            # a large answer's client left (or stalled) while taking it: a 499, but the
            # engine computed it all, so its usage settles the charge as a 200's would
            # (``_run`` then finds the exchange finished; a server's own cut stays a 503)
            if conn.disconnected or isinstance(exc, ClientWriteTimeout):
                out = Outcome(499, None, e2e, usage.prompt, usage.cached, usage.completion)
                self._finish(out)
            raise
        c0 = time.perf_counter_ns()
        self._finish(Outcome(200, None, e2e, usage.prompt, usage.cached, usage.completion))
        self.gw.stages.add("proxy", spent + time.perf_counter_ns() - c0)

    async def _relay_stream(
        self, conn: ClientConnection, resp: UpstreamResponse, t0: float
    ) -> None:
        d = self.d
        self.status = 200
        await conn.start_stream(
            200, [*self._resp_headers(b"text/event-stream"), (b"cache-control", b"no-cache")]
        )
        usage = Usage()
        ttft: float | None = None
        # bytearray: appending a chunk is amortised O(1), where bytes concatenation copied
        # the whole pending event per chunk
        buf = bytearray()
        limit = self.gw.settings.max_upstream_event_bytes
        error: str | None = None
        kind = "mid_stream"
        saw_done = False
        rewrites = self.gw.answer_rewrites(d)
        responses = d.response_id is not None
        # a Responses run's first token is its first output event (D30): its stream opens
        # before the prefill. Any other stream's first chunk comes with the engine's first
        # output (vLLM's chat role chunk too); a replay's is a frontend answer (D33)
        opens_early = d.endpoint == "responses"
        if d.background:
            d.response_status = "in_progress"  # the engine runs it: terminal at its end
        elif opens_early:
            # so its first-byte timeout bounds the queue and the prefill as a chat stream's
            # does, up to the first output event: its opening events and keepalives do not
            # end it. A background run is exempt: it may queue long by design, and a cut
            # stream frees nothing of it (vLLM runs it detached from the stream, D30)
            resp.body.hold_first_byte()
        try:
            async for chunk in resp.aiter_raw():
                # a blank line ending in the new chunk may begin in the old bytes' last 3
                start = len(buf) - 3
                buf += chunk
                cut = _event_end(buf, start)
                if cut >= 0:
                    ready = bytes(buf[:cut])
                    del buf[:cut]
                if ttft is None and (not opens_early or (cut >= 0 and _output(ready))):
                    ttft = time.perf_counter() - t0
                    resp.body.output_seen()
                    self.gw.on_first_token(d)
                if len(buf) > limit:
                    # an event past the bound: it may hold an engine id that must not reach
                    # the client unsealed (D30), so none of it is relayed; the stream ends
                    error = f"upstream event over KVGATE_MAX_UPSTREAM_EVENT_BYTES ({limit})"
                    kind = EVENT_TOO_LARGE
                    buf.clear()
                    if cut < 0:
                        break
                if cut < 0:
                    continue
                if _USAGE.search(ready) is not None or b"[DONE]" in ready:
                    ready, done = filter_events(ready, usage, d.client_wants_usage)
                    saw_done = saw_done or done
                if responses:
                    if _ended(d, ready):
                        saw_done = True
                        if ttft is None and d.response_status != "failed":
                            # ended without output (every token held back by a parser):
                            # its engine is done, no first token was seen (no TTFT)
                            self.gw.on_first_token(d)
                    rewrites = self._replayed_previous(ready, rewrites)
                    ready = _rewritten(ready, rewrites)
                if ready:
                    await conn.stream(ready)
                if error is not None:
                    break
        except httpx.HTTPError as exc:
            error = repr(exc)
        if buf.strip() and error is None:
            tail, done = filter_events(bytes(buf), usage, d.client_wants_usage)
            saw_done = saw_done or done
            if responses:
                saw_done = saw_done or _ended(d, tail)
                rewrites = self._replayed_previous(tail, rewrites)
                tail = _rewritten(tail, rewrites)
            if tail:
                await conn.stream(tail)
        if error is not None or not saw_done:
            error = error or "upstream stream ended without [DONE]"
            self.gw.metrics.upstream_errors.labels(d.replica, kind).inc()
            if kind == "mid_stream" or self.gw.relay_warning_due(d.replica, kind):
                log.warning(
                    "upstream failed mid-stream",
                    extra={"replica": d.replica, "request_id": d.request_id, "error": error},
                )
            event = sse_error_event(502, "upstream replica failed mid-stream", "upstream_error")
            await conn.stream(event)
        self._settled = True
        await conn.end_stream()
        self._finish(
            Outcome(
                200 if error is None else 502,
                # a replay's first chunk is its API server's, from the events it stored
                # (D33): no engine TTFT for the histogram, the trace or the fit
                None if d.frontend_answer else ttft,
                time.perf_counter() - t0,
                usage.prompt,
                usage.cached,
                usage.completion,
                EVENT_TOO_LARGE if kind == EVENT_TOO_LARGE else error,
            )
        )

    def _replayed_previous(
        self, data: bytes, rewrites: list[tuple[bytes, bytes]]
    ) -> list[tuple[bytes, bytes]]:
        """A replayed stream's (``GET /v1/responses/{id}?stream=true``, D33) rewrites with
        its follow-up's previous engine id, read in its events (no answer object to read it
        from as a JSON retrieval's): sealed as that retrieval's is (D30)."""
        if self.d.endpoint not in RESPONSE_READS:
            return rewrites
        found = _PREVIOUS_ID.search(data)
        if found is None or any(engine == found.group(1) for engine, _ in rewrites):
            return rewrites
        return self.gw.answer_rewrites(self.d, {"previous_response_id": found.group(1).decode()})


def usage_pair(usage: Any) -> tuple[int, int] | None:
    """A usage object's (prompt, cached) tokens, None unless it reports both."""
    u = Usage()
    u.read(usage)
    return None if u.prompt is None or u.cached is None else (u.prompt, u.cached)


def filter_events(data: bytes, usage: Usage, keep_usage: bool) -> tuple[bytes, bool]:
    """Read usage from complete SSE events; drop the usage-only chunk unless the client
    asked for it (``keep_usage``). Returns the bytes to forward and whether ``[DONE]`` was
    seen."""
    out: list[bytes] = []
    done = False
    for event in _EVENT_SEP.split(data):
        if not event.strip():
            continue
        payload = _event_data(event)
        if payload.strip() == b"[DONE]":
            done = True
        elif _USAGE.search(payload) is not None:
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                found = obj.get("usage")
                inner = obj.get("response")
                if found is None and isinstance(inner, dict):  # a Responses event's
                    found = inner.get("usage")
                usage.read(found)
                if not keep_usage and not obj.get("choices"):
                    continue
        out.append(event + b"\n\n")
    return b"".join(out), done


def _ended(d: Dispatch, data: bytes) -> bool:
    """Whether ``data`` holds a Responses stream's terminal event; its status then becomes
    the dispatch's (a background stream's end: D33)."""
    found = _RESPONSE_END.search(data)
    if found is None:
        return False
    d.response_status = found.group(1).decode()
    return True


def _output(data: bytes) -> bool:
    """Whether ``data``, complete SSE events of a Responses stream, holds an output event
    of the engine's: any but :data:`_NO_OUTPUT` (vLLM's first is the output item's
    ``response.output_item.added``, sent with the first delta it parsed)."""
    for event in _EVENT_SEP.split(data):
        event = _uncommented(event)
        if event.startswith(b"event:"):  # vLLM names each event's type in this line
            kind = event[6 : event.find(b"\n") if b"\n" in event else None].strip()
        else:
            try:
                obj = orjson.loads(_event_data(event))
            except orjson.JSONDecodeError:
                continue
            found = obj.get("type") if isinstance(obj, dict) else None
            if not isinstance(found, str):
                continue
            kind = found.encode()
        if kind and kind not in _NO_OUTPUT:
            return True
    return False


def _uncommented(event: bytes) -> bytes:
    """An SSE event without its comment lines (``: keepalive``), which the SSE spec ignores
    wherever they stand: a proxy may send one just before an event's first line."""
    if not event.startswith(b":") and b"\n:" not in event:
        return event
    return b"\n".join(line for line in event.split(b"\n") if not line.startswith(b":"))


def _event_data(event: bytes) -> bytes:
    """An SSE event's data: after ``data:``, past an ``event:`` line (a Responses
    stream's events name their type, D30) and comment lines."""
    event = _uncommented(event)
    if event.startswith(b"event:"):
        at = event.find(b"data:")
        return event[at + 5 :].lstrip() if at >= 0 else b""
    return event[5:].lstrip() if event.startswith(b"data:") else event


def _last_bytes(parts: list[bytes], n: int) -> bytes:
    """The last ``n`` bytes of ``parts`` joined (all of them if fewer)."""
    k, at = 0, len(parts)
    while at > 0 and k < n:
        at -= 1
        k += len(parts[at])
    tail = parts[at:]
    return (tail[0] if len(tail) == 1 else b"".join(tail))[-n:]


def _usage_tail(raw: bytes, start: bytes | None = None) -> dict[str, Any] | None:
    """The top-level keys of the JSON object ``raw`` from its last ``usage`` key on, when
    that key lies in its last ``_USAGE_TAIL_MAX`` bytes; None otherwise (parse it whole).
    vLLM 0.33 serialises its answers' fields in model order: an embeddings, pooling,
    classify or score answer ends with its usage, a completion's follows its choices (a
    chat's prompt_logprobs after it, a rerank's results: short, or parsed whole). A
    ``"usage"`` after ``{`` or ``,`` opens a string (one inside a string has its quote
    escaped), and followed by ``:`` that string is a key; ``{`` and the tail from it make
    one object only if the key is the top level's (a nested one's tail closes more). The
    body before it is not validated: its leading ``{`` is checked, and a truncated answer
    loses its tail, parsed whole and refused. ``raw`` may be the answer's last
    ``_USAGE_TAIL_MAX`` + 64 bytes only, with ``start`` its first chunk."""
    at = raw.rfind(b'"usage"', len(raw) - _USAGE_TAIL_MAX)
    if at < 0 or _OBJECT_START.match(raw if start is None else start) is None:
        return None
    if not raw[max(0, at - 64) : at].rstrip(_WS).endswith((b"{", b",")):
        return None  # no key's place: a string's content
    try:
        tail = orjson.loads(b"{" + raw[at:])
    except orjson.JSONDecodeError:
        return None
    return tail if isinstance(tail, dict) else None


def _rewritten(data: bytes, rewrites: list[tuple[bytes, bytes]]) -> bytes:
    """``data`` with each engine response id replaced by the client's (D30)."""
    for engine, client in rewrites:
        data = data.replace(engine, client)
    return data


def _event_end(buf: bytes | bytearray, start: int = 0) -> int:
    """Index just past the last complete SSE event in ``buf`` (-1 if none), looking at its
    bytes from ``start`` only, in place (the rest was looked at before: without it, a long
    event's every chunk rescanned all its buffered bytes). Engines end events with a blank
    line: ``\n\n`` (vLLM, SGLang) or ``\r\n\r\n``."""
    start = max(start, 0)
    lf = buf.rfind(b"\n\n", start)
    crlf = buf.rfind(b"\r\n\r\n", start)
    if crlf >= 0 and crlf + 4 > lf + 2:
        return crlf + 4
    return lf + 2 if lf >= 0 else -1
