"""Review R-D of 6abe9ba (background dead runs) and 15c977e (embedded agents' index client).

A healthy background run whose first engine step outlasts a few scrapes is not taken for a
dead one: vLLM 0.33 updates ``vllm:num_requests_running`` / ``_waiting`` only from a step's
outputs (v1/core/sched/scheduler.py ``update_from_output``: ``make_stats``), so an engine
that was idle reads 0 and 0 for the whole of the step that first computes the run (a
LoRA adapter's load, a multimodal encoder pass, a long prompt's unchunked prefill; its
multiproc executor allows a step ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``, 300 s)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
from prometheus_client.core import Metric

from cachecore.agent.embedded import build_embedded_agents
from cachecore.engine.core import EngineCore, EngineStats
from cachecore.index.base import DEFAULT_REMOVAL_LOG
from cachecore.index.redis import RedisIndex
from cachecore.replica.metrics import _EngineCollector
from gateway.load import IDLE_SCRAPES, IdleEngine, SharedLoad
from tests.test_gateway_support import stack
from tests.test_h181_background_slots import ONE_SLOT, _body, _slots
from tests.test_h198_background_dead_runs import SCRAPE_S, _outcomes, _status
from tests.test_responses_background import _held, _until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _fast_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_AGENT_SCRAPE_INTERVAL_S", str(SCRAPE_S))


def _idle(ts: int) -> SharedLoad:
    return SharedLoad(running=0, waiting=0, metrics_ts_ms=ts)


def test_an_idle_row_shorter_than_the_bound_is_no_dead_run() -> None:
    idle = IdleEngine(since_ms=0, min_idle_ms=10_000)
    for ts in range(1_000, 1_000 * (IDLE_SCRAPES + 1), 1_000):
        assert not idle.dead(_idle(ts))  # 3 scrapes over 2 s: a step may last longer
    assert not idle.dead(_idle(10_999))
    assert idle.dead(_idle(11_000))  # idle from its first scrape for the whole bound
    idle.dead(SharedLoad(running=1, metrics_ts_ms=12_000))  # the row starts again
    assert not idle.dead(_idle(13_000)) and not idle.dead(_idle(22_999))
    assert idle.dead(_idle(23_000))


async def test_a_run_computing_behind_stale_idle_gauges_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the engine computes the run while its gauges still read the idle step before it
    def stale(core: EngineCore) -> EngineStats:
        return dataclasses.replace(real(core), num_running=0, num_waiting=0)

    real = EngineCore.stats
    monkeypatch.setattr(EngineCore, "stats", stale)
    async with (
        stack(count=1, policy=ONE_SLOT, agents=True, background_poll_s=0.05) as st,
        st.http() as h,
    ):
        seen = _slots(st.gw)
        t0 = time.monotonic()
        r = await h.post("/v1/responses", json=_body(st, 1, 4000, background=True))
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        await _until(lambda: not st.gw._background, 30.0)
        got = _outcomes(st)
        assert got["engine_idle"] == 0, got  # 6abe9ba: ended and cancelled after ~0.3 s
        assert got["completed"] + got["incomplete"] == 1, got
        assert time.monotonic() - t0 > 20 * SCRAPE_S  # the run outlasted many idle scrapes
        assert _held(st.gw) == 0 and seen["admit"] == seen["release"] == 1, seen
        assert await _status(h, r.json()["id"]) in ("completed", "incomplete")


@dataclasses.dataclass
class _Spec:
    id: str
    url: str
    events: str
    replay: str


async def test_embedded_agents_on_redis_keep_their_removal_log_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # KVGATE_AGENT_REMOVAL_LOG reached the embedded agents on an in-process index
    # (Gateway._embedded_index) and a standalone agent, but on a Redis index their writes
    # went through the gateway's RedisIndex and then its sibling, both at the default
    monkeypatch.setenv("KVGATE_AGENT_REMOVAL_LOG", "100")
    primary = RedisIndex.from_url("redis://127.0.0.1:1/0")  # connects at a first command
    spec = _Spec("r1", "http://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3")
    group = build_embedded_agents([spec], primary)
    try:
        assert isinstance(group.write_index, RedisIndex)
        assert [a.index for a in group.agents] == [group.write_index]
        assert group.write_index.removal_log == 100  # 15c977e: 16384, the primary's
        assert primary.removal_log == DEFAULT_REMOVAL_LOG  # the gateway's own, unchanged
    finally:
        await group.stop()
        await primary.close()


async def test_an_engine_without_request_gauges_is_never_judged_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM 0.33 with --disable-log-stats creates no stat logger (v1/engine/async_llm.py:
    # log_stats false), so its /metrics has no vllm:num_requests_* at all: the agent read
    # 0 and 0 it never measured and published them, and the watch took the run for dead
    real = _EngineCollector.collect

    def no_gauges(self: _EngineCollector) -> Iterator[Metric]:
        return (m for m in real(self) if not m.name.startswith("vllm:num_requests_"))

    monkeypatch.setattr(_EngineCollector, "collect", no_gauges)
    async with (
        stack(count=1, policy=ONE_SLOT, agents=True, background_poll_s=0.05,
              background_idle_s=0) as st,
        st.http() as h,
    ):  # fmt: skip
        r = await h.post("/v1/responses", json=_body(st, 2, 4000, background=True))
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        await _until(lambda: not st.gw._background, 30.0)
        got = _outcomes(st)
        assert got["engine_idle"] == 0, got  # 6abe9ba: ended and cancelled at once
        assert got["completed"] + got["incomplete"] == 1, got
