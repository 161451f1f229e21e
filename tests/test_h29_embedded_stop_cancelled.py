"""The embedded agents' stop, cancelled part way (review of bea3d38).

``EmbeddedAgents.stop`` awaited each agent's stop in turn, then destroyed the shared ZMQ
context: a cancellation arriving while one agent stopped (a gateway stop cancelled, a
start-up cancelled again while it cleaned up) ended it there, that agent half stopped,
the agents after it running (their tasks, their SUB sockets) and the context alive. Now
each agent's stop runs to its end where the cancellation does not reach it, the others
stop, the context is destroyed, and then the stop ends cancelled.

Real pieces and helpers from tests/test_h29_embedded_agents_cleanup (an agent on an engine
stub and an event source on loopback, the leak check, ``StartFault`` as ``Agent.start``).
The slow step is a fake named as such: ``SlowStep`` (tests/test_h29_cancelled_cleanup.py)
replaces r0's scraper close (one of ``Agent.stop``'s awaits) with one that takes a while,
then closes."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from cachecore.agent import Agent, start_embedded_agents
from tests.test_agent_helpers import Rig
from tests.test_h29_cancelled_cleanup import SlowStep
from tests.test_h29_embedded_agents_cleanup import (
    OVERRIDES,
    StartFault,
    agent_families,
    agent_tasks,
    assert_nothing_left,
    made,  # noqa: F401 (a fixture)
    rig,  # noqa: F401 (a fixture)
    specs,
)

pytestmark = pytest.mark.timeout(60)


def slow_close(agent: Agent, monkeypatch: pytest.MonkeyPatch) -> SlowStep:
    slow = SlowStep(agent.scraper.close)
    monkeypatch.setattr(agent.scraper, "close", slow)
    return slow


async def test_a_cancelled_stop_stops_every_agent_destroys_the_context_and_stays_cancelled(
    rig: Rig,  # noqa: F811
    made: list[Agent],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fault = StartFault("none", None)  # records the agents; every one starts for real
    monkeypatch.setattr(Agent, "start", fault.method())
    registry = CollectorRegistry(auto_describe=True)
    try:
        stop = await start_embedded_agents(specs(rig), rig.index, None, registry, **OVERRIDES)
    finally:
        made.extend(fault.agents)
    r0 = fault.agents[0]
    await r0.wait_ready(10.0)
    assert r0.stream is not None and r0.stream._sock is not None
    sub = r0.stream._sock
    assert agent_families(registry) and any(
        t.get_name().startswith("agent-r1") for t in agent_tasks()
    )
    slow = slow_close(r0, monkeypatch)
    stopping = asyncio.ensure_future(stop())
    async with asyncio.timeout(10.0):
        await slow.entered.wait()  # r0's stop is in its scraper close; r1 not stopped yet
    stopping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert stopping.cancelled()
    problems = [f"agent task still running: {t.get_name()}" for t in agent_tasks()]
    if not sub.closed:
        problems.append("r0's SUB socket is open")
    if not slow.finished:
        problems.append("r0's stop was cut short")
    if not r0.ctx.closed:
        problems.append("the agents' ZMQ context is not destroyed")
    if fams := agent_families(registry):
        problems.append(f"the agents' collector is still registered: {fams[:3]}")
    assert problems == [], "left by the cancelled stop:\n" + "\n".join(problems)


async def test_a_cancelled_start_cancelled_again_while_it_cleans_up_releases_everything(
    rig: Rig,  # noqa: F811
    made: list[Agent],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start is cancelled while r1 starts (r0 ready), then again while its clean-up
    stops r0: r0's stop runs to its end, r1 stops, the context is destroyed, the collector
    unregistered, and the start ends cancelled."""
    fault = StartFault("r1", None)
    monkeypatch.setattr(Agent, "start", fault.method())
    registry = CollectorRegistry(auto_describe=True)
    start = asyncio.ensure_future(
        start_embedded_agents(specs(rig), rig.index, None, registry, **OVERRIDES)
    )
    try:
        async with asyncio.timeout(15.0):
            await fault.reached.wait()  # r0 ready, its stream subscribed; r1 starting
        slow = slow_close(fault.agents[0], monkeypatch)
        start.cancel()
        async with asyncio.timeout(10.0):
            await slow.entered.wait()
        start.cancel()  # the second cancellation, while r0 stops
        with pytest.raises(asyncio.CancelledError):
            await start
        assert start.cancelled()
    finally:
        made.extend(fault.agents)
        start.cancel()
    monkeypatch.setattr(Agent, "start", fault.real)
    await assert_nothing_left(fault, fault.subs[0], registry, rig)
    assert slow.finished
