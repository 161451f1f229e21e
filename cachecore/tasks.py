"""Stopping asyncio tasks for sure.

``task.cancel(); await task`` can wait forever on Python 3.11: when a task is cancelled
while it awaits another task (or a future), the cancellation is handed to that inner
awaitable, and if the inner one swallows it (returns instead of raising; 3.11's
``asyncio.wait_for`` does so when its inner future completes in the same loop tick) the
outer task goes on as if nothing happened: it is left "cancelling" in its next ``await``
(an agent worker waiting for its next command, for ever). :func:`cancel_and_wait` repeats
the cancellation until the task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(
    *tasks: asyncio.Future[Any] | None, grace_s: float = 1.0, attempts: int = 10
) -> None:
    """Cancel every task and wait until each has ended, cancelling again every ``grace_s``
    while one is still running (at most ``attempts`` times; a task that outlives them all is
    logged and left). Outcomes are consumed: a stopped task's result or exception is not
    the caller's business. ``None`` entries are skipped."""
    pending = {t for t in tasks if t is not None and not t.done()}
    rounds = 0
    while pending and rounds < attempts:
        rounds += 1
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    if rounds > 1 and not pending:
        log.warning("a task swallowed a cancellation; it ended after %d", rounds)
    for t in pending:
        log.error("a task survived %d cancellations", attempts, extra={"task": repr(t)})
    for task in tasks:
        if task is not None and task.done():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
