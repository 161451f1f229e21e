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
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, Protocol, TypeVar, runtime_checkable

log = logging.getLogger(__name__)

T = TypeVar("T")

RUN_TO_END_CANCELS = 3
"""How many times :func:`run_to_end` cancels a clean-up past its bound before leaving it."""

Step = tuple[str, Callable[[], Awaitable[object]], float | None]
"""One step of a clean-up for :func:`run_steps`: its name, what it runs, its bound in seconds
(None: none here, the step bounds itself)."""


@runtime_checkable
class BoundedStop(Protocol):
    """A stop function that says how long it may take: it runs its work under
    :func:`run_to_end` with ``stop_limit_s`` (a caller bounds its wait on it with
    :func:`enclosing_limit_s`)."""

    @property
    def stop_limit_s(self) -> float: ...

    def __call__(self) -> Awaitable[None]: ...


def enclosing_limit_s(limit_s: float, grace_s: float = 1.0) -> float:
    """A bound for waiting on a clean-up that runs under ``run_to_end(..., limit_s,
    grace_s)``: the longest that holds its caller (``limit_s``, then ``grace_s`` for each of
    its :data:`RUN_TO_END_CANCELS` cancellations), and one grace more. An outer bound any
    shorter cut off the inner one, which names what blocked, and left its work running."""
    return limit_s + (RUN_TO_END_CANCELS + 1) * grace_s


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


async def run_to_end(
    work: Coroutine[Any, Any, T], limit_s: float, what: str, grace_s: float = 1.0
) -> T:
    """Run ``work`` (a clean-up: a stop, a close) in a task of its own and wait until it has
    ended, however often the caller is cancelled meanwhile. Awaited directly, a clean-up
    stopped at the first cancellation that reached it, and what it had not closed yet
    (tasks, clients, sockets, files) stayed open for the rest of the process.

    A cancellation of the caller while it waited is raised once ``work`` has ended (a
    failure of ``work`` is then logged, not raised). Otherwise ``work``'s result is
    returned, or its exception raised; ``work`` ending cancelled though neither the caller
    nor the bound cancelled it (a task it awaits was cancelled elsewhere) raises
    RuntimeError, never a cancellation the caller did not get.

    Bounded: past ``limit_s`` ``work`` is cancelled (again every ``grace_s``, at most
    :data:`RUN_TO_END_CANCELS` times; one that outlives that is logged and left running)
    and TimeoutError raised, or the caller's cancellation."""
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(work, name=what)
    cancelled: asyncio.CancelledError | None = None
    deadline = loop.time() + limit_s
    cancels = 0
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            if cancels == RUN_TO_END_CANCELS:
                log.error("a clean-up survived its cancellations", extra={"what": what})
                break
            if cancels == 0:
                log.error(
                    "a clean-up did not end in time: cancelled",
                    extra={"what": what, "limit_s": limit_s},
                )
            task.cancel()
            cancels += 1
            deadline = loop.time() + grace_s
            continue
        try:
            # wait, not await: a cancellation of ours must not reach the task
            await asyncio.wait((task,), timeout=left)
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc  # held until the clean-up has ended
    failure: BaseException | None = None
    if cancels:
        if task.done() and not task.cancelled():
            task.exception()  # consumed: the timeout is the outcome
        failure = TimeoutError(f"{what} did not end within {limit_s} s")
    elif not task.cancelled():
        failure = task.exception()
    else:
        # cancelled by neither the caller (whose cancellations never reach the task) nor
        # the bound: by another task (wait_to_end's task cancelled elsewhere). A failure of
        # the clean-up: raised as a cancellation, it reached a caller nobody cancelled,
        # which then stopped as if it had been (run_steps skipped the steps after it; a stop
        # said to log a failure raised it). A caller cancelled meanwhile gets its own
        # cancellation, and this is logged as any failure then is
        failure = RuntimeError(f"{what} ended cancelled by another task")
    if cancelled is not None:
        if failure is not None:
            log.error("a clean-up failed", exc_info=failure, extra={"what": what})
        raise cancelled
    if failure is not None:
        raise failure
    return task.result()


async def wait_to_end(task: asyncio.Future[T], limit_s: float, what: str) -> T:
    """Wait until ``task`` (one told to stop: a server asked to exit) has ended, however
    often the caller is cancelled meanwhile, then raise the caller's cancellation; past
    ``limit_s`` ``task`` is cancelled and TimeoutError raised (:func:`run_to_end`'s rules).
    Its result is returned, its exception raised (RuntimeError if it was cancelled
    elsewhere: the caller was not). A wait for it under
    ``suppress(CancelledError)`` swallowed the caller's own cancellation: the caller went on
    as if it had never been cancelled."""

    async def ended() -> T:
        return await task  # cancelled past the limit: the cancellation reaches the task

    return await run_to_end(ended(), limit_s, what)


async def run_steps(steps: Iterable[Step], what: str, **fields: object) -> None:
    """Run every step of a clean-up in order, each within its bound, whatever an earlier one
    did: one failing skipped those after it, and what they close stayed open. A failure
    (TimeoutError: the step blocked, and was cancelled) is logged with its traceback as
    "``what``: a step failed" (with ``step`` and ``fields``) and the first one raised once
    all ran. A cancellation of the task running them ends them: run them under
    :func:`run_to_end` where the caller's must not."""
    failed: Exception | None = None
    for name, step, bound_s in steps:
        try:
            async with asyncio.timeout(bound_s):
                await step()
        except Exception as exc:  # the other steps still run
            log.error(f"{what}: a step failed", exc_info=True, extra={**fields, "step": name})
            failed = failed or exc
    if failed is not None:
        raise failed
