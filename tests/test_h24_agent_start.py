"""The agent's start-up (wait for the engine, read its info, load the index's state,
subscribe, spawn the loops) under the background loops' supervision rule: an unexpected
error in it is logged with its traceback, counted in
``kvgate_agent_loop_restarts_total{replica, loop="start"}``, the failed attempt is undone
(its subscription, its loops, its syncs) and start-up is retried after a pause; /health
says ``starting`` with the last error and the failed attempts meanwhile.

Before, such an error was logged once ("agent supervisor failed") and the agent stayed
``starting`` (503) for the life of the process, indexing nothing.

Each test runs a real agent (event source and engine stub on loopback, memory index) and
injects the fault with fakes named as such (tests/test_h24_agent_loops.py's FaultInjector,
and SpawnFault below for the one synchronous step)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from cachecore.agent import Agent
from cachecore.agent.agent import LOOP_FAILING_AFTER, LoopRun
from cachecore.agent.http import AgentHTTPServer
from cachecore.index.memory import MemoryIndex
from tests.test_agent_helpers import BS, Rig, counter_total, until
from tests.test_h24_agent_loops import FaultInjector


class SpawnFault:
    """A fake for fault injection: wraps the agent's ``_spawn``; the first ``times`` spawns
    of the loop ``name`` raise RuntimeError("injected fault") instead (the loops spawned
    before it in the same attempt are running by then, the stream is subscribed)."""

    def __init__(self, spawn: Callable[..., None], name: str, times: int) -> None:
        self.spawn = spawn
        self.name = name
        self.left = times

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> None:
        if name == self.name and self.left > 0:
            self.left -= 1
            raise RuntimeError("injected fault")
        self.spawn(name, *args, **kwargs)


@pytest.fixture
def agent_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="cachecore.agent.agent")
    return caplog


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex())
    await r.stub.start()
    yield r
    await r.close()


def _agent(rig: Rig) -> Agent:
    """An agent of the rig, not started (the fault goes in first); the rig stops it."""
    agent = rig.agent = Agent(rig.settings(), rig.index)
    return agent


def _start_failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.getMessage() == "agent loop failed; restarting it"
        and getattr(r, "loop", "") == "start"
    ]


def _live_tasks(suffix: str) -> int:
    """Running tasks named ``suffix`` (the agent's loops: agent-r0-<loop>, its syncs:
    agent-sync-r0)."""
    return sum(1 for t in asyncio.all_tasks() if t.get_name() == suffix and not t.done())


def _open_sockets(agent: Agent) -> int:
    """The ZMQ sockets open in the agent's own context (pyzmq drops a socket from it on
    close): a started agent holds its SUB socket and that socket's monitor."""
    return len(agent.ctx._sockets)


async def _ready_once(rig: Rig, agent: Agent) -> None:
    await agent.wait_ready(15.0)
    await rig.wait_connected()
    # one of each: the failed attempts' loops, syncs and sockets are gone
    for loop in ("scrape", "check", "stream"):
        assert _live_tasks(f"agent-r0-{loop}") == 1, loop
    assert _live_tasks("agent-sync-r0") == 1
    assert len(agent._tasks) == 3 and set(agent.syncs) == {0}
    assert _open_sockets(agent) == 2


async def _indexes(rig: Rig) -> None:
    """The ready agent indexes what the engine published before it started (replayed)
    and what it publishes live."""
    ev, _ = rig.engine.store(list(range(2 * BS)), tenant="b")
    await rig.publish(ev)
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys()
    assert len(rig.engine.keys()) == 5


def _assert_counted(agent: Agent, caplog: pytest.LogCaptureFixture, n: int) -> None:
    assert counter_total(agent.metrics.loop_restarts, replica="r0", loop="start") == n
    recs = _start_failures(caplog)
    assert len(recs) == n, [r.getMessage() for r in caplog.records]
    for r in recs:
        assert r.levelno == logging.ERROR and getattr(r, "replica", None) == "r0"
        assert r.exc_info is not None and isinstance(r.exc_info[1], RuntimeError)
    start = agent.health()["loops"]["start"]
    assert start["restarts"] == n and "injected fault" in start["last_error"]
    assert start["failures_in_row"] == 0 and not start["failing"]
    assert agent.health()["status"] == "ok"


