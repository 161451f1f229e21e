"""H29 recovery walkthrough: an engine that keeps serving but publishes no KV events (a broken
publisher, a wrong kv_events_config, a ZMQ HWM drop) looked idle to its agent: /health ok,
lag_s growing as when idle, and only the gateways noticed (predicted and actual cached
tokens disagreeing) while the index went stale. The agent now reads the engine's counters
(prompt tokens computed past the prefix cache, generated tokens, finished requests) and
says when they prove new blocks over a window in which no live batch arrived
(cachecore.agent.silence): /health degraded with a stream_problem, a WARNING once, an INFO
when batches flow again, kvgate_agent_events_silent.

The simulated replica (vLLM's metric names, /debug/drop_events keeps batches in its replay
buffer but publishes none of them) and a real agent, its HTTP /health, on a memory index."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cachecore.agent import Agent
from cachecore.agent.http import AgentHTTPServer
from cachecore.agent.scrape import EngineCounters, EngineSnapshot
from cachecore.agent.silence import SilenceDetector
from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import ReplicaEndpoints
from tests.test_agent_helpers import counter_total, salt, until
from tests.test_agent_replica import (
    BLOCK,
    agent_settings,
    assert_index_matches,
    replica_settings,
)

WINDOW_S = 1.0
SILENT = "published no KV events"


@dataclass
class Stack:
    ep: ReplicaEndpoints
    agent: Agent
    index: MemoryIndex
    client: httpx.AsyncClient
    health_url: str
    rng: random.Random

    async def health(self) -> tuple[int, dict[str, Any]]:
        r = await self.client.get(self.health_url, timeout=5)
        return r.status_code, r.json()

    async def request(self, n_blocks: int = 6, prompt: list[int] | None = None) -> None:
        """One completion of ``n_blocks`` blocks of fresh tokens (or ``prompt``)."""
        if prompt is None:
            prompt = [self.rng.randrange(100, 5000) for _ in range(n_blocks * BLOCK + 3)]
        r = await self.client.post(
            f"{self.ep.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 3, "cache_salt": salt("tenant0")},
            timeout=30,
        )
        assert r.status_code == 200, r.text

    async def drop_events(self, n: int) -> None:
        r = await self.client.post(f"{self.ep.url}/debug/drop_events", json={"n": n})
        assert r.status_code == 200, r.text


@asynccontextmanager
async def stack(window_s: float = WINDOW_S, **agent_kw: Any) -> AsyncIterator[Stack]:
    async with run_fleet(replica_settings(num_blocks=512), count=1) as fleet:
        ep = fleet.endpoints[0]
        index = MemoryIndex()
        agent = Agent(agent_settings(ep, events_silence_window_s=window_s, **agent_kw), index)
        server = AgentHTTPServer([agent], "127.0.0.1", 0)
        try:
            await agent.start()
            await agent.wait_ready(10)
            await server.start()
            await asyncio.sleep(0.2)  # the SUB connection reaches the PUB
            async with httpx.AsyncClient() as client:
                yield Stack(
                    ep,
                    agent,
                    index,
                    client,
                    f"http://127.0.0.1:{server.port}/health",
                    random.Random(29),
                )
        finally:
            await server.stop()
            await agent.stop()


async def load_for(s: Stack, seconds: float, check: Any = None, step_s: float = 0.1) -> None:
    """Requests one after another for ``seconds`` (bounded in count), calling ``check``
    after each."""
    deadline = time.monotonic() + seconds
    for _ in range(int(seconds / step_s) + 2):
        if time.monotonic() >= deadline:
            return
        await s.request()
        if check is not None:
            await check()
        await asyncio.sleep(step_s)


# --------------------------------------------------------------------------- end to end


async def test_an_engine_serving_without_events_degrades_health_until_they_flow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """(a) The walkthrough's fault: requests keep being served while every batch is dropped.
    Within the window (plus its quarter of grace and a scrape) /health is degraded and names
    the cause; batches flowing again bring it back to ok, and the replay fills the index."""
    caplog.set_level(logging.INFO, logger="cachecore.agent.silence")
    async with stack() as s:
        for _ in range(3):
            await s.request()
        await asyncio.sleep(0.3)
        status, body = await s.health()
        assert (status, body["status"], body["stream_problem"]) == (200, "ok", None)

        await s.drop_events(1_000_000)
        t0 = time.monotonic()
        found: dict[str, Any] = {}

        async def degraded() -> None:
            code, h = await s.health()
            if h["stream_problem"] and SILENT in h["stream_problem"]:
                found.update(h, code=code)

        deadline = time.monotonic() + 15.0
        for _ in range(200):
            if found or time.monotonic() > deadline:
                break
            await s.request()
            await degraded()
            await asyncio.sleep(0.1)
        took = time.monotonic() - t0
        assert found, "the agent's /health never said the engine publishes no events"
        assert found["status"] == "degraded" and found["code"] == 503
        assert (
            "computed" in found["stream_problem"] and "kv_events_config" in found["stream_problem"]
        )
        assert took < 4 * WINDOW_S + 2.0, took
        assert s.agent.metrics.events_silent._value.get() == 1
        assert counter_total(s.agent.metrics.silences) == 1

        def silence_logs(level: int) -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if r.name == "cachecore.agent.silence" and r.levelno == level
            ]

        assert len(silence_logs(logging.WARNING)) == 1
        assert "publishes no KV events" in silence_logs(logging.WARNING)[0]
        # it stays degraded while the engine, still broken, goes idle
        await asyncio.sleep(2 * WINDOW_S)
        _, body = await s.health()
        assert body["status"] == "degraded" and SILENT in body["stream_problem"]
        assert len(silence_logs(logging.WARNING)) == 1

        await s.drop_events(0)  # the publisher works again
        await s.request()

        async def ok() -> bool:
            _, h = await s.health()
            return bool(h["status"] == "ok" and h["stream_problem"] is None)

        await until(ok, 10.0, step_s=0.05)
        assert s.agent.metrics.events_silent._value.get() == 0
        assert [m for m in silence_logs(logging.INFO) if "silence ended" in m]
        # the batches it never published came by replay: the index is the engine's again
        await assert_index_matches(s.client, s.ep, s.agent, s.index)
        assert (await s.index.meta("r0")).state is ReplicaState.LIVE


async def test_an_idle_engine_stays_ok_past_the_window() -> None:
    """(b) An idle engine publishes nothing and computes nothing: ok for three windows, and
    so is one whose publisher drops everything while nobody sends it a request."""
    async with stack() as s:
        await s.request()
        await asyncio.sleep(0.2)
        await s.drop_events(1_000_000)
        deadline = time.monotonic() + 3 * WINDOW_S + 0.5
        for _ in range(200):
            if time.monotonic() > deadline:
                break
            status, body = await s.health()
            assert (status, body["status"], body["stream_problem"]) == (200, "ok", None)
            await asyncio.sleep(0.05)
        assert counter_total(s.agent.metrics.silences) == 0


async def test_an_engine_under_load_with_events_flowing_stays_ok() -> None:
    """(c) Requests back to back for three windows with every batch published: never
    degraded (a batch arrives after each request's blocks are stored)."""
    async with stack() as s:

        async def check() -> None:
            status, body = await s.health()
            assert (status, body["status"], body["stream_problem"]) == (200, "ok", None), body

        await load_for(s, 3 * WINDOW_S + 0.5, check)
        assert counter_total(s.agent.metrics.silences) == 0
        assert counter_total(s.agent.metrics.blocks_stored) > 0


async def test_prompts_served_from_the_prefix_cache_prove_no_new_blocks() -> None:
    """A request fully served from the prefix cache stores nothing new: repeated prompts
    with events dropped compute under a block each (the last block's partial tokens and
    three generated ones), so the agent has no evidence and stays ok, although the
    engine's vllm:prompt_tokens_total grows by the whole prompt every time."""
    async with stack() as s:
        rng = random.Random(3)
        prompt = [rng.randrange(100, 5000) for _ in range(8 * BLOCK + 5)]
        await s.request(prompt=prompt)
        await asyncio.sleep(0.2)
        await s.drop_events(1_000_000)
        deadline = time.monotonic() + 3 * WINDOW_S + 0.5
        for _ in range(200):
            if time.monotonic() > deadline:
                break
            await s.request(prompt=prompt)
            status, body = await s.health()
            assert (status, body["status"], body["stream_problem"]) == (200, "ok", None), body
            await asyncio.sleep(0.05)
        snap = await s.agent.scraper.metrics()
        assert snap.prompt_tokens is not None and snap.prompt_tokens > 10 * len(prompt)
        assert counter_total(s.agent.metrics.silences) == 0


async def test_the_window_setting_zero_turns_the_check_off() -> None:
    async with stack(window_s=0.0) as s:
        await s.drop_events(1_000_000)
        await load_for(s, 2.0)
        status, body = await s.health()
        assert (status, body["status"]) == (200, "ok")
        assert counter_total(s.agent.metrics.silences) == 0


async def test_an_engine_restart_clears_the_old_process_seq_from_health_and_gauge() -> None:
    """After the replica is cleared for an engine restart, /health's received_seq and the
    kvgate_agent_last_seq gauge kept the old process's seq until the new engine's first
    batch (for ever if none came): now both start over at the clear."""
    async with stack() as s:
        for _ in range(4):
            await s.request()
        await assert_index_matches(s.client, s.ep, s.agent, s.index)
        _, body = await s.health()
        old = body["replicas"]["r0"]["received_seq"]
        assert old > 0
        gauge = s.agent.metrics.last_seq.labels("r0")
        assert gauge._value.get() == old
        r = await s.client.post(f"{s.ep.url}/debug/restart")
        assert r.status_code == 200

        async def cleared() -> bool:
            return counter_total(s.agent.metrics.clears, cause="engine_restart") >= 1

        await until(cleared, 10.0)
        await s.agent.drain(10.0)
        _, body = await s.health()
        rep = body["replicas"]["r0"]
        assert (rep["received_seq"], rep["last_seq"]) == (-1, -1), rep
        assert gauge._value.get() == -1
        # and the new process's batches count from 0
        await s.request()
        await assert_index_matches(s.client, s.ep, s.agent, s.index)
        _, body = await s.health()
        assert 0 <= body["replicas"]["r0"]["received_seq"] < old
        assert gauge._value.get() == body["replicas"]["r0"]["last_seq"]


# ------------------------------------------------------------------------- the detector


def snap(
    t_start: float = 100.0,
    queries: float | None = 0.0,
    hits: float | None = 0.0,
    gen: float | None = 0.0,
    finished: float | None = 0.0,
    running: float = 0.0,
    engines: dict[str, EngineCounters] | None = None,
) -> EngineSnapshot:
    return EngineSnapshot(
        running=running,
        start_time=t_start,
        prompt_tokens=queries,
        generation_tokens=gen,
        prefix_queries=queries,
        prefix_hits=hits,
        finished=finished,
        engines=engines or {},
    )


def feed(det: SilenceDetector, snaps: list[EngineSnapshot], step: float = 0.5) -> list[bool]:
    return [det.observe(x, 16, None, i * step) is not None for i, x in enumerate(snaps)]


def test_detector_counts_computed_tokens_with_a_block_of_slack_per_request() -> None:
    # 10 requests of 16 computed tokens each: not one new block can be proved
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=16.0 * 10 * i, finished=10.0 * i) for i in range(10)]
    assert not any(feed(det, seq))
    # the same tokens in one request each scrape: 9 blocks a scrape
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=160.0 * i, finished=1.0 * i) for i in range(10)]
    got = feed(det, seq)
    assert got.index(True) == 4, got  # end 0.5 s old, base 1.5 s before it
    assert det.problem is not None and "computed" in det.problem


