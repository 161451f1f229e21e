"""The upstream transport: HTTP/1.1 keep-alive connections to replicas, on asyncio + httptools.

Why not httpx's own transport or aiohttp's: per proxied request they cost 0.5-1 ms of CPU on
a 2-core VM (connection-pool bookkeeping, several task hops, header objects built twice),
more than all of the routing work. This transport does only what the gateway's upstream leg
needs: ``POST`` with a body already in memory to a small, known set of replicas (``https://``
ones over TLS, trusted as httpx trusts them), answers
read as they arrive (SSE relayed chunk by chunk), keep-alive reuse, and the httpx error
types the proxy already acts on. Parsing is httptools' (llhttp, C); the exchange is one
:class:`asyncio.Protocol` per connection, so a response costs one callback per packet and
no task switch beyond the caller's own await.

Contract (the parts of :class:`httpx.AsyncBaseTransport` the gateway uses):

* ``handle_async_request`` returns once the status line and headers are in; the body is an
  :class:`httpx.AsyncByteStream` whose ``aclose`` returns the connection to the pool only if
  the response was read to its end and the server allows keep-alive, and closes it otherwise
  (a cancelled exchange therefore closes the connection, which makes the engine abort).
* Errors: refused or failed connect -> ``httpx.ConnectError``; connect over its timeout ->
  ``httpx.ConnectTimeout``; the server closing before any response byte ->
  ``httpx.RemoteProtocolError`` (retried once on a fresh connection if the closed one was a
  reused keep-alive connection: the classic idle-close race; the retry keeps the request's
  slot, so it never queues behind later arrivals; a retry that cannot connect raises it too:
  the server may have read the request and died of it); closing mid-body ->
  ``httpx.ReadError``; no byte within the read timeout (or, for a body whose caller
  :meth:`_Body.hold_first_byte`, no output it saw within the first-byte timeout) ->
  ``httpx.ReadTimeout``; a malformed response, or one cut inside its head ->
  :class:`MalformedResponseError` (the replica answered: never resent, and not one of the
  connect-type errors the proxy retries elsewhere); no connection free within the pool
  timeout -> ``httpx.PoolTimeout``.
* Bodies must be framed (``content-length`` or chunked), as engines' HTTP/1.1 servers
  (uvicorn, SGLang's) always frame them; a body delimited only by the connection closing is
  reported as ``httpx.ReadError``.

Invariants: a connection is in at most one of {idle deque, in use}; ``_active[host]`` counts
the connections of that host in use or being opened, never more than ``max_connections``;
callers over the cap wait in line, and a released slot passes straight to the longest
waiter (first come, first served: a newcomer never takes it in between).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from itertools import chain
from typing import cast

import httptools
import httpx

from cachecore.httpread import AnswerTooLarge
from cachecore.urls import url_host

_HIGH_WATER = 1 << 20  # buffered body bytes before we stop reading the socket
_HostKey = tuple[str, int, bool]  # host, port, TLS
_NO_OUTPUT = "replica sent no output within the first-byte timeout"


class MalformedResponseError(httpx.HTTPError):
    """The replica sent bytes that are not a valid response head (or closed inside one): it
    received the request and may have run it, so it is not resent anywhere."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection and the state of the exchange in flight on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.exchanges = 0  # completed exchanges (0: never reused)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        # stamping (a body's first output awaited, _Body.hold_first_byte): the loop time
        # the oldest pending chunk arrived, what that deadline is checked against
        self.stamping = False
        self.arrived = 0.0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.got_bytes = False
        self.complete = False
        self.keep_alive = True
        self.error: Exception | None = None

    # ------------------------------------------------------------------ protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they implement it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # bytes on an idle connection: the server is confused
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(MalformedResponseError(f"malformed response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head is not None and not self.complete:
            if self.head.done():
                self._fail(httpx.ReadError("replica closed the connection mid-response"))
            elif self.got_bytes:
                self._fail(MalformedResponseError("replica closed the connection mid-head"))
            else:
                self._fail(httpx.RemoteProtocolError("replica closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.stamping and not self.chunks:
            self.arrived = self.loop.time()
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # ------------------------------------------------------------------ helpers
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: Exception) -> None:
        if self.error is None:
            self.error = err
        h = self.head
        if h is not None and not h.done():
            h.set_exception(err)
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(err)

    def on_timeout(self, what: str = "replica sent nothing within the timeout") -> None:
        self._fail(httpx.ReadTimeout(what))
        self.close()

    def begin(self, data: bytes) -> asyncio.Future[None]:
        self._reset()
        self.head = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(data)
        return self.head

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) > 1 else self.chunks[0]
        self._taken()
        return data

    def take_parts(self) -> list[bytes]:
        """The chunks :meth:`take` joins, as they came."""
        parts = list(self.chunks)
        self._taken()
        return parts

    def _taken(self) -> None:
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    def __init__(
        self, owner: LeanTransport, key: _HostKey, conn: _Conn, first_s: float, read_s: float
    ) -> None:
        self.owner = owner
        self.key = key
        self.conn = conn
        self.first_s = first_s  # until the first body chunk (a stream's first token)
        self.read_s = read_s  # between chunks after it
        # loop time by which the caller must see its first output (see hold_first_byte)
        self.output_by: float | None = None
        self.released = False

    def hold_first_byte(self) -> None:
        """Keep the first-byte timeout running past the first chunks, until
        :meth:`output_seen`: for a stream that opens before its engine's first output (a
        Responses stream, D30). Chunks meanwhile (its opening events, keepalive comments)
        do not extend it."""
        self.output_by = self.conn.loop.time() + self.first_s
        self.conn.stamping = True

    def output_seen(self) -> None:
        self.output_by = None
        self.conn.stamping = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn, loop = self.conn, self.conn.loop
        wait_s = self.first_s
        while True:
            by = self.output_by
            if (
                by is not None
                and not conn.complete
                and (not conn.chunks or conn.arrived >= by)
                and loop.time() >= by
            ):
                # checked before the chunks too (a flood of keepalives never waits), against
                # their arrival: the engine's, not the relay's lateness (a slow client's
                # write held it while its output came in time)
                conn.on_timeout(_NO_OUTPUT)
                assert conn.error is not None
                raise conn.error
            if conn.chunks:
                wait_s = self.read_s
                yield conn.take()
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                conn.waiter = loop.create_future()
                left = math.inf if self.output_by is None else self.output_by - loop.time()
                if wait_s <= left:
                    timer = loop.call_later(wait_s, conn.on_timeout)
                else:
                    timer = loop.call_later(left, conn.on_timeout, _NO_OUTPUT)
                try:
                    await conn.waiter
                finally:
                    timer.cancel()
                    conn.waiter = None

    async def aclose(self) -> None:
        if self.released:
            return
        self.released = True
        conn = self.conn
        reusable = conn.complete and conn.keep_alive and conn.error is None and not conn.closed
        if reusable:
            conn.exchanges += 1
            conn.head = None
        else:
            conn.close()
        self.owner._release(self.key, conn if reusable else None)


class UpstreamResponse:
    """Status, headers and the body stream of one upstream answer (the subset of
    :class:`httpx.Response` the proxy reads)."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: _Body) -> None:
        self.status_code = status
        self.headers = headers
        self.body = body

    async def aread(self, cap: int | None = None) -> bytes:
        """The whole body, joined: :meth:`aread_parts`' chunks."""
        parts = await self.aread_parts(cap)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aread_parts(self, cap: int | None = None) -> list[bytes]:
        """The whole body, in the chunks it came in; with ``cap`` (the proxy's
        ``KVGATE_MAX_UPSTREAM_BODY_BYTES``), at most that many bytes: past it
        :class:`AnswerTooLarge` and the connection closed, a ``content-length`` over it
        refused before any body byte is read. The chunks go in a list, so a refused body
        costs the gateway about ``cap``, never more; a caller that needs one buffer joins
        them once (a growing bytearray and its bytes() copy cost 1.6 times the join: a 2 MB
        answer in 64 KiB chunks, 387 us, 240 us joined), one that writes them on does not
        (H209: the join was a copy of a large answer)."""
        conn = self.body.conn
        if conn.complete:  # the whole answer came with its head: no iteration needed
            # (the usual JSON answer: its length is what arrived, no header looked up)
            parts = conn.take_parts() if conn.chunks else []
            if cap is not None and sum(map(len, parts)) > cap:
                conn.close()
                raise AnswerTooLarge(f"answer over {cap} bytes")
            return parts
        if cap is not None:
            declared = _content_length(self.headers)
            if declared is not None and declared > cap:
                conn.close()
                raise AnswerTooLarge(f"content-length {declared} over {cap} bytes")
        parts = []
        size = 0
        async for chunk in self.body:
            parts.append(chunk)
            size += len(chunk)
            if cap is not None and size > cap:
                conn.close()
                raise AnswerTooLarge(f"answer over {cap} bytes")
        return parts

    def aiter_raw(self) -> AsyncIterator[bytes]:
        return self.body.__aiter__()

    async def aclose(self) -> None:
        await self.body.aclose()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The answer's declared body length, if it names one (httptools framed it by it)."""
    for name, value in headers:
        if name.lower() == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return None


MAX_IDLE_PER_HOST = 64  # idle keep-alive connections kept per upstream host


class LeanTransport(httpx.AsyncBaseTransport):
    """httpx transport for the gateway's upstream leg (see the module docstring)."""

    def __init__(
        self, max_connections: int = 512, max_idle_per_host: int = MAX_IDLE_PER_HOST
    ) -> None:
        self.max_connections = max_connections
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[_HostKey, deque[_Conn]] = {}
        self._active: dict[_HostKey, int] = {}
        self._waiting: dict[_HostKey, deque[asyncio.Future[_Conn | None]]] = {}
        self._hosts: dict[str, _HostKey] = {}  # base URL -> (host, port, TLS), parsed once
        self._host_header: dict[_HostKey, bytes] = {}
        self._ssl: ssl.SSLContext | None = None  # made at the first https:// connection
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport API (for callers holding an :class:`httpx.Request`)."""
        url = request.url
        resp = await self.send(
            _host_key(url),
            _request_bytes(
                request.method.encode("ascii"),
                request.url.raw_path,
                request.headers.raw,
                request.content,
            ),
            request.extensions.get("timeout") or {},
        )
        return httpx.Response(
            resp.status_code,
            headers=resp.headers,
            stream=resp.body,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def post(
        self,
        base_url: str,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: dict[str, float],
        dispatched: Callable[[], None] | None = None,
        method: bytes = b"POST",
    ) -> UpstreamResponse:
        """``POST base_url + path`` with ``body``: the proxy's hot path, without building
        httpx request and response objects (a tenth of the gateway's CPU per request).
        ``dispatched``: see :meth:`send`. ``method``: ``GET`` for a retrieval (an empty
        body)."""
        key = self._hosts.get(base_url)
        if key is None:
            url = httpx.URL(base_url)
            if url.scheme not in ("http", "https"):
                raise httpx.UnsupportedProtocol(
                    f"upstream must be http:// or https://, not {base_url!r}"
                )
            key = self._hosts[base_url] = _host_key(url)
            # an IPv6 literal bracketed, its zone id (link-local) not sent (RFC 6874)
            host = url_host(url.host, zone="dropped")
            self._host_header[key] = f"{host}:{key[1]}".encode("ascii")
        prefix = base_url.split("://", 1)[1].split("/", 1)
        target = ("/" + prefix[1].rstrip("/") if len(prefix) > 1 else "") + path
        framing = [(b"host", self._host_header[key]), (b"content-length", b"%d" % len(body))]
        data = _request_bytes(method, target.encode("ascii"), chain(framing, headers), body)
        return await self.send(key, data, timeouts, dispatched)

    async def send(
        self,
        key: _HostKey,
        data: bytes,
        timeouts: dict[str, float],
        dispatched: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send one serialized request and return once its response head is in.

        ``dispatched`` is called once, before this call first yields to other tasks: right
        after the request is handed to a kept-alive connection, or before connecting when
        none is idle. The caller's bookkeeping of the dispatch thus happens off the
        request's critical path yet before any other task runs."""
        if self._closed:
            raise httpx.ConnectError("transport closed")
        connect_s = timeouts.get("connect") or 5.0
        read_s = timeouts.get("read") or 60.0
        first_s = timeouts.get("first_byte") or read_s
        pool_s = timeouts.get("pool") or connect_s
        loop = asyncio.get_running_loop()
        conn = self._take_idle(key)
        for attempt in (0, 1):
            if attempt:  # the slot is still this request's: no new place in the line
                try:
                    conn = await self._connect(key, connect_s, loop)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                    # the closed connection may have carried the request to a server that
                    # died of it (a close and a dead port are what a crash looks like): a
                    # drop to the caller, not a request never sent (the refused connect
                    # kept as the cause, for the ejection)
                    raise httpx.RemoteProtocolError(
                        f"replica closed the connection unanswered, then: {exc}"
                    ) from (exc.__cause__ or exc)
            elif conn is None:
                if dispatched is not None:  # connecting yields: record the dispatch first
                    dispatched()
                    dispatched = None
                conn = await self._acquire(key, connect_s, pool_s, loop)
            reused = conn.exchanges > 0
            head = conn.begin(data)
            timer = loop.call_later(first_s, conn.on_timeout)
            try:
                if dispatched is not None:
                    dispatched()
                    dispatched = None
                await head
            except httpx.RemoteProtocolError:
                conn.close()
                if reused and attempt == 0 and not conn.got_bytes:
                    # the server closed an idle keep-alive connection: retry on a fresh one
                    # in the same slot. Released, the slot went to the longest waiter and
                    # the retry queued behind requests that arrived after this one
                    continue
                self._release(key, None)
                raise
            except BaseException:  # timeout, cancellation: the connection is unusable
                conn.close()
                self._release(key, None)
                raise
            finally:
                timer.cancel()
            body = _Body(self, key, conn, first_s, read_s)
            return UpstreamResponse(conn.status, conn.headers, body)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _acquire(
        self, key: _HostKey, connect_s: float, pool_s: float, loop: asyncio.AbstractEventLoop
    ) -> _Conn:
        conn = self._take_idle(key)
        if conn is not None:
            return conn
        if self._active.get(key, 0) >= self.max_connections:
            # Wait in line. A release hands its slot (and its connection, if reusable)
            # straight to the longest waiter, never through the free count: a request
            # arriving in the tick between the wake and the waiter's turn found the slot
            # free and took it, and the waiter went to the back of the line.
            fut: asyncio.Future[_Conn | None] = loop.create_future()
            self._waiting.setdefault(key, deque()).append(fut)
            try:
                # not wait_for: on 3.11 it swallows a cancellation that arrives after the
                # wake, and the request of a client that left went upstream all the same
                async with asyncio.timeout(pool_s):
                    handed = await fut
            except BaseException as exc:
                if fut.done() and not fut.cancelled():
                    # handed a slot, then leaving before it ran (its client left, or the
                    # timeout fired in the same tick): the slot goes to the next waiter
                    self._release(key, fut.result())
                if isinstance(exc, TimeoutError):
                    raise httpx.PoolTimeout("no upstream connection free in time") from None
                raise
            if self._closed:  # closed while waiting: no new connection after that
                self._release(key, None)
                raise httpx.ConnectError("transport closed")
            if handed is not None and not handed.closed:
                return handed
            # the slot is ours (counted by the releaser): a new connection fills it
        else:
            self._active[key] = self._active.get(key, 0) + 1
        return await self._connect(key, connect_s, loop)

    async def _connect(
        self, key: _HostKey, connect_s: float, loop: asyncio.AbstractEventLoop
    ) -> _Conn:
        """A new connection in a slot of ``key`` the caller holds (counted in
        ``_active``); the slot is released if the connection cannot be made."""
        if self._closed:  # closed meanwhile: no new connection after that
            self._release(key, None)
            raise httpx.ConnectError("transport closed")
        try:
            async with asyncio.timeout(connect_s):
                tls = self._ssl_context() if key[2] else None
                _, proto = await loop.create_connection(
                    lambda: _Conn(loop),
                    key[0],
                    key[1],
                    ssl=tls,
                    server_hostname=key[0] if tls is not None else None,
                )
        except TimeoutError:
            self._release(key, None)
            raise httpx.ConnectTimeout(f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            self._release(key, None)
            raise httpx.ConnectError(f"connect to {key[0]}:{key[1]}: {exc}") from exc
        except BaseException:
            self._release(key, None)
            raise
        return proto

    def _ssl_context(self) -> ssl.SSLContext:
        """The TLS settings of the gateway's other httpx clients (its health checks): the
        certifi bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set."""
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context()
        return self._ssl

    def _take_idle(self, key: _HostKey) -> _Conn | None:
        """An open idle connection to ``key``, counted as in use (closed ones are dropped)."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # most recently used: the least likely to be idle-closed
            if not conn.closed:
                self._active[key] = self._active.get(key, 0) + 1
                return conn
        return None

    def _release(self, key: _HostKey, conn: _Conn | None) -> None:
        """Give up a slot of ``key`` (with ``conn`` when it is reusable): to the
        longest-waiting caller if any (those that left are skipped), else to the pool."""
        if conn is not None and self._closed:
            conn.close()
            conn = None
        waiting = self._waiting.get(key)
        while waiting:
            fut = waiting.popleft()
            if not fut.done():
                fut.set_result(conn)  # the slot stays counted: it is the waiter's now
                return
        self._active[key] = self._active.get(key, 1) - 1
        if conn is not None:
            idle = self._idle.setdefault(key, deque())
            if len(idle) < self.max_idle_per_host:
                idle.append(conn)
            else:
                conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)  # let the transports run their close callbacks


def _host_key(url: httpx.URL) -> _HostKey:
    tls = url.scheme == "https"
    return (url.host, url.port or (443 if tls else 80), tls)


def _request_bytes(
    method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]], body: bytes
) -> bytes:
    """The request head and body as one buffer: one write, usually one packet. ``headers``
    must include the framing (host, content-length)."""
    lines = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        lines += (name, b": ", value, b"\r\n")
    lines += (b"\r\n", body)
    return b"".join(lines)
