"""A background Responses run's precision and claim check (D33, H205): its POST answers
``queued`` with no usage, so the gateway judges its prediction when its watch sees the
run end with the engine's usage (a watcher's poll or a client's retrieval), once, as a
synchronous answer's is judged at its end; a run ended without usage (cancelled) adds
nothing, and a streamed run that ends in its own stream is judged there, not again. Real
simulated replicas, an embedded agent indexing what they store, and a real gateway."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_faults import checked, claim_checks
from tests.test_gateway_support import Stack, stack, words
from tests.test_responses_background import _held, _until

pytestmark = pytest.mark.timeout(90)


def _precision(st: Stack) -> tuple[float, float, float]:
    """The precision counters' sums: predicted and actual cached tokens, prompt tokens."""
    m = st.gw.metrics
    return _count(m.predicted_cached), _count(m.actual_cached), _count(m.prompt_tokens)


def _added(st: Stack, before: tuple[float, float, float]) -> tuple[float, ...]:
    return tuple(a - b for a, b in zip(_precision(st), before, strict=True))


async def _stored_blocks(st: Stack, body: dict[str, Any]) -> int:
    """Blocks the index holds stored on the one replica for ``body``'s prompt, once its
    agent has indexed them (bounded: 10 s)."""
    rid = st.replica_id(0)
    got = 0
    for _ in range(200):
        d = await st.gw.prepare("responses", "anonymous", body, {}, "x", explain_only=True)
        match = d.matches[d.salt_index].get(rid) if d.matches else None
        got = match.stored_blocks if match is not None else 0
        if got:
            return got
        await asyncio.sleep(0.05)
    return got


async def _final(h: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    """The stored response, polled by the client until terminal (bounded: 20 s)."""
    deadline = time.monotonic() + 20.0
    while True:
        got = (await h.get(f"/v1/responses/{rid}")).json()
        if got["status"] not in ("queued", "in_progress"):
            return dict(got)
        assert time.monotonic() < deadline, got["status"]
        await asyncio.sleep(0.02)


async def test_a_background_run_is_judged_once_at_its_end_with_the_engines_usage() -> None:
    async with stack(count=1, agents=True, background_poll_s=0.05) as st, st.http() as h:
        rid = st.replica_id(0)
        body = {"model": st.model, "instructions": words(64, 31), "input": words(40, 32)}
        bg = {**body, "max_output_tokens": 4, "background": True}
        # a first turn, cold: the watcher's poll sees it end
        before = _precision(st)
        r = await h.post("/v1/responses", json=bg)
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == 0
        assert _added(st, before) == (0, 0, 0)  # the queued answer has no usage
        await _until(lambda: _held(st.gw) == 0)
        # "incomplete": its max_output_tokens reached
        assert _count(st.gw.metrics.background_responses, outcome="incomplete") == 1
        got = await _final(h, r.json()["id"])  # no longer watched: judged nothing more
        usage = got["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert _added(st, before) == (0, cached, usage["input_tokens"])
        # the same prompt again, a hit on the blocks the agent indexed: a client's
        # retrieval sees it end, and the claim the lookup read is checked
        stored = await _stored_blocks(st, body)
        assert stored >= 2, stored
        before = _precision(st)
        r = await h.post("/v1/responses", json=bg)
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        assert predicted > 0
        got = await _final(h, r.json()["id"])
        await _until(lambda: _held(st.gw) == 0)
        usage = got["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert cached >= predicted
        assert _added(st, before) == (predicted, cached, usage["input_tokens"])
        assert (await checked(st.gw, rid, 1))["agree"] == 1
        # a run cancelled at once ends without usage: nothing judged, no claim checked
        before = _precision(st)
        r = await h.post("/v1/responses", json={**bg, "max_output_tokens": 400})
        assert r.status_code == 200, r.text
        c = await h.post(f"/v1/responses/{r.json()['id']}/cancel")
        assert c.status_code == 200 and c.json()["status"] == "cancelled", c.text
        assert c.json()["usage"] is None
        await _until(lambda: _held(st.gw) == 0)
        assert _count(st.gw.metrics.background_responses, outcome="cancelled") == 1
        await asyncio.sleep(0.3)  # past a few polls: nothing judged late either
        assert _added(st, before) == (0, 0, 0)
        assert sum(claim_checks(st.gw, rid).values()) == 1


async def test_a_streamed_background_run_that_ends_in_its_stream_is_judged_once() -> None:
    # its terminal event carries the usage through the relay: judged at the answer's end
    # (with its TTFT: the first output event), never watched, so not judged again
    async with stack(count=1, background_poll_s=0.05) as st, st.http() as h:
        body = {"model": st.model, "input": words(48, 33), "max_output_tokens": 4}
        before = _precision(st)
        raw = b""
        async with h.stream(
            "POST", "/v1/responses", json={**body, "background": True, "stream": True}
        ) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_bytes():
                raw += chunk
        events = [orjson.loads(e.split(b"data: ", 1)[1]) for e in raw.split(b"\n\n") if e]
        assert events[-1]["type"] == "response.completed", events[-1]
        usage = events[-1]["response"]["usage"]
        await _until(lambda: _held(st.gw) == 0)
        await asyncio.sleep(0.3)  # past a few polls
        cached = usage["input_tokens_details"]["cached_tokens"]
        assert _added(st, before) == (0, cached, usage["input_tokens"])
        assert st.gw.metrics.background_watched._value.get() == 0
