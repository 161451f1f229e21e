"""cachecore.tasks.cancel_and_wait: a task whose cancellation an inner awaitable swallowed
still stops (the agent worker hang of tests/test_agent_replica.py)."""

from __future__ import annotations

import asyncio

from cachecore.tasks import cancel_and_wait


async def _swallower() -> None:
    """Returns instead of raising when cancelled (as 3.11's wait_for can)."""
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        return


async def _worker(steps: list[str]) -> None:
    """Awaits an inner task (a cancellation goes to it and is swallowed), then waits for
    the next command: the agent worker's shape."""
    await asyncio.create_task(_swallower())
    steps.append("inner returned")
    await asyncio.Event().wait()


async def test_one_cancel_is_swallowed_and_cancel_and_wait_still_stops_the_task() -> None:
    steps: list[str] = []
    t = asyncio.create_task(_worker(steps))
    await asyncio.sleep(0.01)
    t.cancel()  # the plain way: handed to the inner task, which swallows it
    done, _ = await asyncio.wait({t}, timeout=0.2)
    assert not done and steps == ["inner returned"]  # the hang: still running
    await cancel_and_wait(t, grace_s=0.1)
    assert t.cancelled()


async def test_cancel_and_wait_skips_none_and_consumes_outcomes() -> None:
    async def boom() -> None:
        raise RuntimeError("x")

    failed = asyncio.create_task(boom())
    await asyncio.sleep(0)
    sleeper = asyncio.create_task(asyncio.sleep(30))
    await cancel_and_wait(None, failed, sleeper, grace_s=0.1)  # no exception escapes
    assert failed.done() and sleeper.cancelled()
