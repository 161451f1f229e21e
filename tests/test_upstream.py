"""The gateway's upstream transport (gateway/upstream.py) against real loopback servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import httpx
import pytest

from cachecore.testing import free_port
from gateway.upstream import LeanTransport, MalformedResponseError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUTS = {"connect": 1.0, "read": 1.0, "pool": 1.0}


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server; yields its base URL and a list that counts its connections."""
    conns: list[int] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", conns
    finally:
        srv.close()
        await srv.wait_closed()


def json_answer(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    for _ in range(100):  # bounded: a test sends a handful of requests per connection
        req = await read_request(reader)
        writer.write(json_answer(req.split(b"\r\n\r\n", 1)[1]))
        await writer.drain()


async def test_keep_alive_reuses_one_connection_and_sends_the_body() -> None:
    t = LeanTransport()
    async with server(echo_forever) as (url, conns):
        for i in range(5):
            body = b'{"n": %d}' % i
            resp = await t.post(url, "/v1/completions", [(b"x-a", b"1")], body, TIMEOUTS)
            assert resp.status_code == 200
            assert (b"content-type", b"application/json") in resp.headers
            assert await resp.aread() == body
            await resp.aclose()
        assert len(conns) == 1
    await t.aclose()


async def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    gate = asyncio.Event()

    async def sse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await gate.wait()  # the client must see the first event before the second exists
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read(1)

    t = LeanTransport()
    async with server(sse) as (url, _):
        resp = await t.post(url, "/x", [], b"{}", TIMEOUTS)
        it = resp.aiter_raw()
        assert await anext(it) == b"data: 1"
        gate.set()
        assert b"".join([c async for c in it]) == b"data: 2"
        await resp.aclose()
    await t.aclose()


async def test_stale_keep_alive_connection_is_retried_on_a_fresh_one() -> None:
    async def one_per_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await read_request(reader)
        writer.write(json_answer(req.split(b"\r\n\r\n", 1)[1]))
        await writer.drain()
        await read_request(reader)  # a second request on this connection: hang up unanswered

    t = LeanTransport()
    async with server(one_per_conn) as (url, conns):
        for body in (b"a", b"b", b"c"):
            resp = await t.post(url, "/x", [], body, TIMEOUTS)
            assert await resp.aread() == body
            await resp.aclose()
        assert len(conns) == 3  # requests 2 and 3 each failed on a reused one first
    await t.aclose()


async def test_a_fresh_connection_closed_unanswered_is_not_retried() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    t = LeanTransport()
    async with server(hang_up) as (url, conns):
        with pytest.raises(httpx.RemoteProtocolError):
            await t.post(url, "/x", [], b"{}", TIMEOUTS)
        assert len(conns) == 1  # a POST is re-sent only when the connection was stale
    await t.aclose()


async def test_close_mid_body_is_a_read_error_and_the_connection_is_not_reused() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    t = LeanTransport()
    async with server(cut) as (url, conns):
        resp = await t.post(url, "/x", [], b"{}", TIMEOUTS)
        with pytest.raises(httpx.ReadError):
            await resp.aread()
        await resp.aclose()
        resp = await t.post(url, "/x", [], b"{}", TIMEOUTS)
        with pytest.raises(httpx.ReadError):
            await resp.aread()
        await resp.aclose()
        assert len(conns) == 2
    await t.aclose()


async def test_silence_is_a_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(2.0)

    t = LeanTransport()
    async with server(silent) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            await t.post(url, "/x", [], b"{}", {"connect": 1.0, "read": 0.2})
    await t.aclose()


async def test_refused_connection_is_a_connect_error() -> None:
    t = LeanTransport()
    with pytest.raises(httpx.ConnectError):
        await t.post(f"http://127.0.0.1:{free_port()}", "/x", [], b"{}", TIMEOUTS)
    await t.aclose()


async def test_malformed_response_is_a_protocol_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        await reader.read(1)

    t = LeanTransport()
    async with server(garbage) as (url, _):
        with pytest.raises(MalformedResponseError):  # not a connect-type error: not resent
            await t.post(url, "/x", [], b"{}", TIMEOUTS)
    await t.aclose()


async def test_a_head_cut_short_on_a_kept_alive_connection_is_not_resent() -> None:
    """The idle-close race is retried only when the server sent nothing: a head cut short
    means the server had the request."""
    served: list[int] = []

    async def cut_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(json_answer(b"{}"))
        await writer.drain()
        await read_request(reader)
        served.append(1)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
        await writer.drain()

    t = LeanTransport()
    async with server(cut_second) as (url, conns):
        r = await t.post(url, "/x", [], b"{}", TIMEOUTS)
        await r.aread()
        await r.aclose()
        with pytest.raises(MalformedResponseError):
            await t.post(url, "/x", [], b"{}", TIMEOUTS)
        assert len(conns) == 1 and served == [1]
    await t.aclose()


async def test_cancelled_exchange_closes_its_connection() -> None:
    got, closed = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        got.set()
        if await reader.read(1) == b"":  # EOF: the client closed the connection
            closed.set()

    t = LeanTransport()
    async with server(slow) as (url, _):
        task = asyncio.ensure_future(t.post(url, "/x", [], b"{}", TIMEOUTS))
        # cancelled only once the server has the request: cancelled while still connecting
        # (a fixed 0.1 s was not always enough on a loaded machine), no connection to close
        await asyncio.wait_for(got.wait(), 5.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(closed.wait(), 2.0)
    await t.aclose()


async def test_large_body_with_backpressure_arrives_whole() -> None:
    big = bytes(range(256)) * 16_384  # 4 MiB: past the transport's 1 MiB high-water mark

    async def send_big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        writer.write(big)
        await writer.drain()
        await reader.read(1)

    t = LeanTransport()
    async with server(send_big) as (url, _):
        resp = await t.post(url, "/x", [], b"{}", TIMEOUTS)
        got = []
        async for chunk in resp.aiter_raw():
            got.append(chunk)
            await asyncio.sleep(0)  # a slow consumer
        assert b"".join(got) == big
        await resp.aclose()
    await t.aclose()


async def test_pool_bound_waits_then_times_out() -> None:
    release = asyncio.Event()

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await release.wait()
        writer.write(json_answer(b"{}"))
        await writer.drain()
        await reader.read(1)

    t = LeanTransport(max_connections=1)
    async with server(held) as (url, _):
        first = asyncio.ensure_future(t.post(url, "/x", [], b"{}", TIMEOUTS))
        await asyncio.sleep(0.05)
        with pytest.raises(httpx.PoolTimeout):
            await t.post(url, "/x", [], b"{}", {"connect": 1.0, "read": 1.0, "pool": 0.2})
        release.set()
        resp = await first
        assert await resp.aread() == b"{}"
        await resp.aclose()
    await t.aclose()


async def test_a_woken_waiter_that_leaves_passes_the_free_connection_on() -> None:
    """A waiter for a pooled connection, woken by a release and cancelled before it ran
    (its client left in that tick): asyncio.wait_for (3.11) swallowed the cancellation, so
    the departed client's request went upstream and held the connection, and the next
    waiter sat until its pool timeout. The cancelled waiter must leave and pass the wake
    on."""
    release = asyncio.Event()

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await release.wait()
            writer.write(json_answer(b"{}"))
            await writer.drain()

    t = LeanTransport(max_connections=1)
    slow_pool = {"connect": 1.0, "read": 5.0, "pool": 5.0}
    async with server(held) as (url, _):
        first = asyncio.ensure_future(t.post(url, "/x", [], b"{}", TIMEOUTS))
        await asyncio.sleep(0.05)
        leaving = asyncio.ensure_future(t.post(url, "/x", [], b"{}", slow_pool))
        staying = asyncio.ensure_future(t.post(url, "/x", [], b"{}", slow_pool))
        await asyncio.sleep(0.05)  # both wait for the one connection
        release.set()
        resp = await first
        assert await resp.aread() == b"{}"
        await resp.aclose()  # the release wakes `leaving`...
        leaving.cancel()  # ...which leaves before it runs
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        resp = await asyncio.wait_for(staying, 2.0)
        assert await resp.aread() == b"{}"
        await resp.aclose()
        assert loop.time() - t0 < 1.0
        assert leaving.cancelled()
    await t.aclose()


async def test_the_connection_cap_serves_waiters_first_come_first_served() -> None:
    """Under the connection cap a released connection goes to the longest waiter. It went
    back to the free list and woke the waiter, and a request arriving in that tick (ready
    to run before the woken waiter) took it; the waiter, finding none, queued again at the
    back: under steady contention one request could wait out its pool timeout while later
    ones were served (a 503 for the oldest request, not the newest)."""
    release = asyncio.Event()
    served: list[bytes] = []

    async def held_then_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10):  # bounded: the test sends four requests on this connection
            req = await read_request(reader)
            body = req.split(b"\r\n\r\n", 1)[1]
            served.append(body)
            if body == b"first":
                await release.wait()
            writer.write(json_answer(body))
            await writer.drain()

    t = LeanTransport(max_connections=1)
    slow_pool = {"connect": 1.0, "read": 5.0, "pool": 5.0}

    async def call(name: bytes) -> None:
        resp = await t.post(url, "/x", [], name, slow_pool)
        assert await resp.aread() == name
        await resp.aclose()

    async with server(held_then_echo) as (url, conns):
        first = asyncio.ensure_future(t.post(url, "/x", [], b"first", slow_pool))
        for _ in range(100):  # bounded: until the first request is at the server
            if served:
                break
            await asyncio.sleep(0.01)
        w1 = asyncio.ensure_future(call(b"w1"))
        await asyncio.sleep(0.02)
        w2 = asyncio.ensure_future(call(b"w2"))
        await asyncio.sleep(0.02)  # both wait for the one connection, w1 first
        release.set()
        resp = await first
        assert await resp.aread() == b"first"
        late = asyncio.ensure_future(call(b"late"))  # ready to run before w1's wake...
        await resp.aclose()  # ...which this release sends
        await asyncio.wait_for(asyncio.gather(w1, w2, late), 5.0)
        assert served == [b"first", b"w1", b"w2", b"late"]
        assert len(conns) == 1  # the connection itself was handed on, kept alive
        assert t._active == {next(iter(t._active)): 0}  # every slot given back
    await t.aclose()


async def test_a_stale_connection_retry_keeps_its_place_ahead_of_later_arrivals() -> None:
    """The retry after a stale keep-alive connection (the server closed it just as it was
    reused) gave its slot up and queued again, behind requests that arrived after it: with
    the pool full, the longest waiter took the slot and the retry waited for every request
    queued meanwhile (a pool timeout for the oldest request under contention). The retry
    now keeps the slot the request held and connects fresh in it."""
    served: list[bytes] = []
    waiters_queued = asyncio.Event()
    opened = 0

    async def stale_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        opened += 1
        if opened == 1:  # answers once, then closes on the next request, unanswered
            req = await read_request(reader)
            writer.write(json_answer(req.split(b"\r\n\r\n", 1)[1]))
            await writer.drain()
            req = await read_request(reader)
            served.append(b"unanswered " + req.split(b"\r\n\r\n", 1)[1])
            await asyncio.wait_for(waiters_queued.wait(), 5.0)  # bounded
            return
        for _ in range(10):  # bounded: the test sends three requests after the stale one
            req = await read_request(reader)
            body = req.split(b"\r\n\r\n", 1)[1]
            served.append(body)
            writer.write(json_answer(body))
            await writer.drain()

    t = LeanTransport(max_connections=1)
    slow_pool = {"connect": 1.0, "read": 5.0, "pool": 5.0}

    async def call(name: bytes) -> None:
        resp = await t.post(url, "/x", [], name, slow_pool)
        assert await resp.aread() == name
        await resp.aclose()

    async with server(stale_first) as (url, conns):
        await call(b"warm")  # the connection that will be stale, now idle
        stale = asyncio.ensure_future(call(b"stale"))
        for _ in range(200):  # bounded: until the server holds the stale request
            if served:
                break
            await asyncio.sleep(0.01)
        w1 = asyncio.ensure_future(call(b"w1"))
        await asyncio.sleep(0.02)
        w2 = asyncio.ensure_future(call(b"w2"))
        for _ in range(200):  # bounded: both queued for the one slot, w1 first
            if sum(len(q) for q in t._waiting.values()) == 2:
                break
            await asyncio.sleep(0.01)
        assert sum(len(q) for q in t._waiting.values()) == 2
        waiters_queued.set()  # the server now closes the reused connection unanswered
        await asyncio.wait_for(asyncio.gather(stale, w1, w2), 5.0)
        assert served == [b"unanswered stale", b"stale", b"w1", b"w2"]
        assert len(conns) == 2  # the stale one, then one fresh one handed on in order
        assert t._active == {next(iter(t._active)): 0}  # every slot given back
    await t.aclose()


async def test_an_ipv6_replica_gets_a_bracketed_host_header() -> None:
    """RFC 9110: an IPv6 literal in Host is bracketed. The transport sent ``::1:PORT``,
    which a strict server (and any proxy in between) refuses as a malformed Host."""
    heads: list[bytes] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await read_request(reader))
        writer.write(json_answer(b"{}"))
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(on_conn, "::1", 0)
    port = srv.sockets[0].getsockname()[1]
    t = LeanTransport()
    try:
        resp = await t.post(f"http://[::1]:{port}", "/x", [], b"{}", TIMEOUTS)
        assert await resp.aread() == b"{}"
        await resp.aclose()
    finally:
        await t.aclose()
        srv.close()
        await srv.wait_closed()
    assert f"\r\nhost: [::1]:{port}\r\n".encode() in heads[0].lower()


