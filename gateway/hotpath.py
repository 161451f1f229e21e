"""The completion endpoints served by the gateway's own HTTP/1.1 code, inside uvicorn.

``kvgate serve`` runs uvicorn's httptools protocol with one change: a ``POST`` to a
proxied endpoint (``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/tokenize``, ``/detokenize``, vLLM's other pooling endpoints: ``Completions.ENDPOINTS``)
does not become an ASGI request. Its headers go into a :class:`HotCycle`, which reads the
body, calls :meth:`gateway.app.Completions.handle` and writes the answer's bytes to the
socket itself.
Everything else (models, health, metrics, admin, lifespan) stays on FastAPI through ASGI.
Why: building the ASGI scope, the receive/send message dicts, the starlette request, the
cycle's header checks and a disconnect-watcher task cost ~30% of a bare proxy's CPU per
request on this machine (docs/benchmarks.md, Gateway).

A :class:`HotCycle` stands where uvicorn keeps its ``RequestResponseCycle``, so the
protocol's connection handling is unchanged: keep-alive and its timer, pipelined requests
(queued until the previous answer is complete), read pausing for large bodies, write
back-pressure, graceful shutdown (the last answer on a connection carries
``connection: close``). When the client goes away before its answer is complete, the
cycle cancels the task that serves it; the exchange turns that into an aborted upstream
request. A client that keeps the connection and reads nothing is cut off the same way once
a write has waited ``KVGATE_CLIENT_WRITE_TIMEOUT_S`` for the socket (the connection is
aborted: a close would wait for the unread bytes). An HTTP/1.0 client cannot read chunked
framing (RFC 9112 s7): its stream goes out unframed and the connection closes at its end.

A request head (request target plus header lines) over :data:`MAX_HEADER_BYTES` is answered
``431`` with an OpenAI error object and the connection is closed, on every path: httptools
would otherwise buffer a header of any size. The count is exact for a head that arrives
whole; one still arriving is also measured by the bytes received, so the gateway holds at
most one socket read more than the limit. After the 431 the gateway shuts its side and
drops what the client still sends for up to :data:`_LINGER_S` before closing: closing
with unread bytes would reset the connection before the client reads its answer. A request
the parser refuses is answered the same way, with a 400 OpenAI error object (uvicorn's
own answer is text/plain). Both carry the CORS headers when the request's Origin was read
before the refusal (``GatewayHttpProtocol._cors``). An upgrade offer other than to a
WebSocket (``Upgrade: h2c``) is ignored and the request served as HTTP/1.1, body included
(uvicorn loses the body). Tests: tests/test_hotpath.py, tests/test_h23_api_http.py,
tests/test_h24_http_edges.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any, cast
from urllib.parse import unquote

import httptools
import orjson
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.app import Completions
from gateway.cors import exempt
from gateway.errors import GatewayError, body_too_large, sse_error_event
from gateway.proxy import ClientWriteTimeout, UpstreamExchange

log = logging.getLogger(__name__)

_HOT_PATHS = {path.encode(): endpoint for path, endpoint in Completions.ENDPOINTS.items()}
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
MAX_HEADER_BYTES = 64 * 1024  # a request head larger than this is refused with a 431
_UPGRADE_TOKENS = frozenset({b"upgrade", b"http2-settings"})  # of an ignored upgrade
_LINGER_S = 2.0  # after a 431: how long the rest of the request is read and dropped


_ONE_WRITE_MAX = 64 * 1024  # an answer up to this is written with its head, in one write
_PIECE = 1 << 20  # a larger one in pieces of at most this, as the client takes them


def _pieces(body: bytes | list[bytes]) -> Iterator[bytes | memoryview]:
    """``body`` in pieces of at most ``_PIECE`` bytes, none copied."""
    for part in (body,) if isinstance(body, bytes) else body:
        if len(part) <= _PIECE:
            yield part
            continue
        view = memoryview(part)
        for at in range(0, len(part), _PIECE):
            yield view[at : at + _PIECE]


class _HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over the limit."""


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