def test_detector_hits_do_not_count_and_no_finished_counter_judges_nothing() -> None:
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=1000.0 * i, hits=1000.0 * i - 8 * i, finished=i) for i in range(12)]
    assert not any(feed(det, seq))
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=1000.0 * i, finished=None) for i in range(12)]
    assert not any(feed(det, seq))
    # without prefix-cache counters, generated tokens alone (never the prompt total)
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=None, hits=None, gen=200.0 * i, finished=i) for i in range(12)]
    assert any(feed(det, seq))
    assert det.problem is not None and det.problem.startswith("the engine generated")


def test_detector_restart_and_counter_reset_start_over() -> None:
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=160.0 * i, finished=1.0 * i) for i in range(6)]
    assert feed(det, seq)[-1]
    # a counter that went backwards (a new process): the silence ends, tracking starts over
    assert det.observe(snap(queries=10.0, finished=0.0), 16, None, 3.0) is None
    det = SilenceDetector("r", 2.0)
    assert feed(det, seq)[-1]
    assert det.observe(snap(t_start=200.0, queries=5000.0), 16, None, 3.0) is None
    # counters that only ever reset between scrapes never prove anything
    det = SilenceDetector("r", 2.0)
    seq = [snap(t_start=100.0 + i, queries=160.0, finished=1.0) for i in range(12)]
    assert not any(feed(det, seq))


