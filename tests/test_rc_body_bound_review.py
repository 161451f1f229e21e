"""Review R-C of the whole-answer bound (H193, c33da89).

* The usual JSON answer (whole with its head) reads as before the bound: no header looked
  up for its length (it is what arrived), and a chunked one is joined once.
* The parsed answer is not held while the client takes the answer: with it, a relayed
  answer of n bytes held its bytes, their parse (about n again for text, more for an
  embedding's floats) and the write's copy at once.
* The oversized-event and oversized-body WARNINGs are rate-limited apart: one no longer
  hid the other for a minute.

Real gateway against a loopback engine on a free port, as tests/test_h193_body_bound.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tracemalloc
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.hotpath import HotCycle
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from gateway.upstream import LeanTransport, UpstreamResponse, _Body, _Conn
from tests.test_gateway_support import SECRET
from tests.test_h24_query_of_death import MODELS, read_request
from tests.test_h193_body_bound import _chat, completion, engine

pytestmark = pytest.mark.timeout(60)

LIMIT = 1024 * 1024


class _Unread(list[tuple[bytes, bytes]]):
    """Response headers that fail the test when looked through."""

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        raise AssertionError("headers looked up")


def _response(chunks: list[bytes], complete: bool, headers: list[tuple[bytes, bytes]]) -> Any:
    conn = _Conn(asyncio.get_running_loop())
    conn.chunks = deque(chunks)
    conn.complete = complete
    return UpstreamResponse(200, headers, _Body(LeanTransport(), ("h", 1, False), conn, 1, 1))


async def test_an_answer_whole_with_its_head_looks_up_no_header() -> None:
    # the hot path's usual answer: the bound costs it one length check (a content-length
    # lookup cost 1 us a request: 0.5 us before the bound, 1.5 us with it)
    body = completion(2048)
    r = _response([body], True, _Unread([(b"content-length", b"2048")]))
    assert await r.aread(LIMIT) == body


async def test_a_chunked_answer_is_read_whole_under_the_bound() -> None:
    chunks = [b"a" * 1000, b"b" * 1000, b"c" * 96]
    r = _response([], False, [])
    conn, loop = r.body.conn, asyncio.get_running_loop()
    for i, chunk in enumerate(chunks):  # as they arrive, one read each
        loop.call_later(0.01 * (i + 1), conn.on_body, chunk)
    loop.call_later(0.01 * len(chunks), conn.on_message_complete)
    assert await r.aread(4096) == b"".join(chunks)
    assert not conn.closed


@contextlib.asynccontextmanager
async def _engine(body: bytes) -> AsyncIterator[str]:
    """A loopback engine answering every chat with ``body`` (made by the caller, so its
    bytes are not the gateway's to count)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(20):  # bounded: a test sends a few requests
                path, _ = await read_request(reader)
                answer = body if path == b"/v1/chat/completions" else MODELS
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % len(answer)
                )
                writer.write(answer)
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
async def _gateway(url: str, **kw: Any) -> AsyncIterator[httpx.AsyncClient]:
    gs = GatewaySettings(
        replicas=[url], port=free_port(), open_access=True, salt_secrets=[SecretStr(SECRET)],
        read_timeout_s=30.0, response_timeout_s=30.0, **kw,
    )  # fmt: skip
    gw = build_gateway(gs)
    async with serve_in_loop(gw) as gw_url, httpx.AsyncClient(base_url=gw_url, timeout=30) as h:
        yield h


async def test_the_parsed_answer_is_not_held_while_it_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    size = 16 * 1024 * 1024
    body = completion(size)
    held: list[int] = []
    answer = HotCycle.answer

    async def measured(self: HotCycle, status: int, headers: Any, data: Any) -> None:
        # read off its tail, the answer comes in its chunks (H209)
        n = len(data) if isinstance(data, bytes) else sum(map(len, data))
        if n == size and tracemalloc.is_tracing():
            held.append(tracemalloc.get_traced_memory()[0])
        await answer(self, status, headers, data)

    monkeypatch.setattr(HotCycle, "answer", measured)
    async with _engine(body) as url, _gateway(url) as h:
        assert (await _chat(h)).content == body  # a warm-up: connections, caches
        tracemalloc.start()
        try:
            r = await _chat(h)
        finally:
            tracemalloc.stop()
        assert r.status_code == 200 and r.content == body
    # the gateway's own allocations since the start, at the write: the answer's bytes (n;
    # the client's read of them comes after); with its parse held too, 2n
    assert len(held) == 1
    assert held[0] < 1.5 * size, held[0] / size


async def test_an_oversized_body_is_logged_after_an_oversized_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.proxy")
    async with (
        engine() as eng,
        _gateway(eng["url"], max_upstream_body_bytes=LIMIT, max_upstream_event_bytes=LIMIT) as h,
    ):
        eng["mode"] = ("chunked", 200, 4 * LIMIT)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            assert b"upstream replica failed mid-stream" in await r.aread()
        eng["sent"] = 0
        assert (await _chat(h)).status_code == 502
    messages = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert "upstream failed mid-stream" in messages, messages
    # within the minute: it was the same replica's one WARNING a minute, and not logged
    assert "upstream answer over KVGATE_MAX_UPSTREAM_BODY_BYTES: not relayed" in messages
