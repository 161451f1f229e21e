"""``run_fleet``'s shutdown, cut short (the start/stop review's sweep beyond the gateway).

Its ``finally`` stopped the engines, told the HTTP servers to exit, waited for them,
closed the event sockets and listeners and terminated the ZMQ context, one await after
another: the owner cancelled again during it (a second Ctrl-C, a test's teardown) stopped
it in that step, and a replica whose stop raised stopped it too. The HTTP servers then
served on, the event sockets stayed bound and the context alive. Now the shutdown runs to
its end in a task of its own (every step, a failure logged and the first raised at the
end) and the context is destroyed, not terminated (``term()`` blocks the loop while a
socket is open).

Its steps are :func:`cachecore.tasks.run_steps`' (as the gateway's and the agent's stops):
each bounded (``FLEET_STEP_S``), so a replica whose engine stop blocks is cut off and the
others, the HTTP servers and the sockets still stop; before, one blocked step held the
whole shutdown until its 30 s limit and was then cancelled with everything after it left
open. A failed step is logged as ``fleet stop: a step failed`` (``step`` names the replica:
``replica 0: event sockets``; it was ``replica stop failed`` with ``step`` and ``replica``).

Real pieces: two simulated replicas (uvicorn on loopback, ZMQ publishers). Faults injected
by fakes named as such: replica 0's engine stop takes a while (``SlowStop``), or its stop
raises without closing its sockets (``failing_stop``), or its engine stop blocks until
cancelled (``BlocksOnce``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from cachecore.replica import fleet as fleet_module
from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.replica.server import SimReplica
from tests.test_gateway_support import FAST

pytestmark = pytest.mark.timeout(60)


class SlowStop:
    """A fake for fault injection, installed as a replica's ``driver.stop``: sets
    ``entered``, takes ``delay_s``, then runs the real stop and sets ``finished``."""

    def __init__(self, real: Callable[..., Awaitable[None]], delay_s: float = 0.3) -> None:
        self.real = real
        self.delay_s = delay_s
        self.entered = asyncio.Event()
        self.finished = False

    async def __call__(self, *args: Any) -> None:
        self.entered.set()
        await asyncio.sleep(self.delay_s)
        await self.real(*args)
        self.finished = True


class BlocksOnce:
    """A fake for fault injection, installed as a replica's ``driver.stop``: its first call
    blocks until cancelled (an engine whose stop hangs), later ones run the real stop (the
    replica's own stop calls it again before it closes its event sockets)."""

    def __init__(self, real: Callable[..., Awaitable[None]]) -> None:
        self.real = real
        self.calls = 0
        self.cut = False

    async def __call__(self, *args: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cut = True
                raise
        await self.real(*args)


def step_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(r, "step", None))
        for r in caplog.records
        if r.getMessage() == "fleet stop: a step failed"
    ]


async def failing_stop() -> None:
    """A fake for fault injection, installed as a replica's ``stop``: it raises before it
    closed its event sockets."""
    raise RuntimeError("injected fault: the replica did not stop")


def http_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("http-") and not t.done()]


async def answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            await client.get(url + "/health")
    except httpx.HTTPError:
        return False
    return True


async def assert_stopped(replicas: list[SimReplica], urls: list[str]) -> None:
    """No HTTP server task or answer, every replica's event sockets closed, the shared
    context destroyed (every one that is not, in one message)."""
    problems = [f"HTTP server still running: {t.get_name()}" for t in http_tasks()]
    problems += [f"{u} still answers" for u in urls if await answers(u)]
    for rep in replicas:
        pub = rep.publisher
        assert pub is not None
        if pub._pub is not None and not pub._pub.closed:
            problems.append(f"replica {rep.index}'s event socket is open")
    ctx = replicas[0].publisher._ctx if replicas[0].publisher is not None else None
    if ctx is None or not ctx.closed:
        problems.append("the fleet's ZMQ context is not destroyed")
    assert problems == [], "left by the stop:\n" + "\n".join(problems)


async def owner(got: list[Fleet], ready: asyncio.Event) -> None:
    async with run_fleet(FAST, count=2) as fleet:
        got.append(fleet)
        ready.set()
        await asyncio.Event().wait()  # serves until cancelled


@pytest.fixture
async def leftovers() -> AsyncIterator[list[Fleet]]:
    """Fleets whose stop a regression left half done: their servers are told to exit at the
    test's end (they would outlive its event loop)."""
    fleets: list[Fleet] = []
    yield fleets
    for fleet in fleets:
        for s in fleet.servers:
            s.should_exit = True
    left = http_tasks()
    if left:
        await asyncio.wait(left, timeout=5.0)


async def test_an_owner_cancelled_again_while_the_fleet_stops_still_stops_everything(
    leftovers: list[Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[Fleet] = []
    ready = asyncio.Event()
    task = asyncio.ensure_future(owner(got, ready))
    async with asyncio.timeout(20.0):
        await ready.wait()
    fleet = got[0]
    leftovers.append(fleet)
    urls = fleet.urls
    assert all([await answers(u) for u in urls])
    slow = SlowStop(fleet.replicas[0].driver.stop)
    monkeypatch.setattr(fleet.replicas[0].driver, "stop", slow)
    task.cancel()
    async with asyncio.timeout(10.0):
        await slow.entered.wait()
    task.cancel()  # the second cancellation, while the first engine stops
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(15.0):
            await task
    assert task.cancelled()
    await assert_stopped(fleet.replicas, urls)
    assert slow.finished


async def test_a_replica_whose_stop_raises_does_not_keep_the_others_open(
    leftovers: list[Fleet], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    with pytest.raises(RuntimeError, match="injected fault"):
        async with run_fleet(FAST, count=2) as fleet:
            leftovers.append(fleet)
            urls = fleet.urls
            monkeypatch.setattr(fleet.replicas[0], "stop", failing_stop)
    await assert_stopped(fleet.replicas, urls)
    assert step_failures(caplog) == ["replica 0: event sockets"]


async def test_a_replica_whose_engine_stop_blocks_is_cut_off_and_the_rest_still_stops(
    leftovers: list[Fleet], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    # absent before run_steps bounded each step (raising=False: the reverse-applied change
    # runs the same test, and its one 30 s bound for the whole stop cuts everything short)
    monkeypatch.setattr(fleet_module, "FLEET_STEP_S", 0.5, raising=False)
    with pytest.raises(TimeoutError):
        async with run_fleet(FAST, count=2) as fleet:
            leftovers.append(fleet)
            urls = fleet.urls
            blocks = BlocksOnce(fleet.replicas[0].driver.stop)
            monkeypatch.setattr(fleet.replicas[0].driver, "stop", blocks)
            began = time.monotonic()
    took_s = time.monotonic() - began
    assert blocks.cut
    await assert_stopped(fleet.replicas, urls)
    assert step_failures(caplog) == ["replica 0: engine"]
    # the blocked step's 0.5 s, uvicorn's exit, the sockets: well under the old 30 s
    assert took_s < 15.0
