"""A large non-streamed answer is written without copies of it (H209).

A relayed answer of n bytes cost the gateway about 3n at its peak: the read's chunks and
their join (``UpstreamResponse.aread``), then the hot-path server joined the answer's
head and body into one new bytes for its write, and asyncio's transport copied what the
socket did not take at once into its buffer. Now an answer read off its tail (over 1 MiB,
no Responses object) is written in the chunks it was read in, never joined; the hot-path
server writes an answer over 64 KiB after its head, in pieces of at most 1 MiB as the
client takes them (one under it: with its head, in one write, as before); the ASGI
connection sends the chunks as body messages. Every size comes out byte-identical with
its content-length, through either server."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.app import create_app
from gateway.proxy import UpstreamExchange
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from gateway.upstream import UpstreamResponse
from tests.test_gateway_support import SECRET
from tests.test_h24_query_of_death import MODELS, read_request

pytestmark = pytest.mark.timeout(120)

KIB = 1024
SIZES = [0, 1, 64 * KIB - 1, 64 * KIB, 64 * KIB + 1, 5 * KIB * KIB]


def answer_of(size: int) -> bytes:
    """An embeddings-shaped JSON answer of exactly ``size`` bytes, its usage last."""
    head, tail = b'{"object":"list","data":[],"pad":"', b'","usage":{"prompt_tokens":3}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


@contextlib.asynccontextmanager
async def _engine(state: dict[str, bytes]) -> AsyncIterator[str]:
    """A loopback engine answering each embeddings request with ``state["answer"]``,
    written in 256 KiB pieces as its reader takes them (so its own buffer stays small and
    the gateway reads the answer in many chunks)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(40):  # bounded: a test sends a few dozen requests
                path, _ = await read_request(reader)
                answer = state["answer"] if path.startswith(b"/v1/embeddings") else MODELS
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % len(answer)
                )
                view = memoryview(answer)
                for at in range(0, len(answer), 256 * KIB):
                    writer.write(view[at : at + 256 * KIB])
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def _servers(engine: str, **kw: Any) -> AsyncIterator[tuple[str, str]]:
    """The gateway's hot-path server and, on the same gateway, its ASGI app under plain
    uvicorn (httptools, which checks the bodies against their content-length)."""
    gs = GatewaySettings(
        replicas=[engine], port=free_port(), open_access=True, salt_secrets=[SecretStr(SECRET)],
        read_timeout_s=30.0, response_timeout_s=30.0, **kw,
    )  # fmt: skip
    gw = build_gateway(gs)
    async with serve_in_loop(gw) as hot:
        port = free_port()
        config = uvicorn.Config(
            create_app(gw), host="127.0.0.1", port=port, loop="none", http="httptools",
            lifespan="off", log_config=None, access_log=False,
        )  # fmt: skip
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        try:
            for _ in range(400):  # bounded: 20 s
                if server.started:
                    break
                await asyncio.sleep(0.05)
            assert server.started
            yield hot, f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)


REQUEST = {"model": "m", "input": "hello there"}


async def _check(url: str, body: bytes) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        r = await h.post("/v1/embeddings", json=REQUEST)
    assert r.status_code == 200, r.text[:200]
    assert r.headers["content-length"] == str(len(body))
    assert r.content == body


async def test_each_size_is_relayed_whole_through_both_servers() -> None:
    """The relay: under 1 MiB the answer's bytes (parsed whole), the 5 MiB one in its
    chunks (read off its tail)."""
    state: dict[str, bytes] = {}
    async with _engine(state) as engine, _servers(engine) as urls:
        for size in SIZES[2:]:
            state["answer"] = answer_of(size)
            for url in urls:
                await _check(url, state["answer"])


async def test_a_connection_writes_bytes_and_chunks_of_each_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ClientConnection.answer`` itself, of any body (0 and 1 byte are no JSON answer),
    as bytes and as chunks: the hot path's one write up to 64 KiB, its pieces above; the
    ASGI connection's body messages (none of them, for no chunks)."""
    state: dict[str, Any] = {}

    async def relay(self: UpstreamExchange, conn: Any, resp: UpstreamResponse, t0: float) -> None:
        await resp.aread()
        self.status = 200
        await conn.answer(200, [(b"content-type", b"application/json")], state["body"])

    monkeypatch.setattr(UpstreamExchange, "_relay_json", relay)
    async with _engine({"answer": b"{}"}) as engine, _servers(engine) as urls:
        for size in SIZES:
            body = bytes(range(256)) * (size // 256) + b"k" * (size % 256)
            cuts = sorted({0, size // 3, size - 1 if size else 0, size})
            chunks = [body[a:b] for a, b in itertools.pairwise(cuts)]
            for form in (body, chunks, [body] if body else []):
                state["body"] = form
                for url in urls:
                    await _check(url, body)


async def test_a_client_that_reads_nothing_of_a_large_answer_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Written in pieces as the client takes them, a large answer's write meets the client
    write timeout: the stalled client is cut off (499), as a stalled stream's is."""
    seen: list[int] = []
    finish = UpstreamExchange._finish

    def recorded(self: UpstreamExchange, out: Any) -> None:
        if not self._finished:  # the outcome that counts (a later call is a no-op)
            seen.append(out.status)
        finish(self, out)

    monkeypatch.setattr(UpstreamExchange, "_finish", recorded)
    state = {"answer": answer_of(32 * KIB * KIB)}
    async with _engine(state) as engine, _servers(engine, client_write_timeout_s=0.5) as urls:
        host, port = urls[0].removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))
        body = b'{"model":"m","input":"hello there"}'
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        for _ in range(200):  # bounded: 10 s; the client reads nothing meanwhile
            if seen:
                break
            await asyncio.sleep(0.05)
        writer.close()
    assert seen == [499]


async def _fetch_discarding(url: str) -> tuple[int, str]:
    """One request over a raw socket, the answer read in 64 KiB pieces and dropped (so the
    client in this process allocates next to nothing): its length and sha256."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        body = b'{"model":"m","input":"hello there"}'
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        digest, left = hashlib.sha256(), length
        while left:
            piece = await reader.read(min(left, 64 * KIB))
            assert piece, f"{left} bytes short"
            digest.update(piece)
            left -= len(piece)
        return length, digest.hexdigest()
    finally:
        writer.close()


async def test_a_large_answer_is_written_without_copies() -> None:
    """The peak of traced allocations over a 32 MiB answer's request, read to its last
    byte: its chunks (n) and pieces of 1 MiB in the transports' buffers. With the join
    of its chunks, the head's join with it and asyncio's transport copy it was 3-4n."""
    size = 32 * KIB * KIB
    state = {"answer": answer_of(size)}
    expected = (size, hashlib.sha256(state["answer"]).hexdigest())
    async with _engine(state) as engine, _servers(engine) as (hot, _):
        assert await _fetch_discarding(hot) == expected  # a warm-up
        tracemalloc.start()
        try:
            got = await _fetch_discarding(hot)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert got == expected
    assert peak < 1.3 * size, peak / size
