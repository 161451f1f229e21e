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
from starlette.requests import ClientDisconnect

from gateway.app import Completions, create_app
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


@pytest.mark.parametrize(("gone", "counted"), [(True, "499"), (False, "503"), (None, None)])
async def test_a_request_cut_before_dispatch_counts_by_who_cut_it(
    gone: bool | None, counted: str | None
) -> None:
    """A request cancelled in its body read (or its routing) was not counted at all: the
    hot path cancels the task when the client leaves (499), the drain timeout when it cuts
    (503); a server that cannot say which (``gone`` None) counts nothing."""
    rep = FakeReplica()
    async with _gateway(rep) as gw:
        arrived = asyncio.Event()

        async def read_body(limit: int) -> bytes:
            arrived.set()
            await asyncio.sleep(30)  # the body is still on its way
            return b""

        flag = (lambda: gone) if gone is not None else None
        task = asyncio.ensure_future(
            Completions(gw).handle("completion", {}, read_body, "127.0.0.1", flag)
        )
        await asyncio.wait_for(arrived.wait(), 5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        want = {"200": 0, "499": 0, "502": 0, "503": 0}
        if counted is not None:
            want[counted] = 1
        assert _counts(gw) == want


async def test_a_body_read_that_fails_counts_499() -> None:
    """Starlette's ClientDisconnect (the ASGI side's client leaving mid-body) went past every
    count too."""
    rep = FakeReplica()
    async with _gateway(rep) as gw:

        async def read_body(limit: int) -> bytes:
            raise ClientDisconnect()

        with pytest.raises(ClientDisconnect):
            await Completions(gw).handle("completion", {}, read_body, "127.0.0.1")
        assert _counts(gw) == {"200": 0, "499": 1, "502": 0, "503": 0}


async def test_a_gateway_bug_before_dispatch_counts_500() -> None:
    rep = FakeReplica()
    async with _gateway(rep) as gw:

        async def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("a bug in routing")

        gw.prepare = broken  # type: ignore[method-assign,assignment]
        async with _hot(gw) as h:
            r = await asyncio.wait_for(h.post("/v1/completions", json=completion()), 10)
            assert r.status_code == 500
            asgi = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(gw)), base_url="http://t"
            )
            async with asgi:
                r = await asyncio.wait_for(asgi.post("/v1/completions", json=completion()), 10)
            assert r.status_code == 500
        assert _requests(gw, "500") == 2 and gw.in_flight == 0


async def _half_a_body(url: str) -> asyncio.StreamWriter:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    _, w = await asyncio.open_connection(host, int(port))
    w.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n" + b'{"model": "fake-model", "prompt": "hel'
    )
    await w.drain()
    await asyncio.sleep(0.3)  # the gateway is reading the body
    return w


async def test_a_client_that_leaves_mid_body_counts_499_on_the_hot_path() -> None:
    rep = FakeReplica()
    async with _gateway(rep) as gw, serve_in_loop(gw) as url:
        w = await _half_a_body(url)
        w.close()  # the client leaves before its body is whole
        for _ in range(100):  # the gateway sees it: at most 5 s
            if _requests(gw, "499"):
                break
            await asyncio.sleep(0.05)
        assert _counts(gw) == {"200": 0, "499": 1, "502": 0, "503": 0}
        assert rep.posts == 0


async def test_a_request_the_drain_cuts_mid_body_counts_503_on_the_hot_path() -> None:
    rep = FakeReplica()
    async with _gateway(rep) as gw:
        async with contextlib.AsyncExitStack() as running:
            url = await running.enter_async_context(serve_in_loop(gw))
            w = await _half_a_body(url)
        # the server stopped: its drain timeout (0.5 s) cut the body read
        w.close()
        assert _counts(gw) == {"200": 0, "499": 0, "502": 0, "503": 1}
