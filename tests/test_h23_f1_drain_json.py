"""A non-streamed request still running when the drain timeout (KVGATE_DRAIN_TIMEOUT_S)
runs out. uvicorn cancels its task; the cycle ended a cut stream with an SSE ``draining``
error event but left a JSON answer not yet begun bare: the connection closed with no
answer at all (curl: exit 52, "Empty reply from server"). It is a 503 ``draining`` error
in OpenAI's shape, as a request arriving while draining gets, and the connection closes."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text
from tests.test_upstream_faults import FakeReplica, completion

pytestmark = pytest.mark.timeout(60)


async def test_a_json_request_cut_by_the_drain_timeout_is_a_503_draining() -> None:
    async def never(w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)  # the engine is still computing when the gateway stops

    rep = FakeReplica(never)
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
        gw = build_gateway(gs, policy=parse_policy_text(""))
        async with httpx.AsyncClient(timeout=20) as h:
            async with contextlib.AsyncExitStack() as running:
                url = await running.enter_async_context(serve_in_loop(gw))
                req = asyncio.ensure_future(h.post(url + "/v1/completions", json=completion()))
                for _ in range(200):  # until the replica has it: at most 10 s
                    if rep.posts:
                        break
                    await asyncio.sleep(0.05)
                assert rep.posts == 1
            # the gateway has stopped (its drain timeout cut the request)
            r = await asyncio.wait_for(req, 10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "draining"
        assert r.headers.get("connection") == "close"
        assert r.headers.get("x-request-id")
    finally:
        await rep.stop()
