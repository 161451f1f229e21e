"""How much time this process's event loop lost to its own starvation.

A timeout measured in the loop is only evidence against the peer when the loop itself ran
on time: a blocked or CPU-starved process (a cgroup quota's throttling, a noisy neighbour, a
long GC pass) fires every timer it has late, and a timer that fires in the same loop turn as
the peer's answer arrives cancels the read before the answer is seen. Health checks use
:meth:`LoopLagMonitor.stolen_since` to tell the two apart.

The monitor is one task that sleeps ``interval_s`` at a time and records how late each wake
was. Invariants: ``_ticks`` holds ``(woke_at, lag)`` in wake order, each lag >= 0, at most
``max_ticks`` of them; a stall ``[woke_at - lag, woke_at]`` is counted once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from cachecore.tasks import cancel_and_wait


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
        self._due: float | None = None  # when the sleeping tick should wake
        self._task: asyncio.Task[None] | None = None

    def now(self) -> float:
        """The monitor's clock (what :meth:`stolen_since` takes)."""
        return self._clock()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self._task is None:
            self._due = self._clock() + self.interval_s
            self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._due = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = self._clock()
            due = self._due if self._due is not None else now
            lag = max(0.0, now - due)
            self._ticks.append((now, lag))
            self._due = now + self.interval_s
            if self._on_lag is not None:
                self._on_lag(lag)

    def stolen_since(self, since: float) -> float:
        """Seconds of loop lateness that fell after ``since`` (the monitor's clock):
        recorded stalls, clipped to the window, plus the stall in progress (the tick due
        but not run yet, e.g. while a timeout's callback runs in the same loop turn)."""
        now = self._clock()
        stolen = 0.0
        for woke_at, lag in reversed(self._ticks):
            if woke_at <= since:
                break
            stolen += min(lag, woke_at - since)
        if self._due is not None and now > self._due:
            stolen += now - max(self._due, since)
        return stolen
