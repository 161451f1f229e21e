"""A request cut by the gateway's own drain timeout is the gateway's 503, not a client's
499: the exchange's outcome (trace, finish) and ``kvgate_requests`` said 499 ("client
closed"), so a shutdown that cut requests read as impatient clients. A client that leaves
is still a 499, and neither counts against the replica."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.core import Dispatch, Gateway, Outcome
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text
from tests.test_upstream_faults import FakeReplica, completion

pytestmark = pytest.mark.timeout(60)

STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _stuck(w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)  # the engine is still computing when the gateway stops


async def _stream_then_stuck(w: asyncio.StreamWriter) -> None:
    w.write(STREAM_HEAD + _chunk(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'))
    await w.drain()
    await asyncio.sleep(30)


def _recording(gw: Gateway) -> list[Outcome]:
    seen: list[Outcome] = []
    finish = gw.finish

    def record(d: Dispatch, out: Outcome) -> None:
        seen.append(out)
        finish(d, out)

    gw.finish = record  # type: ignore[method-assign]
    return seen


@contextlib.asynccontextmanager
async def _gateway(rep: FakeReplica) -> AsyncIterator[Gateway]:
    await rep.start()
    try:
        gs = GatewaySettings(
            replicas=[rep.url],
            port=free_port(),
            open_access=True,
            salt_secrets=[SecretStr("s" * 32)],
            seed=7,
            drain_timeout_s=0.5,
        )
        yield build_gateway(gs, policy=parse_policy_text(""))
    finally:
        await rep.stop()


async def _until_posted(rep: FakeReplica) -> None:
    for _ in range(200):  # until the replica has it: at most 10 s
        if rep.posts:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the replica never got the request")


def _requests(gw: Gateway, status: str) -> float:
    return float(gw.metrics.requests.labels("completion", status)._value.get())


async def test_a_json_request_cut_by_the_drain_is_counted_503_not_499() -> None:
    rep = FakeReplica(_stuck)
    async with _gateway(rep) as gw:
        seen = _recording(gw)
        async with httpx.AsyncClient(timeout=20) as h:
            async with contextlib.AsyncExitStack() as running:
                url = await running.enter_async_context(serve_in_loop(gw))
                req = asyncio.ensure_future(h.post(url + "/v1/completions", json=completion()))
                await _until_posted(rep)
            r = await asyncio.wait_for(req, 10)  # the drain timeout cut it
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert [o.status for o in seen] == [503]
        assert seen[0].error is None  # the gateway's cut: nothing against the replica
        assert _requests(gw, "503") == 1 and _requests(gw, "499") == 0


async def test_a_stream_cut_by_the_drain_is_an_outcome_503() -> None:
    rep = FakeReplica(_stream_then_stuck)
    async with _gateway(rep) as gw:
        seen = _recording(gw)
        async with httpx.AsyncClient(timeout=20) as h:
            async with contextlib.AsyncExitStack() as running:
                url = await running.enter_async_context(serve_in_loop(gw))
                body = {**completion(), "stream": True}
                req = h.build_request("POST", url + "/v1/completions", json=body)
                r = await asyncio.wait_for(h.send(req, stream=True), 10)  # the head is out
                assert r.status_code == 200
            content = await asyncio.wait_for(r.aread(), 10)
        assert b"draining" in content  # the SSE error event
        assert [o.status for o in seen] == [503] and seen[0].error is None
        assert _requests(gw, "499") == 0


async def test_a_client_that_leaves_is_still_a_499() -> None:
    rep = FakeReplica(_stuck)
    async with _gateway(rep) as gw:
        seen = _recording(gw)
        async with serve_in_loop(gw) as url, httpx.AsyncClient(timeout=20) as h:
            req = asyncio.ensure_future(h.post(url + "/v1/completions", json=completion()))
            await _until_posted(rep)
            req.cancel()  # the client gives up
            with contextlib.suppress(asyncio.CancelledError):
                await req
            for _ in range(100):  # the gateway sees the disconnect: at most 5 s
                if seen:
                    break
                await asyncio.sleep(0.05)
        assert [o.status for o in seen] == [499]
        assert _requests(gw, "499") == 1 and _requests(gw, "503") == 0