class HotCycle:
    """One request to a completion endpoint, from its headers to the end of its answer.

    Implements the :class:`~gateway.proxy.ClientConnection` the exchange writes to, and the
    part of uvicorn's ``RequestResponseCycle`` that :class:`HttpToolsProtocol` touches
    (``more_body``, ``message_event``, ``keep_alive``, ``disconnected``,
    ``response_complete``, ``run_asgi``). Invariants: the status line is written once,
    before any body byte; ``response_complete`` turns true exactly once, with the last byte
    of the answer written; once ``disconnected`` nothing more is written; a stream is
    chunked or, for HTTP/1.0 (``chunked`` false), unframed and ended by closing the
    connection (never kept alive).
    """

    __slots__ = (
        "_disconnected",
        "body_size",
        "chunked",
        "chunks",
        "content_length",
        "cors",
        "endpoint",
        "headers",
        "keep_alive",
        "message_event",
        "more_body",
        "proto",
        "request_id",
        "response_complete",
        "response_started",
        "streaming",
        "task",
        "transport",
        "waiting_for_100_continue",
    )

    def __init__(
        self,
        proto: GatewayHttpProtocol,
        endpoint: str,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_100_continue: bool,
        content_length: int | None,
        chunked: bool = True,
    ) -> None:
        self.proto = proto
        self.transport = proto.transport
        self.endpoint = endpoint
        self.headers = headers
        self.keep_alive = keep_alive
        self.chunked = chunked  # streams may use chunked framing (HTTP/1.1)
        self.waiting_for_100_continue = expect_100_continue
        self.content_length = content_length  # as declared in this request's headers
        # the body as the parser hands it over (``GatewayHttpProtocol.on_body``): a body in
        # one piece is never copied (uvicorn's bytearray costs two copies of it)
        self.chunks: list[bytes] = []
        self.body_size = 0
        self.more_body = True
        self.message_event = asyncio.Event()
        self.response_started = False
        self.streaming = False  # the head of a streamed answer is out
        self.response_complete = False
        self._disconnected = False
        self.task: asyncio.Task[None] | None = None
        self.request_id: str | None = None
        self.cors: list[tuple[bytes, bytes]] | None = None  # added to the answer's head

    # ---------------------------------------------------------------- the protocol's side
    @property
    def disconnected(self) -> bool:
        return self._disconnected

    @disconnected.setter
    def disconnected(self, value: bool) -> None:
        # the protocol sets it when the connection is lost before the answer is complete;
        # already set (a write timed out, its task ends the exchange itself) it cancels
        # nothing: a cancellation then would cut the upstream response's close short
        was, self._disconnected = self._disconnected, value
        if value and not was and self.task is not None and not self.task.done():
            self.task.cancel()

    async def run_asgi(self, app: Any) -> None:
        """Serve the request (uvicorn's name; there is no ASGI app here)."""
        if self._disconnected:  # the client left before this request's turn came
            return
        self.task = asyncio.current_task()
        self.proto.serving = self
        try:
            await self._serve()
        except asyncio.CancelledError:
            if not self._disconnected:
                self._end_cut_answer()  # the drain timeout ran out on this request
                raise  # the server's own cancellation (shutdown)
            if self.task is not None:
                self.task.uncancel()
        except (ClientGone, ClientWriteTimeout):
            pass
        except Exception:
            log.exception("unhandled error on the completion path")
            if not self.response_started:
                err = GatewayError(500, "internal gateway error")
                self.keep_alive = False
                with contextlib.suppress(ClientWriteTimeout):
                    await self.answer(err.status, err.header_pairs(), _error_bytes(err))
        finally:
            if not self.response_complete and not self.transport.is_closing():
                self.transport.close()  # an answer cut short must not look complete
            if self.proto.serving is self:
                self.proto.serving = None
            self.task = None

    async def _serve(self) -> None:
        names: dict[str, str] = {}
        for name, value in self.headers:  # the first value of a repeated header wins
            names.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        completions: Completions = self.proto.completions
        if completions.cors is not None:  # the same policy as the ASGI side (gateway/cors.py)
            self.cors = completions.cors.actual(names.get("origin"))
        peer = self.proto.client  # (host, port); None on a socket without an address
        out = await completions.handle(
            self.endpoint, names, self.read_body, peer[0] if peer else "",
            lambda: self._disconnected,  # a cancellation before dispatch: 499, else 503
        )  # fmt: skip
        if isinstance(out, UpstreamExchange):
            self.request_id = out.d.request_id  # for a 503 if the drain timeout cuts it
            await out.run(self)
            return
        err, rid = out
        # answered before the whole body arrived (a 401, a 413): the connection stays, and
        # the protocol drops the rest of the body as it comes (``on_body`` after
        # ``response_complete``), as uvicorn does; closing now would reset the client
        # before it reads the answer
        await self.answer(err.status, err.header_pairs(rid), _error_bytes(err))

    async def read_body(self, limit: int) -> bytes:
        """The whole request body; a 413 :class:`GatewayError` past ``limit`` bytes."""
        declared = self.content_length
        if declared is not None and declared > limit:
            raise body_too_large(limit)
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.waiting_for_100_continue = False
        while self.more_body:
            if self._disconnected:
                raise ClientGone
            if self.body_size > limit:
                raise body_too_large(limit)
            self.proto.flow.resume_reading()
            await self.message_event.wait()
            self.message_event.clear()
        if self.body_size > limit:
            raise body_too_large(limit)
        # the cycle outlives the request (uvicorn keeps the last one per connection)
        chunks, self.chunks, self.body_size = self.chunks, [], 0
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ---------------------------------------------------------------- ClientConnection
    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> list[bytes]:
        if self.waiting_for_100_continue and self.more_body:
            # answered (401, 413) before the body it never asked for: a client that then
            # sends its next request, not the body, would have it read as this body and
            # hang; the answer says close, and the connection closes after it
            self.keep_alive = False
        parts = _status_and_headers(self.proto, status, headers)
        if self.cors:
            for name, value in self.cors:
                parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(_CLOSE)
        self.response_started = True
        self.waiting_for_100_continue = False
        return parts

    async def _writable(self) -> bool:
        flow = self.proto.flow
        while flow.write_paused and not self._disconnected:
            # what is left to send: a wait that ends with less read some of it
            left = self.transport.get_write_buffer_size()
            try:
                async with asyncio.timeout(self.proto.write_timeout_s):
                    await flow.drain()
            except TimeoutError:
                if self.transport.get_write_buffer_size() < left:
                    # the client reads, slower than a piece (1 MiB) a timeout: not stalled
                    # (bounded by its reads: each wait must take some bytes)
                    continue
                # the client reads nothing: cut it off. Not through the setter: this task
                # ends the exchange itself (ClientWriteTimeout), it needs no cancellation
                self._disconnected = True
                self.transport.abort()  # close() would wait for the unread bytes
                raise ClientWriteTimeout from None
        return not self._disconnected and not self.transport.is_closing()

    async def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes | list[bytes]
    ) -> None:
        if not await self._writable():
            return
        parts = self._head(status, headers)
        size = len(body) if isinstance(body, bytes) else sum(map(len, body))
        parts.append(b"content-length: %d\r\n\r\n" % size)
        if size <= _ONE_WRITE_MAX:
            # the usual answer (1-10 KB): with its head in one write, one send
            parts += (body,) if isinstance(body, bytes) else body
            self.transport.write(b"".join(parts))
        else:
            # a large one: its head, then its pieces as the client takes them. Joined with
            # its head it was a copy of the answer, and asyncio's transport (not uvloop's)
            # copies what the socket does not take at once into its buffer: written whole,
            # the whole answer again (H209)
            self.transport.write(b"".join(parts))
            for piece in _pieces(body):
                if not await self._writable():
                    return  # gone: ``run_asgi`` closes the connection, the answer cut short
                self.transport.write(piece)
        self._complete()

    def _end_cut_answer(self) -> None:
        """A request the server cancels (its drain timeout ran out): an answer not begun is
        a 503 ``draining`` error, as a request arriving while draining gets; a stream ends
        as one a dying replica ends: an SSE error event, ``data: [DONE]``, the chunked
        body's end. The connection then closes. Cut bare, the client saw an empty reply or
        a protocol error, with no word of why."""
        if self.response_complete or self.transport.is_closing():
            return
        if not self.response_started:
            err = GatewayError(503, "the gateway is shutting down", code="draining")
            self.keep_alive = False
            body = _error_bytes(err)
            parts = self._head(err.status, err.header_pairs(self.request_id))
            parts += (b"content-length: %d\r\n\r\n" % len(body), body)
            self.transport.write(b"".join(parts))
            return
        if not self.streaming:
            return
        event = sse_error_event(503, "the gateway is shutting down", "draining")
        self.transport.write(
            b"%x\r\n%b\r\n0\r\n\r\n" % (len(event), event) if self.chunked else event
        )
        self.keep_alive = False

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if not await self._writable():
            return
        self.streaming = True
        if not self.chunked:
            self.keep_alive = False  # the close is the body's end (and the head says so)
        parts = self._head(status, headers)
        if self.chunked:
            parts.append(_CHUNKED)
        parts.append(b"\r\n")
        self.transport.write(b"".join(parts))

    async def stream(self, data: bytes) -> None:
        if data and await self._writable():
            self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)

    async def end_stream(self) -> None:
        if await self._writable():
            if self.chunked:
                self.transport.write(b"0\r\n\r\n")
            self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.proto.on_response_complete()