def test_detector_a_batch_in_the_window_or_after_the_silence() -> None:
    det = SilenceDetector("r", 2.0)
    seq = [snap(queries=160.0 * i, finished=1.0 * i) for i in range(12)]
    # a batch each second: never silent
    for i, x in enumerate(seq):
        assert det.observe(x, 16, float(int(i * 0.5)), i * 0.5) is None
    det = SilenceDetector("r", 2.0)
    assert feed(det, seq[:6])[-1]
    # still silent without a batch, even with the engine idle; a batch ends it
    assert det.observe(seq[5], 16, None, 3.5) is not None
    assert det.observe(seq[5], 16, 3.6, 4.0) is None
    assert det.episodes == 1


def test_detector_judges_a_data_parallel_ranks_own_core() -> None:
    """The agent passes its core's counters (EngineSnapshot.for_core): a busy other core
    is not evidence against this rank's stream."""
    idle = EngineCounters(0.0, 0.0, 0.0, prefix_queries=0.0, prefix_hits=0.0, finished=0.0)
    det = SilenceDetector("r@dp1", 2.0)
    fired = []
    for i in range(12):
        cores = {
            "0": EngineCounters(
                1.0, None, None, prefix_queries=160.0 * i, prefix_hits=0.0, finished=float(i)
            ),
            "1": idle,
        }
        x = snap(queries=160.0 * i, finished=float(i), engines=cores)
        fired.append(det.observe(x.for_core(1), 16, None, i * 0.5) is not None)
    assert not any(fired)
    # the same scrapes judged on core 0 (the busy one) do fire
    det = SilenceDetector("r", 2.0)
    for i in range(12):
        cores = {
            "0": EngineCounters(
                1.0, None, None, prefix_queries=160.0 * i, prefix_hits=0.0, finished=float(i)
            ),
            "1": idle,
        }
        x = snap(queries=160.0 * i, finished=float(i), engines=cores)
        det.observe(x.for_core(0), 16, None, i * 0.5)
    assert det.problem is not None
