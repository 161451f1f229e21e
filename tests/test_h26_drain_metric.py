"""A stream already answering when the drain timeout cuts it counts 503 in
``kvgate_requests``, as its outcome and request trace say: the metric counted it as 200 (the
status its head had said), so a shutdown that cut streams read as answers served."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from gateway.serve import serve_in_loop
from tests.test_h25_drain_outcome import (
    _gateway,
    _recording,
    _requests,
    _stream_then_stuck,
)
from tests.test_upstream_faults import FakeReplica, completion

pytestmark = pytest.mark.timeout(60)


async def test_a_stream_cut_by_the_drain_counts_503_in_kvgate_requests() -> None:
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
        assert b"draining" in content
        assert [o.status for o in seen] == [503]
        assert _requests(gw, "503") == 1
        assert _requests(gw, "200") == 0 and _requests(gw, "499") == 0
