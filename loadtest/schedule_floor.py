"""The schedule floor: a TTFT percentile no router can beat on a given fleet and workload,
counting the queueing that the workload's arrivals force, not only each request alone.

The alone floor (:func:`loadtest.bench_routers.workload_bounds`) gives each request an idle
replica. When many cold prefills arrive together that is far below anything reachable: four
replicas cannot each serve three 0.5 s prefills that land in the same second in 0.5 s. This
module bounds what a clairvoyant router could do, by a relaxation of the engine model
(:mod:`cachecore.engine.latency`) that only ever makes scheduling easier:

- a request's prefill is its uncached tokens under the *infinite* cache (every block any
  earlier request holds counts as cached, even before that request has computed it);
- a replica computes prefill tokens at ``1 / prefill_per_token`` tokens a second at most
  (a step computing P tokens lasts ``overhead + P x per_token``), and a request's tokens
  cannot start before one step overhead after its arrival (it joins the next step, whose
  overhead comes first); decode costs nothing; no HTTP time;
- the work is preemptive and migrates freely between replicas (a request is served by at
  most one replica at a time, but by any one at any moment).

Under that relaxation, "every request but ``k`` of them has TTFT <= x" is a mixed-integer
feasibility problem over time intervals (Horn's flow construction for P|pmtn,r_j|Lmax, with
a binary per request that may be dropped): each request's prefill time is spread over the
intervals inside ``[arrival + overhead, arrival + x]``, at most an interval's length per
request and ``replicas`` x its length per interval, unless the request is one of the ``k``
dropped. A maximum flow (no drops) settles most ``x`` at once: no deficit is feasible, a
deficit above the ``k`` largest prefills is not; HiGHS solves the rest. The smallest
feasible ``x``, bisected, is a lower bound on the nearest-rank percentile that leaves ``k``
requests above it. The flow runs on integer microseconds, rounded so that every rounding
makes the test easier to pass, and the solver's tolerances can only do the same (the bound
stays a bound).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array, csr_array
from scipy.sparse.csgraph import maximum_flow

from cachecore.engine.latency import LatencyProfile

_US = 1_000_000
_RESOLUTION_S = 0.0005  # bisection stops within half a millisecond
_MILP_INFEASIBLE = 2  # scipy.optimize.milp's status for a proven infeasible problem
_MILP_OPTIMAL = 0
_MILP_NODE_LIMIT = 200  # branch-and-bound nodes per call: a limit that does not depend on the clock
_MILP_TIME_LIMIT_S = 30.0  # a backstop; past either limit the LP relaxation decides
_MILP_MAX_REQUESTS = 1_000  # beyond this only the LP relaxation is tried
_MAX_CAPACITY = 2**31 - 1  # the max-flow solver's 32-bit capacities


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """One request as the relaxation sees it."""

    arrival_s: float
    work_s: float  # uncached prefill tokens x per-token time (no overhead)


def prefill_jobs(
    arrivals_s: Sequence[float], uncached_tokens: Sequence[int], profile: LatencyProfile
) -> list[PrefillJob]:
    if len(arrivals_s) != len(uncached_tokens):
        raise ValueError("one arrival per request")
    return [
        PrefillJob(t, max(0, n) * profile.prefill_per_token_s)
        for t, n in zip(arrivals_s, uncached_tokens, strict=True)
    ]


def deficit_s(jobs: Sequence[PrefillJob], replicas: int, overhead_s: float, ttft_s: float) -> float:
    """Prefill seconds that no preemptive, migrating schedule on ``replicas`` can finish when
    each request's tokens must run within ``[arrival + overhead, arrival + ttft]``."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if ttft_s <= overhead_s:
        return sum(j.work_s for j in jobs)
    # time in whole units of ``unit`` us, a microsecond unless the work would overflow the
    # solver's capacities: works and window starts rounded down, window ends up (every
    # rounding only helps); no edge needs more than the whole work, so that caps them all
    unit = max(1, math.ceil(sum(j.work_s for j in jobs) * _US / _MAX_CAPACITY))
    scale = _US / unit
    work = [math.floor(j.work_s * scale) for j in jobs]
    total = sum(work)
    if total == 0:
        return 0.0
    starts = np.array([math.floor((j.arrival_s + overhead_s) * scale) for j in jobs], np.int64)
    ends = np.array([math.ceil((j.arrival_s + ttft_s) * scale) for j in jobs], np.int64)
    job, interval, lengths = _edges(starts, ends)
    n, k = len(jobs), len(lengths)
    source, sink = 0, n + k + 1
    rows = np.concatenate([np.zeros(n, np.int64), job + 1, np.arange(n + 1, n + k + 1)])
    cols = np.concatenate([np.arange(1, n + 1), interval + n + 1, np.full(k, sink, np.int64)])
    caps = np.concatenate([np.array(work, np.int64), lengths[interval], lengths * replicas])
    cap = np.minimum(caps, total)  # more than the whole work never flows
    graph = csr_array((cap.astype(np.int32), (rows, cols)), shape=(n + k + 2, n + k + 2))
    flow = int(maximum_flow(graph, source, sink).flow_value)
    return (total - flow) / scale


@dataclass(frozen=True, slots=True)
class _Windows:
    """The job -> interval edges of one TTFT bound, in milliseconds."""

    job: np.ndarray  # per edge: its job
    interval: np.ndarray  # per edge: its interval
    length_ms: np.ndarray  # per interval
    work_ms: np.ndarray  # per job


