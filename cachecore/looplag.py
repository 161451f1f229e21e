"""How much time this process's event loop lost to its own starvation.

A timeout measured in the loop is only evidence against the peer when the loop itself ran
on time: a blocked or CPU-starved process (a cgroup quota's throttling, a noisy neighbour, a
long GC pass) fires every timer it has late, and a timer that fires in the same loop turn as
the peer's answer arrives cancels the read before the answer is seen. Health checks use
:meth:`LoopLagMonitor.longest_stall_since` to tell the two apart.

The monitor is one timer callback that reschedules itself every ``interval_s`` and records
how late each run was. Invariants: ``_ticks`` holds ``(woke_at, lag)`` in wake order, each
lag >= 0, at most ``max_ticks`` of them (at 50 ms, 25 s of history: longer windows are
under-read); a stall ``[woke_at - lag, woke_at]`` is one entry; ``running`` exactly while a
tick is scheduled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopLagMonitor:
    """Records the event loop's lateness; ``on_lag(seconds)`` sees every wake's lag."""

    def __init__(
        self,
        interval_s: float = 0.05,
        max_ticks: int = 512,
        on_lag: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s <= 0 or max_ticks < 1:
            raise ValueError("interval_s must be > 0 and max_ticks >= 1")
        self.interval_s = interval_s
        self._on_lag = on_lag
        self._clock = clock
        self._ticks: deque[tuple[float, float]] = deque(maxlen=max_ticks)
        self._due: float | None = None  # when the pending tick should run
        self._handle: asyncio.TimerHandle | None = None

    def now(self) -> float:
        """The monitor's clock (what :meth:`longest_stall_since` takes)."""
        return self._clock()

    @property
    def running(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        if self._handle is None:
            self._schedule(asyncio.get_running_loop())

    async def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._due = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        # a timer callback, not a sleeping task: a task's wake takes a second loop turn
        # (the timer, then the task's step), each behind whatever runs there, and read a
        # single stall as up to twice its length
        self._due = self._clock() + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = self._clock()
        due = self._due if self._due is not None else now
        lag = max(0.0, now - due)
        self._ticks.append((now, lag))
        self._schedule(loop)
        if self._on_lag is not None:
            try:
                self._on_lag(lag)
            except Exception:  # a metrics error must not end the monitor
                log.exception("loop lag callback failed")

    def longest_stall_since(self, since: float) -> float:
        """The longest single stall of the loop after ``since`` (the monitor's clock), in
        seconds: recorded stalls clipped to the window, and the stall in progress (the tick
        due but not run yet, e.g. while a timeout's callback runs in the same loop turn).
        The longest, not the sum: a timer fires falsely when one stall spans its due time
        (the answer it waits for and the timer then land in the same loop turn), and a busy
        loop's many short slices add up without doing that. 0 while the monitor is not
        running: a stopped monitor's due time would otherwise read as a stall for ever."""
        if not self.running:
            return 0.0
        now = self._clock()
        longest = 0.0
        for woke_at, lag in reversed(self._ticks):
            if woke_at <= since:
                break
            longest = max(longest, min(lag, woke_at - since))
        if self._due is not None and now > self._due:
            longest = max(longest, now - max(self._due, since))
        return longest
