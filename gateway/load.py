"""The load view the router sees: this gateway's own in-flight accounting, counted at
dispatch, merged with the shared load snapshot (engine metrics from the agents and the
other gateways' in-flight work) when one is available.

Own accounting is exact and immediate (a burst of requests sees each other at once, which a
metrics scrape never could); the shared snapshot is a few hundred ms old but covers
traffic this process did not send.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cachecore.loadstate import ClockSkewLog, LoadStore
from cachecore.scoring import Coefficients, LoadView
from cachecore.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Own:
    queued_tokens: float = 0.0
    queued_requests: int = 0
    running: int = 0
    # streams (tickets with an expected first token, D16) in dispatch order; those past
    # their first token leave from the front at each first token
    watched: deque[Ticket] = field(default_factory=deque)
    # every ticket still waiting for its first token (D17: their tokens explain an engine
    # stall), by id: exactly the waiting ones are held, read only when a stall is reported
    waiting: dict[int, Ticket] = field(default_factory=dict)
    # monotonic s of the last progress this gateway saw on the replica (a stream's first
    # chunk, a whole answer): an engine stall reported to have begun earlier is stale
    progress_at: float = -math.inf


@dataclass(slots=True)
class Ticket:
    """One dispatched request. Invariant: moves queued -> running -> done at most once
    each; releasing twice is a no-op, so every exit path may call :meth:`InFlight.done`."""

    replica: str
    tokens: float
    phase: int = 0  # 0 queued, 1 running, 2 done
    # monotonic s at which its first token is predicted; past it plus the policy's grace
    # (read when the lateness is measured, so a reload applies at once) it is overdue
    expected: float = math.inf
    # its replica's entry when dispatched: once the replica is forgotten (or forgotten and
    # added again, a new entry) the ticket counts nowhere (:meth:`InFlight.forget`)
    entry: _Own | None = None


@dataclass(frozen=True, slots=True)
class SharedLoad:
    """One replica's entry in the shared snapshot: engine-reported gauges plus the
    in-flight work dispatched by *other* gateway processes."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    capacity: int | None = None
    other_queued_tokens: float = 0.0
    other_requests: int = 0
    # how long the engine had been busy without advancing its token counters at its
    # agent's last scrape (LoadRecord.stalled_ms, D17)
    stalled_ms: float = 0.0
    # when its agent scraped the engine, on this gateway's wall clock (ms; 0: no unexpired
    # report): a background watch counts only scrapes taken after it began (D33)
    metrics_ts_ms: int = 0


IDLE_SCRAPES = 3
"""Fresh scrapes in a row that must see a watched background run's engine with no running
and no waiting request before the watch ends it as dead (D33), and over at least
``KVGATE_BACKGROUND_IDLE_S`` of them (:attr:`IdleEngine.min_idle_ms`); more than one, so a
run whose request reaches the engine a moment after its answer (or that just finished, its
stored status not yet written) is never taken for one."""


@dataclass(slots=True)
class IdleEngine:
    """The engine scrapes a background watch has seen since it began (D33): how many in a
    row reported no running and no waiting request. Each scrape counts once (its
    ``metrics_ts_ms``, on this gateway's clock, later than the last counted, the first
    later than the watch's start); a missing or expired report breaks the row, and a
    repeated one (a snapshot not refreshed, an agent that stopped) adds nothing. The
    gateway's own in-flight counts are never read: they hold the watched run itself."""

    since_ms: int  # the last scrape counted; first the watch's start
    # how long the row must last, from its first scrape to its latest: vLLM 0.33 sets its
    # request gauges from a step's outputs only (v1/core/sched/scheduler.py
    # update_from_output, make_stats), so an engine idle before the run reads 0 and 0 for
    # the whole step that first computes it (a LoRA adapter's load, a multimodal encoder
    # pass, an unchunked long prefill: up to VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s)
    min_idle_ms: int = 0
    idle: int = 0
    first_ms: int = 0  # the row's first scrape

    def dead(self, load: SharedLoad | None) -> bool:
        """Whether the row, with ``load`` (the replica's snapshot entry) seen, is long
        enough: the engine holds none of the run's requests, nor will again (a run with
        no built-in tool has one engine request, there from moments after its answer
        to its end)."""
        if load is None or load.metrics_ts_ms <= 0:
            self.idle = 0  # no report: unknown, never idle
        elif load.metrics_ts_ms > self.since_ms:
            self.since_ms = load.metrics_ts_ms
            if load.running == 0 and load.waiting == 0:
                if self.idle == 0:
                    self.first_ms = load.metrics_ts_ms
                self.idle += 1
            else:
                self.idle = 0
        return self.idle >= IDLE_SCRAPES and self.since_ms - self.first_ms >= self.min_idle_ms


