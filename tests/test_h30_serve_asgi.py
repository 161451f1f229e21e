"""``cachecore.testing.serve_asgi``: a server with a response still in flight stops within
its graceful-shutdown bound (review H134 E: the stop was an unbounded wait, so a test that
failed half way through a streamed answer hung until pytest's timeout)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from cachecore.testing import serve_asgi

pytestmark = pytest.mark.timeout(60)


async def _never_ending(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"x", "more_body": True})
    await asyncio.sleep(3600)  # a response that never ends


async def test_a_response_in_flight_does_not_hold_the_stop() -> None:
    client = httpx.AsyncClient(timeout=30)
    try:
        async with serve_asgi(_never_ending) as url:
            r = await client.send(client.build_request("GET", url), stream=True)
            assert r.status_code == 200
            assert await anext(r.aiter_bytes()) == b"x"
            t0 = time.monotonic()
        # the server stopped with the response still open: cut after the default 5 s
        assert time.monotonic() - t0 < 10
        await r.aclose()
    finally:
        await client.aclose()
