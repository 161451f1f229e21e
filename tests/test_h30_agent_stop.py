"""The standalone agent's shutdown runs to its end (review of the h29 shutdown fixes).

``Agent.stop`` awaited its steps one after another (its tasks, each rank's stop, the
registration's release, the scraper's close) before closing the trace file and destroying
the ZMQ context: a cancellation arriving in one of those awaits, or one raising, ended it
there, and the steps after it never ran (the rank's worker ran on, the registration stayed,
the scraper's client, the trace file and the context stayed open); a step that blocked held
the stop for ever. Now every step runs, in a task of its own the caller's cancellations do
not reach (``cachecore.tasks.run_to_end``), each bounded (``STOP_STEP_S``); a failure is
logged with its traceback and the first raised at the end, a cancellation after the steps.

``kvgate agent``'s ``finally`` ran ``agent.stop``, then the HTTP server's stop, then the
Redis clients' close: ``agent.stop`` failing, or the run cancelled again while it ran, left
the HTTP server serving and the clients connected. Now its shutdown runs every step the
same way, and waits for the GC freezer it cancels.

Real pieces: an agent on an engine stub and an event source on loopback (tests/
test_agent_helpers' Rig), a memory index and registry; for the CLI, its own ``_main`` on a
redis-server of the test's own (its CLIENT LIST shows the connections left), stopped by a
real SIGTERM. Faults injected by fakes named as such, installed over one step's callable:
``SlowStep`` (takes a while, then runs the real step), ``FailingStep`` (runs the real
step, then raises), ``BlockingStep`` (blocks until cancelled, then runs the real step), and
an ``Agent`` subclass for the CLI whose stop runs the real one and then raises, or takes a
while before it."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import pytest
import zmq.asyncio

from cachecore.agent import Agent, cli
from cachecore.agent import agent as agent_module
from cachecore.index.memory import MemoryIndex
from cachecore.registry import MemoryRegistry
from cachecore.testing import RedisServer, free_port
from tests.test_agent_helpers import Rig, until
from tests.test_h28_redis_clients_closed import wait_for_clients
from tests.test_h29_cancelled_cleanup import SlowStep

pytestmark = pytest.mark.timeout(60)


class FailingStep:
    """A fake for fault injection: runs the real step, then raises ``error``."""

    def __init__(self, real: Callable[[], Awaitable[None]], error: Exception) -> None:
        self.real = real
        self.error = error

    async def __call__(self) -> None:
        await self.real()
        raise self.error


class BlockingStep:
    """A fake for fault injection: blocks until cancelled, then runs the real step on its
    way out (what it holds is still released)."""

    def __init__(self, real: Callable[[], Awaitable[None]]) -> None:
        self.real = real
        self.cancelled = False

    async def __call__(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            await self.real()


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    # always: a stop deregisters, so the registry shows whether that step ran
    r = Rig(MemoryIndex(), deregister_on_stop="always")
    await r.stub.start()
    yield r
    await r.close()


def agent_tasks() -> list[str]:
    """The running tasks of an agent (its supervisor, loops and rank workers)."""
    return sorted(
        t.get_name()
        for t in asyncio.all_tasks()
        if t.get_name().startswith("agent-") and not t.done()
    )


async def registered(registry: MemoryRegistry) -> bool:
    return bool(await registry.discover(int(time.time() * 1000), ["r0"]))


def step_failures(caplog: pytest.LogCaptureFixture, message: str) -> dict[str, BaseException]:
    """step -> the exception logged with it, for each ``message`` record."""
    out: dict[str, BaseException] = {}
    for r in caplog.records:
        if r.getMessage() == message and r.exc_info and r.exc_info[1] is not None:
            assert r.levelno == logging.ERROR
            out[str(getattr(r, "step", ""))] = r.exc_info[1]
    return out


@dataclass(frozen=True)
class Started:
    """A ready agent with a registration and its own trace file, and what its stop must
    close: its SUB socket and the trace file (the agent drops both references)."""

    agent: Agent
    registry: MemoryRegistry
    sub: zmq.asyncio.Socket
    trace: TextIO


async def started_agent(rig: Rig, tmp_path: Path) -> Started:
    registry = MemoryRegistry()
    rig.settings_kw["trace_out"] = tmp_path / "trace.jsonl"
    agent = await rig.start(registry=registry)
    await until(lambda: registered(registry), 5.0)
    assert agent.stream is not None and agent.stream._sock is not None
    assert agent.trace is not None and agent.trace._fh is not None
    assert set(agent.syncs) == {0} and agent_tasks()
    return Started(agent, registry, agent.stream._sock, agent.trace._fh)


async def left_open(s: Started) -> list[str]:
    """What a finished stop must have closed and released, where it did not."""
    problems = [f"agent task still running: {name}" for name in agent_tasks()]
    if not s.sub.closed:
        problems.append("the SUB socket is open")
    if await registered(s.registry):
        problems.append("the registration is still there")
    if not s.agent.scraper._client.is_closed:
        problems.append("the scraper's HTTP client is open")
    if not s.trace.closed:
        problems.append("the trace file is open")
    if not s.agent.ctx.closed:
        problems.append("the ZMQ context is not destroyed")
    return problems


async def test_a_stop_cancelled_again_while_a_rank_stops_still_closes_everything(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = await started_agent(rig, tmp_path)
    agent = started.agent
    slow = SlowStep(agent.syncs[0].stop)
    monkeypatch.setattr(agent.syncs[0], "stop", slow)
    stopping = asyncio.ensure_future(agent.stop())
    async with asyncio.timeout(10.0):
        await slow.entered.wait()  # the stop is in rank 0's stop
    stopping.cancel()
    await asyncio.sleep(0.05)
    stopping.cancel()  # cancelled again, while the first is held
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(10.0):
            await stopping
    assert stopping.cancelled()
    problems = await left_open(started)
    if not slow.finished:
        problems.append("rank 0's stop was cut short")
    assert problems == [], "left by the cancelled stop:\n" + "\n".join(problems)


async def test_a_step_that_raises_skips_none_after_it_and_its_error_is_raised(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    started = await started_agent(rig, tmp_path)
    agent = started.agent
    boom = RuntimeError("injected fault: rank 0's stop failed")
    monkeypatch.setattr(agent.syncs[0], "stop", FailingStep(agent.syncs[0].stop, boom))
    with pytest.raises(RuntimeError) as raised:
        async with asyncio.timeout(10.0):
            await agent.stop()
    assert raised.value is boom
    problems = await left_open(started)
    assert problems == [], "left by the failed stop:\n" + "\n".join(problems)
    assert step_failures(caplog, "agent stop: a step failed") == {"rank 0": boom}


async def test_a_step_that_blocks_is_cut_off_at_its_bound_and_the_rest_run(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    # (raising=False: without the bound the test shows the stop held, not a missing name)
    monkeypatch.setattr(agent_module, "STOP_STEP_S", 0.3, raising=False)
    started = await started_agent(rig, tmp_path)
    agent = started.agent
    blocking = BlockingStep(agent.scraper.close)
    monkeypatch.setattr(agent.scraper, "close", blocking)
    t0 = time.monotonic()
    stopping = asyncio.ensure_future(agent.stop())
    done, _ = await asyncio.wait([stopping], timeout=5.0)
    took = time.monotonic() - t0
    try:
        assert stopping in done, "the stop is held by a blocked step"
        assert isinstance(stopping.exception(), TimeoutError)
    finally:
        stopping.cancel()
        # the rig's own stop at teardown must not block on it again
        monkeypatch.setattr(agent.scraper, "close", blocking.real)
    assert took < 2.0, took
    assert blocking.cancelled and agent.scraper._client.is_closed
    assert started.trace.closed and agent.ctx.closed
    assert list(step_failures(caplog, "agent stop: a step failed")) == ["scraper"]


# ----------------------------------------------------------------------- kvgate agent


def recording_agent(
    made: list[Agent], stop: Callable[[Agent, bool | None], Awaitable[None]]
) -> type[Agent]:
    """A fake for fault injection, installed as the CLI's ``Agent``: records each agent it
    makes, and its stop is ``stop(agent, deregister)`` (which calls the real one)."""

    class RecordingAgent(Agent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        async def stop(self, deregister: bool | None = None) -> None:
            await stop(self, deregister)

    return RecordingAgent


def gc_freezers() -> list[asyncio.Task[Any]]:
    """The CLI's GC freezer tasks still running (found by their coroutine)."""
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") == "_gc_freezer" and not t.done()
    ]