class InFlight:
    """This process's dispatches per replica. Deltas for the shared store accumulate in
    ``pending_deltas`` (requests, prefill tokens) and are flushed in batches, so the hot path
    never waits on Redis."""

    def __init__(self) -> None:
        self._own: dict[str, _Own] = {}
        self.pending_deltas: dict[str, list[int]] = {}

    def _entry(self, replica: str) -> _Own:
        # not setdefault(replica, _Own()): that builds a throwaway _Own (a deque and a
        # dict) at every dispatch and first token
        o = self._own.get(replica)
        if o is None:
            o = self._own[replica] = _Own()
        return o

    def _delta(self, replica: str, d_req: int, d_tok: float) -> None:
        d = self.pending_deltas.setdefault(replica, [0, 0])
        d[0] += d_req
        d[1] += int(d_tok)

    def dispatch(self, replica: str, uncached_tokens: float, expected: float = math.inf) -> Ticket:
        """Count a request against ``replica``; with a finite ``expected`` (monotonic s of
        its predicted first token) the first token is watched (:meth:`overdue_s`)."""
        o = self._entry(replica)
        o.queued_tokens += uncached_tokens
        o.queued_requests += 1
        self._delta(replica, 1, uncached_tokens)
        t = Ticket(replica, uncached_tokens, 0, expected, o)
        if expected != math.inf:
            o.watched.append(t)
        o.waiting[id(t)] = t
        return t

    def overdue_s(self, replica: str, now: float, grace_s: float) -> float:
        """How far the most overdue of ``replica``'s requests still waiting for a first
        token is past its predicted first token plus ``grace_s`` (0 when none is):
        evidence that the replica stopped making progress, which its queue estimate
        cannot show."""
        o = self._own.get(replica)
        if o is None or not o.watched:
            return 0.0
        late = 0.0
        cut = now - grace_s
        for t in o.watched:
            if t.phase == 0 and cut - t.expected > late:
                late = cut - t.expected
        return late

    def progressed(self, replica: str, now: float) -> None:
        """The replica's engine just produced something (a stream's first chunk, a whole
        answer): evidence of progress at ``now`` (monotonic s). Kept only where this
        gateway dispatched: a request that outlived its replica's removal makes no entry."""
        o = self._own.get(replica)
        if o is not None and now > o.progress_at:
            o.progress_at = now

    def since_progress_s(self, replica: str, now: float) -> float:
        """Seconds since the last progress seen on ``replica`` (inf when none was)."""
        o = self._own.get(replica)
        return math.inf if o is None else now - o.progress_at

    def longest_queued(self, replica: str) -> float:
        """The most uncached tokens of one of ``replica``'s requests still waiting for a
        first token (0 when none is): the longest prefill the engine may be running."""
        o = self._own.get(replica)
        if o is None:
            return 0.0
        return max((t.tokens for t in o.waiting.values()), default=0.0)

    def unexplained_stall_ms(
        self,
        replica: str,
        stalled_ms: float,
        cut_ms: float,
        now: float,
        coeffs: Coefficients | None,
    ) -> float:
        """How far an engine stall its agent reported (D17) exceeds what explains it: the
        grace (``cut_ms``); the time before the last progress this gateway saw there (the
        agent reports a stall's end only at its next scrape, and the request that explained
        a long prefill may have just left the queue); with ``coeffs``, the predicted prefill
        time of the longest request this gateway has waiting there (vLLM counts a prompt's
        tokens only when its prefill completes, so one long prefill with nothing decoding
        beside it stands the counters still). Positive: the stall is charged."""
        excess = min(stalled_ms, 1000.0 * self.since_progress_s(replica, now)) - cut_ms
        o = self._own.get(replica)
        if coeffs is not None and o is not None and o.queued_requests:
            excess -= coeffs.overhead_ms + coeffs.prefill_ms_per_token * self.longest_queued(
                replica
            )
        return excess

    def forget(self, replica: str) -> None:
        """``replica`` was removed for good: its entry and unflushed deltas go. Its
        requests still in flight end without a trace (their tickets' entry is no longer
        the replica's); one added again under the id starts from nothing."""
        self._own.pop(replica, None)
        self.pending_deltas.pop(replica, None)

    def first_token(self, t: Ticket) -> None:
        if t.phase != 0:
            return
        o = self._own.get(t.replica)
        if o is None or o is not t.entry:  # its replica was forgotten
            t.phase = 1
            return
        o.queued_tokens = max(0.0, o.queued_tokens - t.tokens)
        o.queued_requests = max(0, o.queued_requests - 1)
        o.running += 1
        t.phase = 1
        del o.waiting[id(t)]
        watched = o.watched
        while watched and watched[0].phase != 0:
            watched.popleft()
        self._delta(t.replica, 0, -t.tokens)

    def done(self, t: Ticket) -> None:
        if t.phase == 0:
            self.first_token(t)
        if t.phase == 1:
            o = self._own.get(t.replica)
            if o is None or o is not t.entry:  # its replica was forgotten
                t.phase = 2
                return
            o.running = max(0, o.running - 1)
            t.phase = 2
            self._delta(t.replica, -1, 0)

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

    def views(
        self,
        replicas: list[str],
        capacity: Mapping[str, int | None],
        now: float | None = None,
        grace_s: float | None = None,
        coeffs: Coefficients | None = None,
    ) -> dict[str, LoadView]:
        """Each replica's load; with ``now`` (monotonic s) and ``grace_s`` also how
        overdue it is: the larger of its most overdue waiting stream's lateness
        (:meth:`InFlight.overdue_s`, D16) and how far its engine's stall (busy without
        progress, as its agent last scraped it, D17) exceeds the grace plus, with
        ``coeffs``, the predicted prefill time of the longest request this gateway has
        waiting there (vLLM counts a prompt's tokens only when its prefill completes, so
        one long prefill with nothing decoding beside it stands the counters still)."""
        snap = self._shared() if self._shared is not None else {}
        own = self.inflight.own
        overdue = self.inflight.overdue_s
        default = self.default_capacity
        out: dict[str, LoadView] = {}
        # a stall counts past the grace; unwatched (no now or grace), never
        stall_cut = 1000.0 * grace_s if now is not None and grace_s is not None else math.inf
        unexplained = self.inflight.unexplained_stall_ms
        for r in replicas:  # per replica per request: positional, no helper calls
            qt, qr, run = own(r)
            late = (
                1000.0 * overdue(r, now, grace_s)
                if now is not None and grace_s is not None
                else 0.0
            )
            s = snap.get(r)
            if s is None:
                out[r] = LoadView(qt, qr, run, 0, capacity.get(r) or default, 0.0, late)
                continue
            if s.stalled_ms - stall_cut > late:  # the larger of the two, never the sum
                assert now is not None  # a finite stall_cut
                excess = unexplained(r, s.stalled_ms, stall_cut, now, coeffs)
                if excess > late:
                    late = excess
            running = run + s.other_requests
            out[r] = LoadView(
                qt + s.other_queued_tokens,
                qr,
                s.running if s.running > running else running,
                s.waiting,
                capacity.get(r) or s.capacity or default,
                s.kv_usage,
                late,
            )
        return out