def _status_and_headers(
    proto: HttpToolsProtocol, status: int, headers: list[tuple[bytes, bytes]]
) -> list[bytes]:
    """An answer's status line, the server's default headers (date, server) and ``headers``,
    each line with its CRLF (the caller ends the head)."""
    parts = [STATUS_LINE[status]]
    for name, value in proto.server_state.default_headers:
        parts += (name, b": ", value, b"\r\n")
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    return parts


def _error_bytes(err: GatewayError) -> bytes:
    return orjson.dumps(err.body())


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the completion endpoints served by
    :class:`HotCycle` (see the module docstring). ``completions`` is given by the server
    (``functools.partial``)."""

    def __init__(self, *args: Any, completions: Completions, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.completions = completions
        self.write_timeout_s = completions.gw.settings.client_write_timeout_s
        self.content_length: int | None = None  # of the request being parsed
        # the hot request being served; with pipelining uvicorn's ``cycle`` is the newest
        # parsed one, which may still wait for its turn
        self.serving: HotCycle | None = None
        self.head_bytes = 0  # of the head being parsed, as the parser hands it over
        self.in_head = True  # bytes arriving now belong to a request head (not a body)
        self.head_received = 0  # bytes received since the head began, while in_head
        self.head_refused = False
        self.replaying = False  # a new parser reads again a head whose cycle exists
        # the Origin of the request being parsed, for the CORS headers of a refusal
        # (``_refuse``); None between requests, so garbage after one never takes its origin
        self.origin: str | None = None

    def data_received(self, data: bytes) -> None:
        if self.head_refused:
            return  # the rest of a refused request, dropped until the close
        if self.in_head:
            self.head_received += len(data)
        self._feed(data)  # a head over the limit in here: send_400_response
        if self.in_head and self.head_received > MAX_HEADER_BYTES:
            self._refuse_head()  # one header still arriving, buffered by the parser

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, except for an upgrade other than to a WebSocket
        (``Upgrade: h2c``, sent on ordinary POSTs by curl --http2, Java's HttpClient and
        Spring's RestClient, Ktor): uvicorn logs it as unsupported and the parser, which
        took the request for bodiless, never hands over its body, so the request went on
        with an empty one. The upgrade is ignored instead (RFC 9110 s7.8): the request's
        head, without it, goes to a new parser with the bytes after the head, and the
        request is served as HTTP/1.1 with its body, the requests after it too."""
        self._unset_keepalive_if_required()
        pending: bytes | None = data
        while pending is not None:  # a loop, not recursion: pipelined upgrades
            chunk, pending = pending, None
            try:
                self.parser.feed_data(chunk)
            except httptools.HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            except httptools.HttpParserUpgrade as exc:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                elif (
                    self.replaying  # the head without its upgrade is one still: never again
                    or self._get_upgrade() is None  # CONNECT: an upgrade with no header
                    or self.parser.get_method() == b"CONNECT"
                ):
                    self._unsupported_upgrade_warning()  # uvicorn's: the parser stops here
                else:
                    pending = self._without_upgrade() + chunk[exc.args[0] :]

    def _without_upgrade(self) -> bytes:
        """The head of the request just parsed, without its upgrade, for a new parser that
        reads its body into the cycle already made for it (``replaying``)."""
        parser = self.parser
        lines = [parser.get_method(), b" ", self.url, b" HTTP/"]
        lines += (parser.get_http_version().encode("ascii"), b"\r\n")
        for name, value in self.headers:
            if name == b"upgrade":
                continue
            if name == b"connection":
                kept = [t for t in value.split(b",") if t.strip().lower() not in _UPGRADE_TOKENS]
                if not kept:
                    continue
                value = b",".join(kept)
            lines += (name, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        self.cycle.more_body = True  # the first parser ended it at its head
        self.parser = httptools.HttpRequestParser(self)
        self.replaying = True
        return b"".join(lines)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parser error, which is how a callback stops the parser;
        # uvicorn's own is text/plain, and clients get OpenAI error objects
        if self.head_refused:
            self._refuse_head()
        else:
            err = GatewayError(
                400, "invalid HTTP request: it could not be parsed", code="invalid_http_request"
            )
            self._refuse(err)

    def _count_head(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > MAX_HEADER_BYTES:
            self.head_refused = True
            raise _HeadTooLarge

    def _refuse_head(self) -> None:
        err = GatewayError(
            431,
            f"request headers larger than {MAX_HEADER_BYTES} bytes",
            code="request_header_fields_too_large",
        )
        self._refuse(err)

    def _refuse(self, err: GatewayError) -> None:
        """Answer ``err`` and close; what the client still sends is dropped. Nothing is
        written while an earlier request is being served (the answer would land inside
        or before that request's): the connection just closes. A request whose body was
        still arriving (a bad chunk) gets ``err`` as its answer, and the connection closes
        at once: its own answer must not follow."""
        self.head_refused = True
        self.in_head = False
        transport = self.transport
        if transport.is_closing():
            return
        cycle = self.cycle
        idle = cycle is None or cycle.response_complete
        if idle or (cycle.more_body and not cycle.response_started):
            body = _error_bytes(err)
            parts = _status_and_headers(self, err.status, err.header_pairs() + self._cors())
            parts += (_CLOSE, b"content-length: %d\r\n\r\n" % len(body), body)
            transport.write(b"".join(parts))
            if idle and transport.can_write_eof():
                transport.write_eof()  # the client sees the answer, then EOF
                asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
                return
        transport.close()

    def _cors(self) -> list[tuple[bytes, bytes]]:
        """The CORS headers of a refusal: those of any answer to the request, when its
        Origin (and so its target) was read before it; a page then reads why (a 431 for a
        cookie jar over the limit, sent after Origin) rather than a bare network error. A
        header line the parser holds unfinished is not known, nor is an Origin after the
        refused line (docs/gateway.md "CORS")."""
        policy = self.completions.cors
        if policy is None:
            return []
        if self.origin is not None:  # the target came before any header: it is whole
            try:
                path = httptools.parse_url(self.url).path.decode("latin-1")
            except httptools.HttpParserInvalidURLError:
                return []
            if exempt(unquote(path)):  # as the ASGI scope's path, percent-decoded
                return []
        return policy.actual(self.origin)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)  # marks ``self.cycle``
        serving = self.serving
        if serving is not None and not serving.response_complete:
            serving.disconnected = True

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        if len(name) == 6 and self.origin is None and name.lower() == b"origin":
            # the first wins, as on both paths; trailing blanks dropped as uvicorn does
            self.origin = value.rstrip(b" \t").decode("latin-1")
        if len(name) == 14 and name.lower() == b"content-length":
            digits = value.strip()
            self.content_length = int(digits) if digits.isdigit() else None

    def on_body(self, body: bytes) -> None:
        cycle: object = self.cycle
        if not isinstance(cycle, HotCycle):
            super().on_body(body)
            return
        # uvicorn's on_body, keeping the pieces (a hot cycle is never a WebSocket)
        if cycle.response_complete:
            return
        cycle.chunks.append(body)
        cycle.body_size += len(body)
        if cycle.body_size > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.content_length = None
        self.head_bytes = 0
        self.origin = None

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_head = True  # what comes next is the next request's head
        self.replaying = False
        self.origin = None

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_received = 0
        if self.replaying:  # its cycle was made from the first parse
            return
        parser = self.parser
        endpoint = (
            _HOT_PATHS.get(self.url.partition(b"?")[0])
            if parser.get_method() == b"POST"
            and not (parser.should_upgrade() and self._should_upgrade())
            else None
        )
        if endpoint is None or (
            self.limit_concurrency is not None
            and max(len(self.connections), len(self.tasks)) >= self.limit_concurrency
        ):
            super().on_headers_complete()  # ASGI, as uvicorn does it
            return
        http11 = parser.get_http_version() != "1.0"
        keep_alive = http11 and parser.should_keep_alive()
        cycle = HotCycle(
            self,
            endpoint,
            self.headers,
            keep_alive,
            self.expect_100_continue,
            self.content_length,
            chunked=http11,
        )
        existing = self.cycle
        self.cycle = cast(Any, cycle)
        if existing is None or existing.response_complete:
            self._start_asgi_task(cast(Any, cycle), cast(Any, None))
        else:  # pipelined behind an answer still being written
            self.flow.pause_reading()
            self.pipeline.appendleft((cast(Any, cycle), cast(Any, None)))
