"""Engine progress from its own counters: since when an engine with requests has taken no
step (D17).

vLLM's ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` only grow while the
engine computes. An engine with requests (running + waiting > 0) whose counters stand still
from one scrape to the next has not made progress in between: a wedge whose HTTP, /health
and /metrics still answer.

Those counters alone miss one kind of progress: vLLM adds a prompt to ``prompt_tokens``
only when its first token comes out, so a long chunked prefill with nothing decoding
beside it leaves both still for seconds. Its KV-cache usage is what moves then: vLLM sets
``vllm:kv_cache_usage_perc`` from the scheduler's stats after every step (even a step with
no request output), and each prefill chunk allocates blocks, so a rise between scrapes is
a step taken. A fall is not counted: it is freed blocks (finishes, which move the counters
anyway, preemptions, or aborts, which the simulated replica applies without a step).
``vllm:iteration_tokens_total`` would not help: vLLM observes it only on steps with a
request output. The agent publishes the start of such a stretch in its load
record; the gateway charges what exceeds the policy's ``routing.overdue_grace_ms`` as
queue wait, as it does for a late stream (D16).

Measured at scrapes only, so the reported stall is a lower bound: the last progress came at
or before the scrape that last saw the counters move, and a stall shorter than a scrape
interval may not show at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachecore.agent.scrape import EngineCounters, EngineSnapshot

_START_TIME_TOLERANCE_S = 1e-3
_Counters = tuple[float | None, float | None]


def start_time_moved(last: float | None, now: float | None) -> bool:
    """Whether ``process_start_time_seconds`` changed between two scrapes that both
    carried it: a new engine process (the progress and the silence checks start over)."""
    return last is not None and now is not None and abs(now - last) > _START_TIME_TOLERANCE_S


@dataclass(slots=True)
class _CoreProgress:
    """One engine core's counters across scrapes."""

    counters: _Counters | None = None
    usage: float | None = None  # KV-cache usage at the last scrape
    # monotonic s since which the core is busy and its counters have not moved; None
    # while idle or untracked
    since: float | None = None

    def observe(
        self, busy: bool, counters: _Counters, usage: float | None, restarted: bool, now: float
    ) -> float:
        prev, since, prev_usage = self.counters, self.since, self.usage
        self.counters = counters
        self.usage = usage
        if counters == (None, None):
            self.since = None  # no counters: never judged
            return 0.0
        if prev is None or restarted or _presence(prev) != _presence(counters):
            self.since = now if busy else None  # tracking starts over
            return 0.0
        if not busy:
            self.since = None
            return 0.0
        moved = False
        for old, new in zip(prev, counters, strict=True):
            if old is None or new is None:
                continue
            if new < old:  # a reset counter (a restart the start time did not show)
                self.since = now
                return 0.0
            if new > old:
                moved = True
        if usage is not None and prev_usage is not None and usage > prev_usage:
            moved = True  # blocks allocated: a step, e.g. a prefill chunk (module docstring)
        if moved or since is None:
            self.since = now
            return 0.0
        return now - since


@dataclass(slots=True)
class ProgressTracker:
    """One engine's progress across scrapes. :meth:`observe` is called once per scrape
    with a monotonic clock.

    Each engine core is judged apart: a data-parallel vLLM server exports its series once
    per core (label ``engine``), and the engine's stall is its most stalled core's (summed
    counters would hide one wedged core beside working ones).

    Never a stall: an idle core; a core without these counters (no evidence either way);
    the scrape after a restart (new ``process_start_time_seconds``, or a counter that went
    backwards, which starts that core's tracking over); a core's first busy scrape (the
    requests may have just arrived).
    """

    _start_time: float | None = None
    _cores: dict[str, _CoreProgress] = field(default_factory=dict)

    def reset(self) -> None:
        self._start_time = None
        self._cores.clear()

    def observe(self, snap: EngineSnapshot, now: float) -> float:
        """Seconds the engine's most stalled core has been busy without progress as of this
        scrape (0.0 when every core progresses, is idle, or cannot be judged)."""
        restarted = start_time_moved(self._start_time, snap.start_time)
        self._start_time = snap.start_time
        cores = snap.engines or {
            "": EngineCounters(
                snap.running + snap.waiting,
                snap.prompt_tokens,
                snap.generation_tokens,
                kv_usage=snap.kv_usage,
            )
        }
        for gone in self._cores.keys() - cores.keys():
            del self._cores[gone]
        stalled = 0.0
        for name, c in cores.items():
            core = self._cores.get(name)
            if core is None:
                core = self._cores[name] = _CoreProgress()
            counters = (c.prompt_tokens, c.generation_tokens)
            s = core.observe(c.busy > 0, counters, c.kv_usage, restarted, now)
            stalled = max(stalled, s)
        return stalled


def _presence(counters: _Counters) -> tuple[bool, bool]:
    return (counters[0] is not None, counters[1] is not None)
