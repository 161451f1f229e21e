"""Review R-G of 388d8af (H209: a large non-streamed answer written in pieces).

* The answer's e2e (the replica's latency histogram, and the TTFT a one-token answer, an
  embeddings batch, fits the cost model with) was taken after the client had read it: a
  large answer is now written as fast as the client reads it, so a slow client's reading
  time counted as the engine's.
* The hot-path server's write timeout bounded the wait for a whole piece to drain (an
  engine's chunk, or 1 MiB of a joined answer): a client that reads steadily, slower than
  a piece per ``KVGATE_CLIENT_WRITE_TIMEOUT_S`` (a 1 MiB piece: 17 KB/s at 60 s), was cut
  off (499) while reading, against the documented "a slow reader that keeps reading is
  not cut off"."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from gateway.core import Gateway
from gateway.hotpath import GatewayHttpProtocol
from gateway.proxy import UpstreamExchange
from tests.test_h209_answer_copies import KIB, _engine, _servers, answer_of

pytestmark = pytest.mark.timeout(120)

_REQUEST = b'{"model":"m","input":"hello there"}'


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    finish = UpstreamExchange._finish

    def recorded(self: UpstreamExchange, out: Any) -> None:
        if not self._finished:  # the outcome that counts (a later call is a no-op)
            seen.append(out)
        finish(self, out)

    monkeypatch.setattr(UpstreamExchange, "_finish", recorded)
    return seen


async def _slow_fetch(url: str, wait_s: float, piece: int, pause_s: float) -> int:
    """One embeddings request over a socket with a small receive buffer: nothing read for
    ``wait_s``, then the answer in ``piece``-byte reads ``pause_s`` apart (bounded); the
    body bytes read (short if the gateway cut the connection)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * KIB)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=piece)
    try:
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(_REQUEST), _REQUEST)
        )
        await asyncio.sleep(wait_s)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        got = 0
        for _ in range(10_000):  # bounded
            if got >= length:
                break
            data = await reader.read(piece)
            if not data:
                break
            got += len(data)
            await asyncio.sleep(pause_s)
        return got
    finally:
        writer.close()


async def test_the_e2e_of_an_answer_is_not_its_clients_reading_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 32 MiB answer whose client waits 1.5 s before it reads: the outcome's e2e is the
    engine's answer (well under that), through either server."""
    seen = _recording(monkeypatch)
    state = {"answer": answer_of(32 * KIB * KIB)}
    async with _engine(state) as engine, _servers(engine) as urls:
        for url in urls:
            seen.clear()
            got = await _slow_fetch(url, 1.5, 256 * KIB, 0.0)
            assert got == len(state["answer"])
            for _ in range(100):  # bounded: 5 s
                if seen:
                    break
                await asyncio.sleep(0.05)
            assert [o.status for o in seen] == [200], url
            assert seen[0].e2e_s < 1.0, (url, seen[0].e2e_s)


async def test_a_client_that_reads_slowly_but_steadily_is_not_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 2 MiB answer (in the engine's 256 KiB chunks: the pieces) read 8 KiB every 10 ms
    (under 0.8 MB/s) under a 0.2 s write timeout: each piece takes longer than that to
    drain, but the client never stops reading."""
    seen = _recording(monkeypatch)
    made = GatewayHttpProtocol.connection_made

    def small_buffer(self: GatewayHttpProtocol, transport: Any) -> None:
        # the kernel's send buffer kept small, as towards a remote client (loopback's grows
        # to megabytes, what is left to write then sits in the kernel, not the transport)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * KIB)
        made(self, transport)

    monkeypatch.setattr(GatewayHttpProtocol, "connection_made", small_buffer)
    state = {"answer": answer_of(2 * KIB * KIB)}
    async with (
        _engine(state) as engine,
        _servers(engine, client_write_timeout_s=0.2) as (hot, _),
    ):
        t = time.monotonic()
        got = await _slow_fetch(hot, 0.0, 8 * KIB, 0.01)
        took = time.monotonic() - t
        for _ in range(100):  # bounded: 5 s
            if seen:
                break
            await asyncio.sleep(0.05)
    assert got == len(state["answer"]), (got, took)
    assert [o.status for o in seen] == [200]


def _answer_with_cache(size: int) -> bytes:
    """``answer_of``'s shape, its usage with the engine's cached tokens."""
    head = b'{"object":"list","data":[],"pad":"'
    tail = b'","usage":{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


async def test_a_client_that_leaves_a_computed_answer_midway_is_charged_the_engines_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 32 MiB answer whose client reads 1 MiB and leaves (hot path): a 499, but the
    engine computed the answer, so its usage settles the charge, as a 200's (and as the
    ASGI path's, which counts it 200): without it the charge stayed the prediction."""
    seen = _recording(monkeypatch)
    settled: list[tuple[int, int]] = []
    settle = Gateway._settle_uncached

    def recorded(self: Gateway, d: Any, prompt: int, cached: int) -> None:
        settled.append((prompt, cached))
        settle(self, d, prompt, cached)

    monkeypatch.setattr(Gateway, "_settle_uncached", recorded)
    state = {"answer": _answer_with_cache(32 * KIB * KIB)}
    async with _engine(state) as engine, _servers(engine) as (hot, _):
        host, port = hot.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * KIB)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(_REQUEST), _REQUEST)
        )
        await asyncio.wait_for(reader.readexactly(KIB * KIB), 10)
        writer.transport.abort()
        for _ in range(100):  # bounded: 5 s
            if seen:
                break
            await asyncio.sleep(0.05)
    assert [(o.status, o.prompt_tokens, o.cached_tokens) for o in seen] == [(499, 3, 0)]
    assert settled == [(3, 0)]
