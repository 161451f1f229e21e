"""Engine progress from its own counters: since when an engine with requests has taken no
step (D17).

vLLM's ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` only grow while the
engine computes. An engine with requests (running + waiting > 0) whose counters stand still
from one scrape to the next has not made progress in between: a wedge whose HTTP, /health
and /metrics still answer. The agent publishes the start of such a stretch in its load
record; the gateway charges what exceeds the policy's ``routing.overdue_grace_ms`` as
queue wait, as it does for a late stream (D16).

Measured at scrapes only, so the reported stall is a lower bound: the last progress came at
or before the scrape that last saw the counters move, and a stall shorter than a scrape
interval may not show at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachecore.agent.scrape import EngineSnapshot

_START_TIME_TOLERANCE_S = 1e-3


@dataclass(slots=True)
class ProgressTracker:
    """One engine's progress across scrapes. :meth:`observe` is called once per scrape
    with a monotonic clock.

    Never a stall: an idle engine; an engine without these counters (no evidence either
    way); the scrape after a restart (new ``process_start_time_seconds``, or a counter that
    went backwards, which starts the tracking over); the first busy scrape (the requests
    may have just arrived).
    """

    _counters: tuple[float | None, float | None] | None = None
    _start_time: float | None = None
    # monotonic s since which the engine is busy and its counters have not moved; None
    # while idle or untracked
    _since: float | None = None

    def reset(self) -> None:
        self._counters = None
        self._start_time = None
        self._since = None

    def observe(self, snap: EngineSnapshot, now: float) -> float:
        """Seconds the engine has been busy without progress as of this scrape (0.0 when
        it progresses, is idle, or cannot be judged)."""
        counters = (snap.prompt_tokens, snap.generation_tokens)
        busy = snap.running + snap.waiting > 0
        prev, since = self._counters, self._since
        restarted = (
            snap.start_time is not None
            and self._start_time is not None
            and abs(snap.start_time - self._start_time) > _START_TIME_TOLERANCE_S
        )
        self._counters, self._start_time = counters, snap.start_time
        if counters == (None, None):
            self._since = None  # no counters: never judged
            return 0.0
        if prev is None or restarted or _presence(prev) != _presence(counters):
            self._since = now if busy else None  # tracking starts over
            return 0.0
        if not busy:
            self._since = None
            return 0.0
        moved = False
        for old, new in zip(prev, counters, strict=True):
            if old is None or new is None:
                continue
            if new < old:  # a reset counter (a restart the start time did not show)
                self._since = now
                return 0.0
            if new > old:
                moved = True
        if moved or since is None:
            self._since = now
            return 0.0
        return now - since


def _presence(counters: tuple[float | None, float | None]) -> tuple[bool, bool]:
    return (counters[0] is not None, counters[1] is not None)