_NONE = (0, 0)
CLOCK_SKEW_WARN_MS = 1_000
"""An agent's clock this far from this gateway's is logged: the load store no longer minds
(it judges on Redis's clock), but the removal-log checks (D22) compare the agent's stamps
with this gateway's clock, and accuse beyond ``quarantine.tamper_margin_ms``."""


class SharedLoadRefresher:
    """Keeps a local copy of the shared :class:`LoadStore` snapshot, refreshed every
    ``interval_s``, and flushes this gateway's in-flight deltas to it. "Others" are the
    store's totals minus what this gateway had pushed when the snapshot was taken.

    Invariant: every in-flight delta is written to the store exactly once. A delta leaves
    the retry batch as soon as its ``add_inflight`` returns (and is counted in ``_pushed``
    then); when a refresh fails, only the deltas not yet written go back to
    ``inflight.pending_deltas``, so a failure in a later write, the heartbeat or the
    snapshot never replays one the store already holds."""

    def __init__(
        self,
        store: LoadStore,
        gateway_id: str,
        inflight: InFlight,
        replicas: Callable[[], list[str]],
        interval_s: float = 0.1,
        grace_ms: Callable[[], float | None] | None = None,
        coeffs: Callable[[], Coefficients] | None = None,
    ) -> None:
        """``grace_ms``: the current policy's ``routing.overdue_grace_ms``, read at each
        refresh to log a replica's engine once when its stall starts to be charged and once
        when it no longer is (the views read the grace themselves, at each decision);
        ``coeffs``: the current cost coefficients, with which a stall that this gateway's
        own long prefill explains is not reported (:meth:`InFlight.unexplained_stall_ms`,
        the same rule as the charge)."""
        self.store = store
        self.gateway_id = gateway_id
        self.inflight = inflight
        self._replicas = replicas
        self.interval_s = interval_s
        self._snap: dict[str, SharedLoad] = {}
        self._pushed: dict[str, list[int]] = {}  # what the store holds of ours
        self._task: asyncio.Task[None] | None = None
        self.errors = 0
        self._last_hb = 0.0
        self._grace_ms = grace_ms
        self._coeffs = coeffs
        self.stalled: set[str] = set()  # replicas logged as charged for a stall
        self._skew = ClockSkewLog(log, CLOCK_SKEW_WARN_MS)  # bounded per replica

    def snapshot(self) -> Mapping[str, SharedLoad]:
        return self._snap

    @property
    def skewed(self) -> set[str]:
        """Replicas whose agent's clock is logged as off."""
        return self._skew.off

    async def refresh_once(self) -> None:
        now_ms = int(time.time() * 1000)
        deltas, self.inflight.pending_deltas = self.inflight.pending_deltas, {}
        try:
            for rid, (d_req, d_tok) in list(deltas.items()):
                if d_req or d_tok:
                    await self.store.add_inflight(self.gateway_id, rid, d_req, d_tok, now_ms)
                p = self._pushed.setdefault(rid, [0, 0])
                p[0] += d_req
                p[1] += d_tok
                del deltas[rid]  # written: never retried
            reps = self._replicas()
            gone = self._pushed.keys() - set(reps)
            for rid in gone:
                # removed from the pool: no delta of it comes any more (InFlight.forget),
                # and the store's counts of ours there lapse, no longer heartbeaten
                del self._pushed[rid]
            mono = time.monotonic()
            if mono - self._last_hb > self.store.gateway_ttl_ms / 3000:
                # with our counts as they are: a store that lost them (a Redis restart, a
                # prune) has them back within one heartbeat, where the clamped deltas alone
                # left it short for as long as this gateway was never idle
                # (zero where it sent nothing: a gateway restarted under the same
                # --gateway-id clears what its previous process left there)
                own = {rid: (p[0], p[1]) for rid in reps for p in (self._pushed.get(rid, _NONE),)}
                await self.store.heartbeat(self.gateway_id, reps, now_ms, own)
                self._last_hb = mono
            records = await self.store.snapshot(reps, now_ms)
        except Exception as exc:  # keep routing on the last snapshot
            self.errors += 1
            for rid, d in deltas.items():  # retry only the deltas not yet written
                cur = self.inflight.pending_deltas.setdefault(rid, [0, 0])
                cur[0] += d[0]
                cur[1] += d[1]
            if self.errors % 50 == 1:
                log.warning("load store refresh failed", extra={"error": repr(exc)})
            return
        snap: dict[str, SharedLoad] = {}
        for rid, rec in records.items():
            mine = self._pushed.get(rid, [0, 0])
            snap[rid] = SharedLoad(
                running=rec.num_running,
                waiting=rec.num_waiting,
                kv_usage=rec.kv_usage,
                other_queued_tokens=float(max(0, rec.inflight_prefill_tokens - max(0, mine[1]))),
                other_requests=max(0, rec.inflight_requests - max(0, mine[0])),
                stalled_ms=float(rec.stalled_ms),
                metrics_ts_ms=rec.metrics_ts_ms,
            )
        self._snap = snap
        # only a record there measures the skew (none: unknown, the last word stands)
        self._skew.observe(
            {rid: rec.clock_skew_ms for rid, rec in records.items() if rec.has_engine},
            records.keys(),
        )
        if self._grace_ms is not None:
            self._log_stalls(snap, self._grace_ms())

    def _log_stalls(self, snap: Mapping[str, SharedLoad], grace_ms: float | None) -> None:
        # a long prefill stands vLLM's counters still: only a stall that this gateway's own
        # waiting prefills and the progress it saw do not explain is a warning (it is what
        # the views charge); an explained one is routine with long prompts
        now = time.monotonic()
        coeffs = self._coeffs() if self._coeffs is not None else None
        for rid, sl in snap.items():
            excess = (
                self.inflight.unexplained_stall_ms(rid, sl.stalled_ms, grace_ms, now, coeffs)
                if grace_ms is not None and sl.stalled_ms > grace_ms
                else 0.0
            )
            stalled = excess > 0
            if stalled and rid not in self.stalled:
                self.stalled.add(rid)
                log.warning(
                    "engine busy without progress past the grace, more than this gateway's "
                    "own waiting prefills explain: its traffic is charged the excess",
                    extra={
                        "replica": rid,
                        "stalled_ms": sl.stalled_ms,
                        "grace_ms": grace_ms,
                        "charged_ms": round(excess, 1),
                    },
                )
            elif not stalled and rid in self.stalled:
                self.stalled.discard(rid)
                log.info(
                    "engine stall no longer charged (progressing again, within the grace, "
                    "or explained)",
                    extra={"replica": rid, "stalled_ms": sl.stalled_ms},
                )
        for rid in self.stalled - snap.keys():  # gone from the snapshot: no longer charged
            self.stalled.discard(rid)
            log.info("engine stall no longer reported", extra={"replica": rid})

    async def run(self) -> None:
        while True:
            await self.refresh_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        with contextlib.suppress(Exception):
            await self.store.drop_gateway(self.gateway_id, self._replicas())
