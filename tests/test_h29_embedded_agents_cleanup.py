"""Two leaks left by a start or a stop that did not finish its job.

``start_embedded_agents`` makes a ZMQ context, registers the agents' metrics collector in
the gateway's registry and starts one agent per replica spec. When a start raised part way
(or the call was cancelled) after some agents started, the caller got no stop function:
those agents ran on (their tasks, their SUB sockets), the collector stayed registered (the
next start in that registry raised "Duplicated timeseries") and the context was never
destroyed. Now a failed or cancelled start stops what it made and raises the original.

``Gateway.stop`` cancelled its one-shot background tasks (replica and claim checks,
quarantine watchers) without waiting for them: a cancelled task runs on to its next
``await`` and through its clean-up, so it could still touch the index and the stores that
stop closed next. Now stop waits for them (bounded: a task that ignores its cancellation
is logged and left).

Real pieces: an agent on an engine stub and an event source on loopback (tests/
test_agent_helpers' Rig), a memory index, a gateway started without Redis. Faults injected
by fakes named as such: ``StartFault`` replaces ``Agent.start`` (which only creates the
agent's supervisor task: nothing makes it raise or wait naturally), and the background
tasks are coroutines handed to the gateway's public ``spawn``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from cachecore.agent import Agent, start_embedded_agents
from cachecore.index.memory import MemoryIndex
from cachecore.testing import free_ports
from gateway.core import Gateway
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text
from tests.test_agent_helpers import Rig

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Spec:
    id: str
    url: str
    events: str | None
    replay: str | None


class StartFault:
    """A fake for fault injection, installed as ``Agent.start``: every agent but the one of
    replica ``fails`` starts for real; that one first waits until the agents started before
    it are ready (their streams subscribed, their loops running), then raises ``error``, or
    with ``error`` None sets ``reached`` and waits until cancelled."""

    def __init__(self, fails: str, error: BaseException | None) -> None:
        self.fails = fails
        self.error = error
        self.real = Agent.start
        self.agents: list[Agent] = []  # every agent whose start was called, in order
        self.subs: list[zmq.asyncio.Socket] = []  # their SUB sockets when it failed
        self.reached = asyncio.Event()

    def method(self) -> Callable[[Agent], Awaitable[None]]:
        """What to install as ``Agent.start`` (a function, so that it binds)."""

        async def start(agent: Agent) -> None:
            await self.start(agent)

        return start

    async def start(self, agent: Agent) -> None:
        self.agents.append(agent)
        if agent.primary_id != self.fails:
            await self.real(agent)
            return
        for other in self.agents[:-1]:
            await other.wait_ready(10.0)
            assert other.stream is not None and other.stream._sock is not None
            self.subs.append(other.stream._sock)
        if self.error is not None:
            raise self.error
        self.reached.set()
        await asyncio.Event().wait()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex())
    await r.stub.start()
    yield r
    await r.close()


@pytest.fixture
async def made() -> AsyncIterator[list[Agent]]:
    """The agents a test's start made: stopped at its end when the code under test left
    them running (their tasks would outlive the test's event loop)."""
    agents: list[Agent] = []
    yield agents
    for agent in agents:
        if agent._supervisor is not None or agent._tasks:
            with contextlib.suppress(Exception):
                await agent.stop()
        if not agent.ctx.closed:
            agent.ctx.destroy(linger=0)


def specs(rig: Rig) -> list[Spec]:
    """r0 on the rig's engine stub and event source (it starts for real), r1 beside it."""
    pub, rep = free_ports(2)
    return [
        Spec("r0", rig.stub.url, rig.events_ep, rig.replay_ep),
        Spec("r1", rig.stub.url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"),
    ]


def agent_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("agent-") and not t.done()]


def agent_families(registry: CollectorRegistry) -> list[str]:
    return sorted({m.name for m in registry.collect() if m.name.startswith("kvgate_agent")})


async def assert_nothing_left(
    fault: StartFault, sub: zmq.asyncio.Socket, registry: CollectorRegistry, rig: Rig
) -> None:
    """No agent task, the first agent's SUB socket and the shared context closed, no
    collector in the registry; a second start in the same registry (the agents of a
    gateway started again) registers and stops cleanly."""
    assert [a.primary_id for a in fault.agents] == ["r0", "r1"]
    ctx = fault.agents[0].ctx
    problems = [f"agent task still running: {t.get_name()}" for t in agent_tasks()]
    if not sub.closed:
        problems.append("r0's SUB socket is open")
    if not ctx.closed:
        problems.append("the agents' ZMQ context is not destroyed")
    if fams := agent_families(registry):
        problems.append(f"the agents' collector is still registered: {fams[:3]}")
    assert problems == [], "left by the failed start:\n" + "\n".join(problems)
    again = await start_embedded_agents(specs(rig)[:1], rig.index, None, registry)
    try:
        assert agent_families(registry)
    finally:
        await again()
    assert agent_families(registry) == [] and agent_tasks() == []


STOP_BOUND_S = 3.0  # stop's wait for its background tasks (2 s) and a margin
OVERRIDES = {"scrape_interval_s": 0.1, "replay_timeout_s": 0.5}


async def test_an_agent_start_that_raises_stops_the_agents_started_before_it(
    rig: Rig, made: list[Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    boom = RuntimeError("injected fault: agent r1 did not start")
    fault = StartFault("r1", boom)
    monkeypatch.setattr(Agent, "start", fault.method())
    registry = CollectorRegistry(auto_describe=True)  # as the gateway's /metrics
    try:
        with pytest.raises(RuntimeError) as exc:
            await start_embedded_agents(specs(rig), rig.index, None, registry, **OVERRIDES)
    finally:
        made.extend(fault.agents)
    assert exc.value is boom  # the original, not one from the clean-up
    monkeypatch.setattr(Agent, "start", fault.real)
    await assert_nothing_left(fault, fault.subs[0], registry, rig)


async def test_a_cancelled_start_stops_the_agents_started_and_stays_cancelled(
    rig: Rig, made: list[Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    fault = StartFault("r1", None)
    monkeypatch.setattr(Agent, "start", fault.method())
    registry = CollectorRegistry(auto_describe=True)
    start = asyncio.ensure_future(
        start_embedded_agents(specs(rig), rig.index, None, registry, **OVERRIDES)
    )
    try:
        async with asyncio.timeout(15.0):
            await fault.reached.wait()  # r0 ready, its stream subscribed; r1 starting
        assert agent_tasks() and agent_families(registry)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert start.cancelled()
    finally:
        made.extend(fault.agents)
        start.cancel()
    monkeypatch.setattr(Agent, "start", fault.real)
    await assert_nothing_left(fault, fault.subs[0], registry, rig)


# ------------------------------------------------------------------ Gateway.stop


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    gw = Gateway(
        GatewaySettings(salt_secrets=[SecretStr("s" * 32)], open_access=True),
        parse_policy_text(""),
    )
    await gw.start()
    yield gw
    await gw.stop()


async def test_stop_waits_for_a_cancelled_background_task_before_closing_the_client(
    gateway: Gateway,
) -> None:
    """A check whose clean-up awaits (as a claim check's Redis write does) has ended when
    stop returns, and ran its clean-up before the client closed."""
    saw: list[str] = []

    async def check() -> None:
        try:
            await asyncio.Event().wait()  # a replica that never answers
        finally:
            await asyncio.sleep(0.2)
            client = gateway.client
            saw.append("client open" if client is not None and not client.is_closed else "closed")

    task = gateway.spawn(check())
    await asyncio.sleep(0.05)
    await gateway.stop()
    assert task.done(), "stop returned with its background task running"
    assert saw == ["client open"]
    assert gateway.background_settled()
    await gateway.stop()  # again: nothing left to wait for


async def test_a_task_swallowing_its_cancellation_ends_within_the_bound(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cachecore.tasks")

    async def swallows_once() -> None:
        # goes on as if nothing happened (3.11's wait_for did so)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        await asyncio.Event().wait()

    task = gateway.spawn(swallows_once())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await gateway.stop()
    assert time.monotonic() - t0 < STOP_BOUND_S
    assert task.done(), "stop returned with the task that swallowed a cancellation running"
    assert any("swallowed a cancellation" in r.getMessage() for r in caplog.records)


async def test_a_task_ignoring_every_cancellation_does_not_hang_stop(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="cachecore.tasks")
    release = asyncio.Event()

    async def ignores() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = gateway.spawn(ignores())
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    try:
        await gateway.stop()
        took = time.monotonic() - t0
        assert took < STOP_BOUND_S, took
        assert not task.done()  # left, and said so
        survived = [r for r in caplog.records if "survived" in r.getMessage()]
        assert survived and survived[0].levelno == logging.ERROR
        assert gateway.client is not None and gateway.client.is_closed  # shutdown went on
    finally:
        release.set()
        await asyncio.wait([task], timeout=5.0)
    assert task.done()


async def test_a_task_spawned_after_stop_cancelled_its_tasks_never_runs(gateway: Gateway) -> None:
    """A request still in flight after the drain timeout may spawn a claim check after stop()
    cancelled and awaited the background tasks: it would read the index and the stores while
    they close. Such a task is cancelled before its first step (review R1, this session)."""
    ran: list[str] = []

    async def check() -> None:
        ran.append("ran")

    await gateway.stop()
    task = gateway.spawn(check())
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ran == [] and task.cancelled()
    assert gateway.background_settled()
