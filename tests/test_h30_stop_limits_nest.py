"""The shutdown's time limits nest: an outer limit is never shorter than what it wraps.

An embedded agent's stop may take up to its own ``Agent.stop_limit_s`` (~52 s with one
rank), but ``EmbeddedAgents.stop`` gave each agent a fixed 15 s and ``Gateway.stop`` its
embedded-agents step 10 s (``STOP_STEP_S``): a stop still within its own limit was given up
on ("a clean-up survived its cancellations"), the ZMQ context destroyed under it, the step
logged as failed, and the stop ran on in the background after ``Gateway.stop`` returned.
Now each outer bound derives from the inner one (``cachecore.tasks.enclosing_limit_s``).

Real pieces: a gateway with one embedded agent (the gateway's ``agent_hook``,
``start_embedded_agents``) on tests/test_agent_helpers' engine stub and event source on
loopback. The limits are patched down so the test takes seconds, each kept in the
proportion that matters (the slow step longer than the old outer bounds, within the
agent's own). The slow step is a fake named as such: ``SlowStep`` replaces the agent's
scraper close (one of ``Agent.stop``'s steps) with one that takes a while, then closes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from cachecore import tasks as tasks_module
from cachecore.agent import Agent, build_embedded_agents, start_embedded_agents
from cachecore.agent import agent as agent_module
from cachecore.agent import embedded as embedded_module
from cachecore.agent.cli import _shutdown_steps
from cachecore.index.base import PrefixIndex
from cachecore.index.memory import MemoryIndex
from cachecore.loadstate import LoadStore
from cachecore.tasks import RUN_TO_END_CANCELS
from gateway import core as gateway_core
from gateway.replicas import ReplicaSpec
from gateway.serve import build_gateway
from gateway.settings import GatewaySettings
from tests.test_agent_helpers import Rig
from tests.test_h29_cancelled_cleanup import SlowStep
from tests.test_h29_embedded_agents_cleanup import OVERRIDES, Spec
from tests.test_h29_embedded_agents_cleanup import rig as rig  # a fixture

pytestmark = pytest.mark.timeout(60)

SLOW_S = 1.6
"""The agent's slow step: past the old outer bounds as patched here (the gateway's step
0.3 s, the group's 0.3 s per agent and one 1 s grace: 1.3 s), within the agent's own
(2 s a step)."""


def agent_tasks() -> list[asyncio.Task[object]]:
    """Running tasks of the agents and of their stops (``agent-r0``, ``agent r0 stop``,
    ``embedded agents stop``)."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done() and ("agent" in t.get_name() and t is not asyncio.current_task())
    ]


@pytest.fixture
async def made(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[Agent]]:
    """Every agent started while the test runs (``Agent.start`` wrapped to record it); a
    stop a regression left running is waited for at the end (bounded), so that it does
    not outlive the test's event loop."""
    agents: list[Agent] = []
    real = Agent.start

    async def start(agent: Agent) -> None:
        agents.append(agent)
        await real(agent)

    monkeypatch.setattr(Agent, "start", start)
    yield agents
    left = agent_tasks()
    if left:
        await asyncio.wait(left, timeout=5.0)


