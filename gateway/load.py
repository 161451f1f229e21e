"""The load view the router sees: this gateway's own in-flight accounting, counted at
dispatch, merged with the shared load snapshot (engine metrics from the agents and the
other gateways' in-flight work) when one is available.

Own accounting is exact and immediate (a burst of requests sees each other at once, which a
metrics scrape never could); the shared snapshot is a few hundred ms old but covers
traffic this process did not send.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from cachecore.scoring import LoadView


@dataclass(slots=True)
class _Own:
    queued_tokens: float = 0.0
    queued_requests: int = 0
    running: int = 0


@dataclass(slots=True)
class Ticket:
    """One dispatched request. Invariant: moves queued -> running -> done at most once
    each; releasing twice is a no-op, so every exit path may call :meth:`InFlight.done`."""

    replica: str
    tokens: float
    phase: int = 0  # 0 queued, 1 running, 2 done


@dataclass(frozen=True, slots=True)
class SharedLoad:
    """One replica's entry in the shared snapshot: engine-reported gauges plus the
    in-flight work dispatched by *other* gateway processes."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    capacity: int | None = None
    other_queued_tokens: float = 0.0
    other_queued_requests: int = 0
    other_running: int = 0


class InFlight:
    def __init__(self) -> None:
        self._own: dict[str, _Own] = {}

    def dispatch(self, replica: str, uncached_tokens: float) -> Ticket:
        o = self._own.setdefault(replica, _Own())
        o.queued_tokens += uncached_tokens
        o.queued_requests += 1
        return Ticket(replica, uncached_tokens)

    def first_token(self, t: Ticket) -> None:
        if t.phase != 0:
            return
        o = self._own[t.replica]
        o.queued_tokens = max(0.0, o.queued_tokens - t.tokens)
        o.queued_requests = max(0, o.queued_requests - 1)
        o.running += 1
        t.phase = 1

    def done(self, t: Ticket) -> None:
        if t.phase == 0:
            self.first_token(t)
        if t.phase == 1:
            o = self._own[t.replica]
            o.running = max(0, o.running - 1)
            t.phase = 2

    def own(self, replica: str) -> tuple[float, int, int]:
        o = self._own.get(replica)
        return (o.queued_tokens, o.queued_requests, o.running) if o else (0.0, 0, 0)

    def total(self) -> dict[str, tuple[float, int, int]]:
        return {r: (o.queued_tokens, o.queued_requests, o.running) for r, o in self._own.items()}


class LoadTracker:
    def __init__(
        self,
        inflight: InFlight,
        shared: Callable[[], Mapping[str, SharedLoad]] | None = None,
        default_capacity: int = 256,
    ) -> None:
        self.inflight = inflight
        self._shared = shared
        self.default_capacity = default_capacity

    def set_shared(self, shared: Callable[[], Mapping[str, SharedLoad]] | None) -> None:
        self._shared = shared

    def views(self, replicas: list[str], capacity: Mapping[str, int | None]) -> dict[str, LoadView]:
        snap = self._shared() if self._shared is not None else {}
        out: dict[str, LoadView] = {}
        for r in replicas:
            qt, qr, run = self.inflight.own(r)
            s = snap.get(r)
            cap = capacity.get(r) or (s.capacity if s and s.capacity else self.default_capacity)
            if s is None:
                out[r] = LoadView(qt, qr, run, 0, cap, 0.0)
                continue
            out[r] = LoadView(
                queued_prefill_tokens=qt + s.other_queued_tokens,
                queued_requests=qr + s.other_queued_requests,
                running=max(s.running, run + s.other_running),
                waiting=s.waiting,
                capacity=cap,
                kv_usage=s.kv_usage,
            )
        return out
