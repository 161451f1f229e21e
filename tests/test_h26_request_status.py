"""``kvgate_requests{endpoint,status}`` counts what a request came to (its outcome, as the
request trace and span say), not the status of its answer's head.

It counted the head's: a stream that broke mid-way (outcome 502, an SSE error event after a
200 head) or whose client left mid-stream (outcome 499) counted 200, so an operator's error
rate from kvgate_requests missed every mid-stream failure. Real pieces: the gateway on
loopback (its own protocol, and the ASGI app) against scripted fake replicas."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.app import create_app
from gateway.core import Gateway, Outcome
from gateway.serve import serve_in_loop
from tests.test_h25_drain_outcome import STREAM_HEAD, _chunk, _gateway, _recording, _requests
from tests.test_upstream_faults import FakeReplica, completion

pytestmark = pytest.mark.timeout(60)

FIRST = _chunk(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')


async def _break_after_one_chunk(w: asyncio.StreamWriter) -> None:
    w.write(STREAM_HEAD + FIRST)
    await w.drain()
    await asyncio.sleep(0.2)
    w.close()  # the replica dies mid-stream: the chunked body never ends


async def _end_without_done(w: asyncio.StreamWriter) -> None:
    w.write(STREAM_HEAD + FIRST + b"0\r\n\r\n")  # a whole body, but no data: [DONE]


async def _one_chunk_then_stuck(w: asyncio.StreamWriter) -> None:
    w.write(STREAM_HEAD + FIRST)
    await w.drain()
    await asyncio.sleep(30)


async def _until(seen: list[Outcome]) -> None:
    for _ in range(100):  # the gateway finishes the exchange: at most 5 s
        if seen:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the exchange never finished")


@contextlib.asynccontextmanager
async def _hot(gw: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=20) as h:
        yield h


def _counts(gw: Gateway) -> dict[str, float]:
    return {s: _requests(gw, s) for s in ("200", "499", "502", "503")}


@pytest.mark.parametrize("script", [_break_after_one_chunk, _end_without_done])
async def test_a_stream_that_breaks_mid_way_counts_502(script: object) -> None:
    rep = FakeReplica(script)  # type: ignore[arg-type]
    async with _gateway(rep) as gw:
        seen = _recording(gw)
        async with _hot(gw) as h:
            body = {**completion(), "stream": True}
            r = await asyncio.wait_for(h.post("/v1/completions", json=body), 10)
        assert r.status_code == 200  # the head was out before the break
        assert b"upstream_error" in r.content and r.content.rstrip().endswith(b"[DONE]")
        assert [o.status for o in seen] == [502]
        assert _counts(gw) == {"200": 0, "499": 0, "502": 1, "503": 0}


async def test_a_stream_that_breaks_mid_way_counts_502_under_asgi() -> None:
    rep = FakeReplica(_break_after_one_chunk)
    async with _gateway(rep) as gw:
        seen = _recording(gw)
        app = create_app(gw)
        await gw.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as h:
                body = {**completion(), "stream": True}
                r = await asyncio.wait_for(h.post("/v1/completions", json=body), 10)
        finally:
            await gw.stop()
        assert r.status_code == 200 and b"upstream_error" in r.content
        assert [o.status for o in seen] == [502]
        assert _counts(gw) == {"200": 0, "499": 0, "502": 1, "503": 0}


async def test_a_client_that_leaves_mid_stream_counts_499() -> None:
    rep = FakeReplica(_one_chunk_then_stuck)
    async with _gateway(rep) as gw:
        seen = _recording(gw)
        async with _hot(gw) as h:
            body = {**completion(), "stream": True}
            req = h.build_request("POST", "/v1/completions", json=body)
            r = await asyncio.wait_for(h.send(req, stream=True), 10)
            assert r.status_code == 200
            chunks = r.aiter_raw()
            first = await asyncio.wait_for(chunks.__anext__(), 10)  # the first event came
            assert b'"text": "a"' in first
            await r.aclose()  # the client leaves mid-stream
            await _until(seen)
        assert [o.status for o in seen] == [499]
        assert _counts(gw) == {"200": 0, "499": 1, "502": 0, "503": 0}