async def test_an_agent_stop_longer_than_the_old_outer_bounds_runs_to_its_end(
    rig: Rig,
    made: list[Agent],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(gateway_core, "STOP_STEP_S", 0.3)  # the gateway's per-step bound
    monkeypatch.setattr(embedded_module, "AGENT_STOP_S", 0.3, raising=False)  # the old fixed one
    monkeypatch.setattr(agent_module, "STOP_STEP_S", 2.0)  # the agent's own per-step bound
    # one grace past a bound, not three: the old code gives up within the test's time
    monkeypatch.setattr(tasks_module, "RUN_TO_END_CANCELS", 1)
    caplog.set_level(logging.WARNING)
    spec = Spec("r0", rig.stub.url, rig.events_ep, rig.replay_ep)
    settings = GatewaySettings(
        replicas=[f"r0={spec.url}={spec.events},{spec.replay}"],
        salt_secrets=[SecretStr("s" * 32)],
        open_access=True,
    )

    async def hook(
        specs: Sequence[ReplicaSpec],
        index: PrefixIndex,
        load_store: LoadStore | None,
        registry: CollectorRegistry,
    ) -> Callable[[], Awaitable[None]]:
        return await start_embedded_agents(specs, index, load_store, registry, **OVERRIDES)

    gw = build_gateway(settings, agent_hook=hook)
    await gw.start()
    try:
        assert [a.primary_id for a in made] == ["r0"]
        agent = made[0]
        await agent.wait_ready(10.0)
        assert agent.stream is not None and agent.stream._sock is not None
        sub = agent.stream._sock
        slow = SlowStep(agent.scraper.close, delay_s=SLOW_S)
        monkeypatch.setattr(agent.scraper, "close", slow)
        t0 = time.monotonic()
        try:
            await gw.stop()
        except Exception as exc:  # the embedded-agents step's TimeoutError, before
            problems = [f"Gateway.stop raised {exc!r}"]
        else:
            problems = []
        took = time.monotonic() - t0
    finally:
        if not gw.draining:
            await gw.stop()
    problems += [f"still running after Gateway.stop: {t.get_name()}" for t in agent_tasks()]
    if not slow.finished:
        problems.append("the agent's stop was cut short")
    if not sub.closed:
        problems.append("the agent's SUB socket is open")
    if not agent.ctx.closed:
        problems.append("the agents' ZMQ context is not destroyed")
    for r in caplog.records:
        msg = r.getMessage()
        if "survived its cancellations" in msg or "did not end in time" in msg:
            problems.append(f"logged: {msg} ({getattr(r, 'what', '')})")
        if msg == "gateway stop: a step failed":
            problems.append(f"logged: {msg} ({getattr(r, 'step', '')})")
    assert problems == [], "\n".join(problems)
    assert SLOW_S <= took < SLOW_S + 8.0  # ran to its end, and did not hang


async def test_each_outer_bound_covers_what_it_wraps_at_the_defaults() -> None:
    """At the shipped limits: the embedded group's bound covers each agent's stop with its
    grace (run_to_end holds its caller up to its limit and a grace per cancellation), the
    gateway's embedded-agents step covers the group's, and the agent CLI's shutdown step
    covers the agent's; the group's does not grow with the number of agents."""
    grace_s = 1.0  # run_to_end's default, the one every stop here runs under
    index = MemoryIndex()
    groups = [build_embedded_agents(specs_of(n), index, None, None, **OVERRIDES) for n in (1, 3)]
    try:
        for group in groups:
            for agent in group.agents:
                held_s = agent.stop_limit_s + RUN_TO_END_CANCELS * grace_s
                assert group.stop_limit_s > held_s
        assert groups[0].stop_limit_s == groups[1].stop_limit_s  # they stop together
        stop = embedded_module.EmbeddedAgentsStop(groups[0], None, None)
        gw = build_gateway(
            GatewaySettings(salt_secrets=[SecretStr("s" * 32)], open_access=True),
        )
        gw._agents_stop = stop
        bound_s = gw._agents_stop_bound_s()
        assert bound_s > stop.stop_limit_s + RUN_TO_END_CANCELS * grace_s
        assert bound_s > gateway_core.STOP_STEP_S  # the step it was held to before
        agent = groups[0].agents[0]
        shutdown = _shutdown_steps(None, agent, True, None, (None, None, None))
        steps = {name: b for name, _, b in shutdown}
        assert (steps["agent"] or 0.0) > agent.stop_limit_s + RUN_TO_END_CANCELS * grace_s
    finally:
        for group in groups:
            for agent in group.agents:
                await agent.scraper.close()
            group.ctx.destroy(linger=0)


def specs_of(n: int) -> list[Spec]:
    """``n`` replicas with event endpoints (never started: only their limits are read)."""
    return [Spec(f"r{i}", "http://127.0.0.1:9", "tcp://127.0.0.1:9", None) for i in range(n)]