async def test_httpx_transport_api() -> None:
    t = LeanTransport()
    async with server(echo_forever) as (url, _), httpx.AsyncClient(transport=t) as client:
        resp = await client.post(url + "/v1/x", content=b'{"a": 1}')
        assert resp.status_code == 200
        assert resp.json() == {"a": 1}


async def test_the_first_byte_and_read_timeouts_are_separate() -> None:
    """``first_byte`` bounds the wait for the head and for a stream's first chunk (its
    prefill); ``read`` bounds each gap after that. Either alone takes effect."""

    def slow_first(delay_s: float, gap_s: float) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(delay_s)  # the prefill
            for i in range(3):
                writer.write(b"7\r\ndata: %d\r\n" % i)
                await writer.drain()
                await asyncio.sleep(gap_s)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            await reader.read(1)

        return handler

    async def body(handler: Handler, first: float, read: float) -> bytes:
        t = LeanTransport()
        try:
            async with server(handler) as (url, _):
                timeouts = {"connect": 1.0, "pool": 1.0, "first_byte": first, "read": read}
                resp = await t.post(url, "/x", [], b"{}", timeouts)
                try:
                    return b"".join([c async for c in resp.aiter_raw()])
                finally:
                    await resp.aclose()
        finally:
            await t.aclose()

    # a slow first chunk: the first-byte bound alone ends it, a long one lets it through
    with pytest.raises(httpx.ReadTimeout):
        await body(slow_first(0.6, 0.01), first=0.2, read=5.0)
    assert await body(slow_first(0.6, 0.01), first=5.0, read=0.2) == b"data: 0data: 1data: 2"
    # a slow gap after the first chunk: the read bound alone ends it
    with pytest.raises(httpx.ReadTimeout):
        await body(slow_first(0.0, 0.6), first=5.0, read=0.2)