async def refused(port: int) -> bool:
    """Whether a connection to 127.0.0.1:``port`` is refused (nothing listens)."""
    try:
        async with asyncio.timeout(2.0):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


@asynccontextmanager
async def running_cli(
    rig: Rig, redis: RedisServer, agent_class: type[Agent], made: list[Agent]
) -> AsyncIterator[tuple[asyncio.Future[int], int]]:
    """``kvgate agent``'s ``_main`` in this loop (its agent ``agent_class``) on the rig's
    engine and ``redis``, once its agent is ready, its Redis clients connected and its GC
    freezer running: (its task, its HTTP port). At the end its signal handlers are removed
    and what the code under test left running is released."""
    port = free_port()
    settings = rig.settings(redis=redis.url, http_host="127.0.0.1", http_port=port)
    loop = asyncio.get_running_loop()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "Agent", agent_class)
        main = asyncio.ensure_future(
            cli._main(settings, settings.key_prefix, register=True, gc_freeze_interval_s=0.05)
        )
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=2.0) as h:

                async def ready() -> bool:
                    try:
                        return (await h.get("/health")).status_code == 200
                    except httpx.TransportError:
                        return False

                await until(ready, 15.0, step_s=0.05)
            # the index's, the load store's and the registry's connections
            during = await asyncio.to_thread(wait_for_clients, redis.url, 3, True)
            assert len(during) >= 3, during
            assert len(gc_freezers()) == 1 and len(made) == 1
            yield main, port
        finally:
            main.cancel()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            gc.unfreeze()
            for agent in made:  # stopped already unless the code under test skipped it
                if not agent.ctx.closed:
                    agent.ctx.destroy(linger=0)


