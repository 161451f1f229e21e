"""``cachecore.tasks.run_to_end``: a clean-up awaited directly stopped at the first
cancellation that reached it (review of 60cb3b6 and bea3d38: a start-up cancelled twice
left the gateway's client, stores and trace file open). It now runs in a task of its own
until it has ended, bounded, and the caller's cancellation is raised after it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from cachecore.tasks import run_to_end

pytestmark = pytest.mark.timeout(30)


async def test_a_caller_cancelled_twice_waits_for_the_clean_up_then_ends_cancelled() -> None:
    steps: list[str] = []
    started = asyncio.Event()

    async def clean_up() -> None:
        started.set()
        await asyncio.sleep(0.2)  # a step that takes a while (a Redis close)
        steps.append("first")
        await asyncio.sleep(0.05)
        steps.append("last")

    caller = asyncio.ensure_future(run_to_end(clean_up(), 5.0, "clean-up"))
    async with asyncio.timeout(5.0):
        await started.wait()
    caller.cancel()
    await asyncio.sleep(0.05)
    caller.cancel()  # a second one, while the first is held
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert caller.cancelled()
    assert steps == ["first", "last"]  # ran to its end before the caller ended


async def test_a_failure_while_the_caller_is_cancelled_is_logged_and_the_cancellation_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    started = asyncio.Event()

    async def clean_up() -> None:
        started.set()
        await asyncio.sleep(0.1)
        raise RuntimeError("the close failed")

    caller = asyncio.ensure_future(run_to_end(clean_up(), 5.0, "clean-up"))
    async with asyncio.timeout(5.0):
        await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    logged = [r for r in caplog.records if r.getMessage() == "a clean-up failed"]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert isinstance(logged[0].exc_info[1], RuntimeError)


async def test_without_a_cancellation_the_result_or_the_failure_is_the_callers() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("x")

    assert await run_to_end(answer(), 5.0, "answer") == 42
    with pytest.raises(ValueError, match="x"):
        await run_to_end(fails(), 5.0, "fails")


async def test_a_blocked_clean_up_is_cancelled_past_its_bound() -> None:
    ran: list[str] = []

    async def blocks() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ran.append("finally")

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"blocks did not end within 0\.2 s"):
        await run_to_end(blocks(), 0.2, "blocks")
    assert time.monotonic() - t0 < 2.0
    assert ran == ["finally"]


async def test_a_clean_up_ignoring_every_cancellation_is_left_and_the_caller_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    release = asyncio.Event()

    async def ignores() -> None:
        for _ in range(100):  # bounded: the test releases it
            if release.is_set():
                return
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            await run_to_end(ignores(), 0.1, "ignores", grace_s=0.1)
        assert time.monotonic() - t0 < 2.0
        assert any(
            r.getMessage() == "a clean-up survived its cancellations" for r in caplog.records
        )
        left = [t for t in asyncio.all_tasks() if t.get_name() == "ignores"]
        assert len(left) == 1 and not left[0].done()
    finally:
        release.set()
    async with asyncio.timeout(5.0):
        await asyncio.wait(left)
