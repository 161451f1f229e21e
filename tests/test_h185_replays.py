"""Streamed retrievals (``GET /v1/responses/{id}?stream=true``, D33) through a real gateway
and simulated replicas (H185 review of 8bbc3f7 and 622fa31): a replay holds its connection
as long as the run it replays, so it is bounded per tenant although a retrieval is admitted
past the slots its background runs hold; and its first chunk, its API server's, is no TTFT."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.test_gateway_support import Stack, stack, words
from tests.test_responses_background import _events, _until

pytestmark = pytest.mark.timeout(90)

ONE_SLOT = "default_tenant:\n  limits: {max_concurrency: 1}\n"


def _ttft_samples(st: Stack, replica: str) -> float:
    got = st.gw.metrics.registry.get_sample_value("kvgate_ttft_seconds_count", {"replica": replica})
    return got or 0.0


async def test_replays_are_bounded_per_tenant_beside_its_background_runs() -> None:
    async with stack(count=1, policy=ONE_SLOT, background_poll_s=0.05) as st, st.http() as h:
        body: dict[str, Any] = {
            "model": st.model, "input": words(20, 50), "max_output_tokens": 4000,
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for chunk in resp.aiter_bytes():
                rid = _events(chunk.split(b"\n\n", 1)[0] + b"\n\n")[0]["response"]["id"]
                break
        lim = st.gw.limiter
        await _until(lambda: lim.in_flight("anonymous") == 1)  # the run's slot, watched
        # past the run's events: vLLM's replay waits (for ever, once the run is over)
        url = f"/v1/responses/{rid}?stream=true&starting_after=1000000"
        heads: list[int] = []
        opened = asyncio.Event()

        async def replay() -> None:
            async with h.stream("GET", url) as r:
                heads.append(r.status_code)
                opened.set()
                await r.aread()

        first = asyncio.create_task(replay())
        await asyncio.wait_for(opened.wait(), 10)
        # the run holds the tenant's only slot, yet its stream can be resumed...
        assert heads == [200]
        # ...but not by as many replays as the tenant likes, each holding a connection
        second = await h.get(url)
        assert second.status_code == 429, second.text
        assert second.json()["error"]["limit"] == "concurrency"
        assert int(second.headers["retry-after"]) >= 1
        # a plain retrieval and the cancel are still served
        assert (await h.get(f"/v1/responses/{rid}")).status_code == 200
        assert (await h.post(f"/v1/responses/{rid}/cancel")).status_code == 200
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        # the replay's release, once, with its run's
        await _until(lambda: lim.in_flight("anonymous") == 0)
        assert lim._tenants["anonymous"].replays == 0
        # and a replay may be opened again
        again = asyncio.create_task(replay())
        opened.clear()
        await asyncio.wait_for(opened.wait(), 10)
        assert heads == [200, 200]
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)
        await _until(lambda: lim.in_flight("anonymous") == 0)


async def test_a_replays_first_chunk_is_no_ttft_sample() -> None:
    async with stack(count=1, background_poll_s=0.05) as st, st.http() as h:
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]
        body: dict[str, Any] = {
            "model": st.model, "input": words(30, 51), "max_output_tokens": 6,
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            raw = await resp.aread()
        rid = _events(raw)[0]["response"]["id"]
        assert _ttft_samples(st, rep.id) == 1  # the run's own, at its first output
        for query in ("stream=true", "stream=true&starting_after=2"):
            r = await h.get(f"/v1/responses/{rid}?{query}")
            assert r.status_code == 200 and b"response.completed" in r.content, r.text
        # a replay's first chunk is the API server's, from stored events: not the engine's
        assert _ttft_samples(st, rep.id) == 1
