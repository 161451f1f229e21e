"""A start-up clean-up that a second cancellation cut short (review of 60cb3b6).

``Gateway.start`` stops what it made when it raises or is cancelled, but that stop was
awaited directly: a second cancellation arriving during it (a second shutdown signal, a
task group tearing down) stopped it in whatever step it was in, and the steps after it
(health checks, index, Redis clients, HTTP client, trace file) stayed open. A step that
blocked held the start for ever, and a stop cancelled in its drain closed nothing. Now
``Gateway.stop`` runs its steps in a task of its own that a cancellation does not reach,
each bounded (``STOP_STEP_S``), and ends cancelled after them; a cancelled drain ends at
once.

Real pieces and helpers from tests/test_h29_start_failure_cleanup (a redis-server of the
test's own, a raw HTTP engine on loopback, the leak check). Faults injected by fakes named
as such: a close step replaced by one that takes a while (``SlowStep``) or blocks until
cancelled (``BlockingStep``), both running the real step."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cachecore.testing import RedisServer
from gateway import core as gateway_core
from gateway.core import Gateway
from gateway.serve import build_gateway
from tests.test_h29_embedded_agents_cleanup import gateway as gateway  # a fixture
from tests.test_h29_start_failure_cleanup import (
    agent_spec,
    assert_nothing_left,
    engine,
    settings,
    stop_at_end,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.timeout(60)


class SlowStep:
    """A fake for fault injection, installed over one step of a stop (one of
    ``Gateway.stop``'s, ``Agent.stop``'s, an agent's scraper close): it sets ``entered``,
    takes ``delay_s`` (a Redis close on a slow link), then runs the real step and sets
    ``finished``. Shared by the other stop tests."""

    def __init__(self, real: Callable[[], Awaitable[None]], delay_s: float = 0.3) -> None:
        self.real = real
        self.delay_s = delay_s
        self.entered = asyncio.Event()
        self.finished = False

    async def __call__(self) -> None:
        self.entered.set()
        await asyncio.sleep(self.delay_s)
        await self.real()
        self.finished = True


class BlockingStep:
    """A fake for fault injection: a step that blocks until it is cancelled, and then runs
    the real step on its way out (what it holds is still released)."""

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


@pytest.mark.redis
async def test_a_start_cancelled_again_while_it_cleans_up_still_closes_everything(
    redis_own: RedisServer,
    stop_at_end: list[Gateway],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled in its block-size check (discovery, health checks, the refresher and
    every Redis client running), then again while its stop waits in its discovery step:
    every later step still runs, and the start ends cancelled."""
    url = redis_own.url
    async with engine(stall_metrics=True) as e:
        gw = build_gateway(settings(url, [e.url], tmp_path))
        stop_at_end.append(gw)
        await gw.key_store.tenant_for("Bearer sk-unknown")  # its client connected too
        before = asyncio.all_tasks()
        start = asyncio.ensure_future(gw.start())
        async with asyncio.timeout(10.0):
            await e.metrics_asked.wait()
        assert gw.discovery is not None and gw.refresher is not None
        slow = SlowStep(gw.discovery.stop)
        monkeypatch.setattr(gw.discovery, "stop", slow)
        start.cancel()
        async with asyncio.timeout(10.0):
            await slow.entered.wait()
        start.cancel()  # the second cancellation, while the clean-up awaits a step
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert start.cancelled()
        assert time.monotonic() - t0 < 5.0
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)
        assert slow.finished  # the step it was in ran to its end


@pytest.mark.redis
async def test_a_clean_up_step_that_blocks_is_cut_off_and_the_later_steps_run(
    redis_own: RedisServer,
    stop_at_end: list[Gateway],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A start failing at its agent hook, whose clean-up meets a health-check stop that
    never returns: that step is cancelled after STOP_STEP_S, the others run, and the start
    raises its own error (it hung for ever)."""
    monkeypatch.setattr(gateway_core, "STOP_STEP_S", 0.3, raising=False)
    caplog.set_level(logging.ERROR, logger="gateway.core")
    url = redis_own.url
    boom = RuntimeError("the embedded agents did not start")
    blocking: list[BlockingStep] = []

    async def failing_agents(*args: Any) -> Callable[[], Awaitable[None]]:
        assert gw.pool is not None
        blocking.append(BlockingStep(gw.pool.stop))
        monkeypatch.setattr(gw.pool, "stop", blocking[0])
        raise boom

    async with engine() as e:
        gw = build_gateway(settings(url, [agent_spec(e)], tmp_path), agent_hook=failing_agents)
        stop_at_end.append(gw)
        await gw.key_store.tenant_for("Bearer sk-unknown")
        before = asyncio.all_tasks()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as exc:
            async with asyncio.timeout(10.0):
                await gw.start()
        assert exc.value is boom
        assert time.monotonic() - t0 < 5.0
        assert blocking and blocking[0].cancelled
        failed = [r for r in caplog.records if r.getMessage() == "gateway stop: a step failed"]
        assert [getattr(r, "step", None) for r in failed] == ["health checks"]
        assert failed[0].exc_info is not None and isinstance(failed[0].exc_info[1], TimeoutError)
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)


async def test_a_stop_cancelled_in_its_drain_still_closes_and_ends_cancelled(
    gateway: Gateway,
) -> None:
    """A request in flight and a long drain: the stop is cancelled while it drains (the
    lifespan's shutdown cut short). It used to end there, nothing closed."""
    assert gateway.settings.drain_timeout_s >= 10.0
    gateway.begin()  # in flight
    try:
        stop = asyncio.ensure_future(gateway.stop())
        await asyncio.sleep(0.1)
        assert not stop.done() and gateway.draining
        stop.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await stop
        assert stop.cancelled()
        assert time.monotonic() - t0 < 3.0  # no drain wait left
        assert gateway.client is not None and gateway.client.is_closed
        assert gateway.loop_lag is not None and not gateway.loop_lag.running
        assert gateway.pool is not None and gateway.pool._task is None
    finally:
        gateway.end()