async def cli_left_open(port: int, redis: RedisServer) -> list[str]:
    """What ``kvgate agent``'s shutdown must have stopped and closed, where it did not."""
    problems = []
    if not await refused(port):
        problems.append("the HTTP server still accepts connections")
    if freezers := gc_freezers():
        problems.append(f"the GC freezer is still running: {freezers}")
    after = await asyncio.to_thread(wait_for_clients, redis.url, 0, False)
    if after:
        problems.append(f"{len(after)} Redis connections left: {after}")
    return problems


@pytest.mark.redis
async def test_the_cli_stops_its_http_server_and_closes_its_clients_when_agent_stop_fails(
    rig: Rig, redis_own: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGTERM (the real shutdown path), and the agent's stop runs, then raises (one of
    its steps failed): the HTTP server stops, the Redis clients close, and the CLI raises
    the agent's error."""
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    boom = RuntimeError("injected fault: the agent's stop failed")

    async def failing_stop(agent: Agent, deregister: bool | None) -> None:
        await Agent.stop(agent, deregister)
        raise boom

    made: list[Agent] = []
    agent_class = recording_agent(made, failing_stop)
    async with running_cli(rig, redis_own, agent_class, made) as (main, port):
        # the CLI's own handler (asyncio's in place of the default)
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(RuntimeError) as raised:
            async with asyncio.timeout(30.0):
                await main
    assert raised.value is boom
    problems = await cli_left_open(port, redis_own)
    assert problems == [], "left by the shutdown:\n" + "\n".join(problems)
    assert step_failures(caplog, "agent shutdown: a step failed") == {"agent": boom}


@pytest.mark.redis
async def test_the_cli_cancelled_again_while_its_agent_stops_still_closes_everything(
    rig: Rig, redis_own: RedisServer
) -> None:
    """The CLI's run cancelled (its shutdown begins), then again while the agent's stop is
    slowed: the agent's stop runs to its end, the HTTP server stops, the Redis clients
    close, and the run ends cancelled."""
    entered = asyncio.Event()
    finished: list[Agent] = []

    async def slow_stop(agent: Agent, deregister: bool | None) -> None:
        entered.set()
        await asyncio.sleep(0.3)
        await Agent.stop(agent, deregister)
        finished.append(agent)

    made: list[Agent] = []
    agent_class = recording_agent(made, slow_stop)
    async with running_cli(rig, redis_own, agent_class, made) as (main, port):
        main.cancel()
        async with asyncio.timeout(10.0):
            await entered.wait()
        main.cancel()  # cancelled again, while the agent stops
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(30.0):
                await main
        assert main.cancelled()
        agent = made[0]
    problems = await cli_left_open(port, redis_own)
    if finished != [agent]:
        problems.append("the agent's stop was cut short")
    if not agent.ctx.closed:
        problems.append("the agent's ZMQ context is not destroyed")
    assert problems == [], "left by the cancelled shutdown:\n" + "\n".join(problems)
