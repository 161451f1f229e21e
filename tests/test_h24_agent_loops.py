"""The agent's background loops (scrape, check, heartbeat, stream) under one supervision
rule: an unexpected error is logged with its traceback, counted in
``kvgate_agent_loop_restarts_total{replica, loop}``, and the loop restarts after a pause
(0.5 s, doubling while it fails without progress, at most 5 s); /health calls a loop that
keeps failing ``degraded``.

Each test runs a real agent (event source, engine stub over HTTP, memory index) and injects
the fault with a fake named as such: a wrapper around one of the agent's calls that raises
RuntimeError a given number of times, then passes through. Before the supervision, such an
error ended the scrape, check and heartbeat loops silently for the life of the process."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from cachecore.agent import Agent
from cachecore.agent.sync import CheckIndex
from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.loadstate import MemoryLoadStore
from cachecore.registry import MemoryRegistry
from tests.test_agent_helpers import BS, Rig, counter_total, until


class FaultInjector:
    """A fake for fault injection: wraps one async call of the agent; the next ``times``
    calls that ``match`` raise RuntimeError("injected fault"), later ones pass through.
    ``times`` < 0 fails until ``stop()``. ``spent`` is set once no fault is left to give."""

    def __init__(
        self,
        call: Callable[..., Awaitable[Any]],
        times: int,
        match: Callable[..., bool] = lambda *a, **k: True,
    ) -> None:
        self.call = call
        self.left = times
        self.match = match
        self.raised = 0
        self.spent = asyncio.Event()

    def stop(self) -> None:
        self.left = 0
        self.spent.set()

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.left != 0 and self.match(*args, **kwargs):
            self.left -= 1
            self.raised += 1
            if self.left == 0:
                self.spent.set()
            raise RuntimeError("injected fault")
        return await self.call(*args, **kwargs)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _restarts(agent: Agent, loop: str) -> float:
    return counter_total(agent.metrics.loop_restarts, replica="r0", loop=loop)


def _failures(caplog: pytest.LogCaptureFixture, loop: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "agent loop failed; restarting it" and getattr(r, "loop", "") == loop
    ]


def _assert_logged(caplog: pytest.LogCaptureFixture, loop: str, n: int) -> None:
    recs = _failures(caplog, loop)
    assert len(recs) == n, [r.getMessage() for r in caplog.records]
    for r in recs:
        assert r.levelno == logging.ERROR and getattr(r, "replica", None) == "r0"
        assert r.exc_info is not None and isinstance(r.exc_info[1], RuntimeError)


@pytest.fixture
def agent_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="cachecore.agent.agent")
    return caplog


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex())
    yield r
    await r.close()


async def test_the_scrape_loop_survives_an_unexpected_error(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """A RuntimeError out of the scraper (not a ScrapeError) ended the scrape loop: the
    load record was never published again (gateways stopped seeing the queue)."""
    load = MemoryLoadStore()
    agent = await rig.start(load_store=load)
    fault = FaultInjector(agent.scraper.metrics, times=2)
    agent.scraper.metrics = fault  # type: ignore[method-assign]
    async with asyncio.timeout(5.0):
        await fault.spent.wait()
    rig.stub.waiting = 7  # only a scrape after the faults can publish this

    async def published() -> bool:
        rec = (await load.snapshot(["r0"], _now_ms()))["r0"]
        return rec.has_engine and rec.num_waiting == 7

    await until(published, 8.0)
    assert _restarts(agent, "scrape") == 2
    _assert_logged(agent_log, "scrape", 2)
    loops = agent.health()["loops"]
    assert loops["scrape"]["restarts"] == 2 and loops["scrape"]["failures_in_row"] == 0
    assert "injected fault" in loops["scrape"]["last_error"]
    assert agent.health()["status"] == "ok"


async def test_the_heartbeat_loop_survives_an_unexpected_error(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """An error escaping the heartbeat ended the loop: the registration expired and the
    replica left every gateway's pool while the agent's /health said ok."""
    registry = MemoryRegistry()
    agent = await rig.start(registry=registry)
    link = agent.registry_link
    assert link is not None
    fault = FaultInjector(link.heartbeat, times=2)
    link.heartbeat = fault  # type: ignore[method-assign]
    async with asyncio.timeout(5.0):
        await fault.spent.wait()
    after = _now_ms()
    ok_before = counter_total(agent.metrics.heartbeats, outcome="ok")

    async def renewed() -> bool:
        regs = await registry.discover(_now_ms(), ["r0"])
        return bool(regs) and regs[0].registered_ms >= after

    await until(renewed, 8.0)
    assert counter_total(agent.metrics.heartbeats, outcome="ok") > ok_before
    assert _restarts(agent, "heartbeat") == 2
    _assert_logged(agent_log, "heartbeat", 2)


async def test_the_check_loop_survives_an_unexpected_error(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """An error out of the check loop (here the sync's put of a CheckIndex) ended it: an
    index that lost the replica's state was never rewritten from the mirror."""
    agent = await rig.start()
    ev, _ = rig.engine.store(list(range(3 * BS)))
    await rig.publish(ev)
    await rig.settle()
    keys = await rig.index_keys()
    assert len(keys) == 3
    sync = agent.syncs[0]
    fault = FaultInjector(sync.put, times=2, match=lambda cmd: isinstance(cmd, CheckIndex))
    sync.put = fault  # type: ignore[method-assign]
    async with asyncio.timeout(5.0):
        await fault.spent.wait()
    # the index loses the replica (another writer's clear bumps its epoch): only a check
    # after the faults can notice and rewrite it
    await rig.index.clear_replica("r0", ReplicaState.LIVE, _now_ms())
    assert await rig.index_keys() == set()

    async def rewritten() -> bool:
        return await rig.index_keys() == keys

    await until(rewritten, 8.0)
    assert counter_total(agent.metrics.resyncs) >= 1
    assert _restarts(agent, "check") == 2
    _assert_logged(agent_log, "check", 2)


async def test_the_stream_restarts_under_the_same_rule(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """The stream had its own restart loop (logged, not counted); it now restarts under the
    same rule as the others: counted, and the restarted stream replays what it missed."""
    agent = await rig.start()
    stream = agent.stream
    assert stream is not None
    fault = FaultInjector(stream._on_live, times=1)
    stream._on_live = fault  # type: ignore[method-assign]
    ev, _ = rig.engine.store(list(range(2 * BS)))
    await rig.publish(ev)
    async with asyncio.timeout(5.0):
        await fault.spent.wait()
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys()
    assert _restarts(agent, "stream") == 1
    _assert_logged(agent_log, "stream", 1)
    # the replayed batch was progress: the failure is not "in a row" any more
    assert agent.health()["loops"]["stream"]["failures_in_row"] == 0


async def test_a_loop_that_keeps_failing_degrades_health_until_it_recovers(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """Restarts back off (0.5, 1, 2 s ...) while a loop fails without progress; after
    LOOP_FAILING_AFTER such failures /health says degraded and names the loop; one
    completed iteration makes it ok again."""
    from cachecore.agent.agent import LOOP_FAILING_AFTER

    agent = await rig.start()
    assert agent.health()["status"] == "ok"
    fault = FaultInjector(agent.scraper.metrics, times=-1)
    agent.scraper.metrics = fault  # type: ignore[method-assign]
    await until(lambda: agent.health()["status"] == "degraded", 10.0)
    scrape = agent.health()["loops"]["scrape"]
    assert scrape["failing"] and scrape["failures_in_row"] >= LOOP_FAILING_AFTER
    pauses = [getattr(r, "pause_s", None) for r in _failures(agent_log, "scrape")]
    assert pauses[:3] == [0.5, 1.0, 2.0]
    fault.stop()
    await until(lambda: agent.health()["status"] == "ok", 10.0)
    assert not agent.health()["loops"]["scrape"]["failing"]


async def test_a_loop_in_its_restart_pause_stops_at_once(rig: Rig) -> None:
    """CancelledError is not an error to restart from: stop() ends a loop waiting out its
    pause (here 2 s or more) at once."""
    agent = await rig.start()
    fault = FaultInjector(agent.scraper.metrics, times=-1)
    agent.scraper.metrics = fault  # type: ignore[method-assign]
    await until(lambda: agent.loops["scrape"].failing, 10.0)
    t0 = time.monotonic()
    await rig.stop_agent()
    assert time.monotonic() - t0 < 1.5