async def test_a_start_up_that_fails_before_the_subscribe_is_retried(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """The index's instance id read fails twice (after the primary sync was made, loaded
    and started, before the subscribe): each attempt's sync is stopped before the next,
    and the third attempt is ready and indexes."""
    ev, _ = rig.engine.store(list(range(3 * BS)))
    await rig.publish(ev)  # before the agent: it comes by replay
    agent = _agent(rig)
    fault = FaultInjector(agent._instance, times=2)
    agent._instance = fault  # type: ignore[method-assign]
    await agent.start()
    await _ready_once(rig, agent)
    assert fault.raised == 2
    _assert_counted(agent, agent_log, 2)
    await _indexes(rig)


async def test_a_start_up_that_fails_after_the_subscribe_is_retried(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """The stream loop's spawn fails twice: the stream is subscribed and the scrape and
    check loops run by then. A retry must neither leak the socket nor run two scrapers."""
    ev, _ = rig.engine.store(list(range(3 * BS)))
    await rig.publish(ev)
    agent = _agent(rig)
    fault = SpawnFault(agent._spawn, "stream", times=2)
    agent._spawn = fault  # type: ignore[method-assign]
    await agent.start()
    await _ready_once(rig, agent)
    assert fault.left == 0
    _assert_counted(agent, agent_log, 2)
    await _indexes(rig)
    # one scraper: about one scrape per interval (0.1 s), not two
    before, t0 = rig.stub.scrapes, time.monotonic()
    await asyncio.sleep(1.0)
    per_s = (rig.stub.scrapes - before) / (time.monotonic() - t0)
    assert 2 <= per_s <= 14, per_s


async def test_health_says_starting_with_the_error_while_start_up_retries(
    rig: Rig, agent_log: pytest.LogCaptureFixture
) -> None:
    """While start-up keeps failing, GET /health answers 503 ``starting`` with the failed
    attempts and the last error; once it succeeds, ok (failures in a row at start-up do not
    leave the agent degraded)."""
    ev, _ = rig.engine.store(list(range(3 * BS)))
    await rig.publish(ev)
    agent = _agent(rig)
    fault = FaultInjector(agent._instance, times=-1)
    agent._instance = fault  # type: ignore[method-assign]
    http = AgentHTTPServer([agent], "127.0.0.1", 0)
    await http.start()
    try:
        await agent.start()

        def start_run() -> LoopRun | None:
            return agent.loops.get("start")

        await until(
            lambda: (run := start_run()) is not None and run.restarts >= LOOP_FAILING_AFTER,
            10.0,
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http.port}") as client:
            r = await client.get("/health")
            assert r.status_code == 503
            body = r.json()
            assert body["status"] == "starting"
            start = body["loops"]["start"]
            assert start["restarts"] >= LOOP_FAILING_AFTER
            assert start["last_error"] == "RuntimeError('injected fault')"
            # a failed attempt's loops are not reported as if they ran
            assert set(body["loops"]) == {"start"}
            pauses = [getattr(r, "pause_s", None) for r in _start_failures(agent_log)]
            assert pauses[:3] == [0.5, 1.0, 2.0]
            fault.stop()
            await _ready_once(rig, agent)
            r = await client.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        await http.stop()
    await _indexes(rig)


async def test_stop_ends_a_start_up_in_its_back_off_at_once(rig: Rig) -> None:
    """CancelledError is no failure to retry: stop() ends an agent waiting out a 2 s
    start-up pause at once, and closes what the attempts opened."""
    agent = _agent(rig)
    spawn = SpawnFault(agent._spawn, "stream", times=10**6)
    agent._spawn = spawn  # type: ignore[method-assign]
    await agent.start()
    await until(
        lambda: "start" in agent.loops and agent.loops["start"].restarts >= LOOP_FAILING_AFTER,
        10.0,
    )
    ctx = agent.ctx
    t0 = time.monotonic()
    await rig.stop_agent()
    assert time.monotonic() - t0 < 1.5
    assert ctx.closed
    assert _live_tasks("agent-r0") == 0 and _live_tasks("agent-r0-scrape") == 0
