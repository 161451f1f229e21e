"""Where the TTFT tail of a workload comes from, in the simulator: per rule, the pooled TTFT
p99 and mean over seeds, and the same figures for the first fifth of each seed's requests
(where every prefix group is new) and for the rest.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05f/sim_tail.py \
        shared-prefix 0-39 0.85 120 expected_latency,kv_like

Arguments: workload, seeds (``a-b`` or a comma list), load (fraction of least_loaded's
simulated knee), requests per seed, rules: a kvgate strategy, ``kv_like`` (vllm-router
kv_aware's cost as in docs/results/2026-12-05e/sim_strategies.py), ``kv_like_noqueue`` (the
same without the queued prefill: own prefill ms x (requests + 1)), or one of two
expected_latency variants tried and not kept:

- ``el_progress``: a replica's queue wait less the time it has already spent on its current
  backlog (a fluid FCFS queue: the clock starts when a request is sent to an empty queue
  and restarts at each first token), at most the backlog's prefill time;
- ``el_cobatch``: plus own prefill ms x the requests waiting for their first token there (a
  new prefill joins the next engine step with every request waiting for it, and they all
  wait for it), charged as the stall term is (not the request's own latency).
"""

import asyncio
import math
import statistics
import sys
from collections.abc import Sequence
from random import Random
from typing import Any

import cachecore.scoring as scoring
import gateway.routing as routing
from cachecore.traceanalysis import percentile
from gateway.routing import ReplicaScore, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

KV_LIKE = "kv_like"
KV_LIKE_NOQUEUE = "kv_like_noqueue"
EL_PROGRESS = "el_progress"
EL_COBATCH = "el_cobatch"
_cost_terms = scoring.cost_terms


def cobatch_terms(hit: Any, loads: Any, coeffs: Any) -> list[tuple[float, ...]]:
    loads = list(loads)
    out = []
    for (c, q, p, lm, s), ld in zip(_cost_terms(hit, loads, coeffs), loads, strict=True):
        harm = p * max(ld.queued_requests, ld.waiting)
        out.append((c + harm, q, p, lm, s + harm))
    return out


class Progress:
    """el_progress: per replica, since when its current backlog has been served."""

    def __init__(self, sim: Any) -> None:
        self.now = 0.0
        self.since: dict[str, float] = {}
        inflight, tracker = sim.inflight, sim.tracker
        dispatch, first_token, views = inflight.dispatch, inflight.first_token, tracker.views
        route, outputs, fresh = sim._route, sim._outputs, sim._fresh_views

        def p_dispatch(replica: str, tokens: float, expected: float = math.inf) -> Any:
            if inflight.own(replica)[1] == 0:
                self.since[replica] = self.now
            return dispatch(replica, tokens, expected)

        def p_first_token(t: Any) -> None:
            if t.phase == 0:
                self.since[t.replica] = self.now
            first_token(t)

        def p_views(replicas: Any, capacity: Any, now: Any = None, grace: Any = None) -> Any:
            out = views(replicas, capacity, now, grace)
            pt = sim.fit.coefficients().prefill_ms_per_token
            for r, v in out.items():
                if v.queued_requests and r in self.since:
                    served = (self.now - self.since[r]) * 1000.0
                    v.overdue_ms -= min(served, pt * v.queued_prefill_tokens)
            return out

        async def p_route(i: int, item: Any, now: float) -> None:
            self.now = now
            await route(i, item, now)

        def p_outputs(r: int, outs: Any, now: float) -> None:
            self.now = now
            outputs(r, outs, now)

        def p_fresh() -> Any:
            sim._stale.update(sim.ids)  # the credit changes with the clock
            return fresh()

        inflight.dispatch, inflight.first_token, tracker.views = p_dispatch, p_first_token, p_views
        sim._route, sim._outputs, sim._fresh_views = p_route, p_outputs, p_fresh


def kv_like(scores: Sequence[ReplicaScore], rng: Random, queue: bool = True) -> tuple[str, str]:
    cost = [(s.prefill_ms + (s.queue_ms if queue else 0.0)) * (s.requests + 1) for s in scores]
    low = min(cost)
    return rng.choice([s for s, c in zip(scores, cost, strict=True) if c <= low]).replica, KV_LIKE


def seeds_arg(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


def run(rule: str, w: Any, policy: Any) -> list[tuple[int, float]]:
    """(request index, TTFT s) of every request."""
    cfg = SimConfig(
        replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
        strategy=Strategy.LEAST_LOADED if rule in (KV_LIKE, KV_LIKE_NOQUEUE)
        else Strategy.EXPECTED_LATENCY if rule in (EL_PROGRESS, EL_COBATCH)
        else Strategy(rule),
    )  # fmt: skip
    routing.cost_terms = scoring.cost_terms = cobatch_terms if rule == EL_COBATCH else _cost_terms
    sim = FleetSimulator(cfg, policy, w)
    if rule == EL_PROGRESS:
        Progress(sim)
    if rule in (KV_LIKE, KV_LIKE_NOQUEUE):
        rng, queue = sim.router.rng, rule == KV_LIKE
        sim.router._least_loaded = lambda scores: kv_like(scores, rng, queue)  # type: ignore[method-assign]
    got: list[tuple[int, float]] = []
    outputs = sim._outputs

    def recorded(r: int, outs: Any, now: float) -> None:
        for o in outs:
            st = sim._reqs.get(o.request_id)
            if st is not None and o.first_token:
                got.append((int(o.request_id[1:]), now - st.arrival))
        outputs(r, outs, now)

    sim._outputs = recorded  # type: ignore[method-assign]
    asyncio.run(sim.run())
    return got


def main() -> None:
    wl, seeds, load = sys.argv[1], seeds_arg(sys.argv[2]), float(sys.argv[3])
    n, rules = int(sys.argv[4]), sys.argv[5].split(",")
    text = TextSource()
    policy = load_policy(builtin_policy_path("default"))
    knee = simulated_knee(wl, 4, text)
    workloads = [make_workload(wl, n, 4, load * knee, s, text) for s in seeds]
    cut = n // 5
    print(f"{wl}, {len(seeds)} seeds x {n} requests at {load:.0%}; first fifth = requests < {cut}")
    print("| rule | TTFT p99 s | mean s | first fifth: p99 / mean s | the rest: p99 / mean s |")
    print("|---|---|---|---|---|")
    for rule in rules:
        every: list[float] = []
        first: list[float] = []
        rest: list[float] = []
        for w in workloads:
            for i, ttft in run(rule, w, policy):
                every.append(ttft)
                (first if i < cut else rest).append(ttft)
        print(
            f"| {rule} | {percentile(every, 99):.3f} | {statistics.fmean(every):.3f} | "
            f"{percentile(first, 99):.3f} / {statistics.fmean(first):.3f} | "
            f"{percentile(rest, 99):.3f} / {statistics.fmean(rest):.3f} |",
            flush=True,
        )


main()