def _edges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The time intervals between every window's start and end points, and the edges from
    each job to the intervals inside its window ``[starts[j], ends[j]]``: (per edge its job,
    per edge its interval, per interval its length)."""
    points = np.unique(np.concatenate([starts, ends]))
    first, last = np.searchsorted(points, starts), np.searchsorted(points, ends)
    counts = np.maximum(last - first, 0)  # the intervals inside each job's window
    job = np.repeat(np.arange(len(starts), dtype=np.int64), counts)
    begin = np.repeat(np.cumsum(counts) - counts, counts)  # each job's first edge
    interval = np.arange(len(job), dtype=np.int64) - begin + np.repeat(first, counts)
    return job, interval.astype(np.int64), np.diff(points)


def _windows(jobs: Sequence[PrefillJob], overhead_s: float, ttft_s: float) -> _Windows:
    starts = np.array([j.arrival_s + overhead_s for j in jobs]) * 1000.0
    ends = np.array([j.arrival_s + ttft_s for j in jobs]) * 1000.0
    job, interval, lengths = _edges(starts, ends)
    return _Windows(job, interval, lengths, np.array([j.work_s * 1000.0 for j in jobs]))


def _feasible_with_drops(w: _Windows, replicas: int, exceptions: int) -> bool:
    """HiGHS: can every job but ``exceptions`` of them get its work inside its window? With
    whole jobs dropped (a MILP, time-limited) where that is affordable, else, or when the
    MILP stops short, with fractions of jobs (its LP relaxation: feasible whenever the MILP
    is, so the answer errs towards feasible and the floor stays a bound)."""
    n, k, e = len(w.work_ms), len(w.length_ms), len(w.job)
    edges = np.arange(e)
    jobs = np.arange(n)
    # variables: one flow per edge, then one drop binary per job
    per_job = coo_array(
        (np.concatenate([np.ones(e), w.work_ms]), (np.concatenate([w.job, jobs]),
         np.concatenate([edges, e + jobs]))), shape=(n, e + n),
    )  # fmt: skip
    per_interval = coo_array((np.ones(e), (w.interval, edges)), shape=(k, e + n))
    drops = coo_array((np.ones(n), (np.zeros(n, np.int64), e + jobs)), shape=(1, e + n))
    constraints = [
        LinearConstraint(per_job, lb=w.work_ms, ub=np.inf),
        LinearConstraint(per_interval, lb=0, ub=w.length_ms * replicas),
        LinearConstraint(drops, lb=0, ub=exceptions),
    ]
    bounds = Bounds(0, np.concatenate([w.length_ms[w.interval], np.ones(n)]))
    options = {"time_limit": _MILP_TIME_LIMIT_S, "node_limit": _MILP_NODE_LIMIT}
    if n <= _MILP_MAX_REQUESTS:
        whole = np.concatenate([np.zeros(e), np.ones(n)])
        res = milp(np.zeros(e + n), constraints=constraints, integrality=whole,
                   bounds=bounds, options=options)  # fmt: skip
        if res.status in (_MILP_OPTIMAL, _MILP_INFEASIBLE):
            return bool(res.status == _MILP_OPTIMAL)
    res = milp(np.zeros(e + n), constraints=constraints, bounds=bounds, options=options)
    # only a proof of infeasibility rejects x: a solver that stops short (a limit, a
    # numerical failure) must not raise the bound
    return bool(res.status != _MILP_INFEASIBLE)


def _list_schedule_ttft(jobs: Sequence[PrefillJob], replicas: int, overhead_s: float) -> float:
    """The largest TTFT of one real schedule of the relaxation (each request in arrival
    order, whole, to the replica that finishes it first): a TTFT every request can meet,
    so where the bisection may start instead of the whole work's span."""
    free = [0.0] * replicas
    worst = overhead_s
    for j in sorted(jobs, key=lambda j: j.arrival_s):
        start = j.arrival_s + overhead_s
        r = min(range(replicas), key=lambda i: max(free[i], start))
        free[r] = max(free[r], start) + j.work_s
        worst = max(worst, free[r] - j.arrival_s)
    return worst


def schedule_floor_s(
    jobs: Sequence[PrefillJob], replicas: int, overhead_s: float, exceptions: int = 0
) -> float:
    """A lower bound on the TTFT that all requests but ``exceptions`` of them can meet on
    ``replicas`` (module docstring): the largest bisected TTFT the relaxation rejects."""
    if not jobs:
        return math.nan
    if exceptions >= len(jobs):
        return 0.0
    works = sorted((math.floor(j.work_s * _US) for j in jobs), reverse=True)
    allowance = sum(works[:exceptions])

    def feasible(x: float) -> bool:
        short = deficit_s(jobs, replicas, overhead_s, x) * _US
        if short == 0 or exceptions == 0 or short > allowance:
            return short == 0
        return _feasible_with_drops(_windows(jobs, overhead_s, x), replicas, exceptions)

    lo, hi = overhead_s, _list_schedule_ttft(jobs, replicas, overhead_s) + _RESOLUTION_S
    if feasible(lo):
        return lo
    while hi - lo > _RESOLUTION_S:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo


def percentile_exceptions(n: int, q: float) -> int:
    """Requests a nearest-rank ``q`` percentile of ``n`` values leaves above it
    (:func:`cachecore.traceanalysis.percentile`): 1 for the p99 of 120 to 199 requests."""
    return n - max(1, math.ceil(q / 100.0 * n))


def schedule_floor_percentile_s(
    jobs: Sequence[PrefillJob], replicas: int, overhead_s: float, q: float
) -> float:
    """No router's nearest-rank ``q`` percentile of TTFT over these requests is below this."""
    return schedule_floor_s(jobs, replicas, overhead_s, percentile_exceptions(len(jobs), q))
