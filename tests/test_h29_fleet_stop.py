"""``run_fleet``'s shutdown, cut short (the start/stop review's sweep beyond the gateway).

Its ``finally`` stopped the engines, told the HTTP servers to exit, waited for them,
closed the event sockets and listeners and terminated the ZMQ context, one await after
another: the owner cancelled again during it (a second Ctrl-C, a test's teardown) stopped
it in that step, and a replica whose stop raised stopped it too. The HTTP servers then
served on, the event sockets stayed bound and the context alive. Now the shutdown runs to
its end in a task of its own (every step, a failure logged and the first raised at the
end) and the context is destroyed, not terminated (``term()`` blocks the loop while a
socket is open).

Real pieces: two simulated replicas (uvicorn on loopback, ZMQ publishers). Faults injected
by fakes named as such: replica 0's engine stop takes a while (``SlowStop``), or its stop
raises without closing its sockets (``failing_stop``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

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
    leftovers: list[Fleet], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeError, match="injected fault"):
        async with run_fleet(FAST, count=2) as fleet:
            leftovers.append(fleet)
            urls = fleet.urls
            monkeypatch.setattr(fleet.replicas[0], "stop", failing_stop)
    await assert_stopped(fleet.replicas, urls)
