"""The shared-prefix tail at 50% load in the simulator (4 replicas, 120 requests per seed,
the shipped policy; the same engine and router as the HTTP fleet). Three studies:

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05b/sim_sp50.py slow 0,1,2
        the four slowest requests per seed, with the decision's per-replica costs
        (replica, cost, queue, prefill, recompute, stall ms)
    ... sim_sp50.py recompute 0,1,2,3,4 fixed,zero,busy,busy2,half
        the recompute charge (D12) scaled: x1, x0, x the fleet's busy fraction (replicas
        with a queued prefill), x min(1, 2 busy), x0.5
    ... sim_sp50.py guard 0,1,2,3,4 none,0.05,0.1,0.25
        a guard: no replica whose predicted TTFT is more than that fraction above the
        request's best (the stall and recompute terms may not cost it more)

Each variant is applied by wrapping ``Router._score`` in this process only.
"""

import asyncio
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cachecore.engine.latency import get_profile
from gateway.routing import Router, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

WORKLOAD, REQUESTS, LOAD = "shared-prefix", 120, 0.5
TEXT = TextSource()
POLICY = load_policy(builtin_policy_path("default"))
CFG = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE)
KNEE = simulated_knee(WORKLOAD, 4, TEXT)
ORIGINAL_SCORE = Router._score


def workload(seed: int) -> Any:
    return make_workload(WORKLOAD, REQUESTS, 4, LOAD * KNEE, seed, TEXT)


def slow(seeds: list[int]) -> None:
    profile = get_profile("8b-h100")
    for seed in seeds:
        sim = FleetSimulator(CFG, POLICY, workload(seed))
        decisions: list[Any] = []
        decide = sim.router.decide

        def recording(*args: Any, decide: Any = decide, decisions: Any = decisions) -> Any:
            d = decide(*args)
            decisions.append(d)
            return d

        sim.router.decide = recording  # type: ignore[method-assign]
        rows: list[tuple[Any, ...]] = []
        outputs = sim._outputs

        def first_tokens(
            r: int, outs: Any, now: float, sim: Any = sim, rows: Any = rows, outputs: Any = outputs
        ) -> None:
            for out in outs:
                st = sim._reqs.get(out.request_id)
                if st is not None and out.first_token:
                    alone = profile.ttft_alone(st.prompt_tokens, out.num_cached_tokens)
                    rows.append((now - st.arrival, int(out.request_id[1:]), st, out, alone))
            outputs(r, outs, now)

        sim._outputs = first_tokens  # type: ignore[method-assign]
        res = asyncio.run(sim.run()).row()
        print(f"seed {seed}: hit {res['hit_rate']:.1%} mean {res['ttft_mean']:.3f} "
              f"p99 {res['ttft_p99']:.3f}")  # fmt: skip
        for ttft, i, st, out, alone in sorted(rows, key=lambda x: -x[0])[:4]:
            lv = st.load_at_dispatch
            print(f"  ttft {ttft:.3f} (alone {alone:.3f}) t={st.arrival:.2f} r{st.replica} "
                  f"prompt {st.prompt_tokens} cached {out.num_cached_tokens}; its replica "
                  f"queued {lv.queued_prefill_tokens:.0f} tokens, "
                  f"running {lv.running}")  # fmt: skip
            d = decisions[i]
            print("   ", d.reason, [(s.replica, round(s.cost_ms), round(s.queue_ms),
                                     round(s.prefill_ms), round(s.recompute_ms),
                                     round(s.stall_ms)) for s in d.scores])  # fmt: skip


def compare(seeds: list[int], variants: dict[str, Callable[[Any, Any, Any, Any], Any]]) -> None:
    agg: dict[str, list[tuple[float, float, float]]] = {}
    for seed in seeds:
        w = workload(seed)
        for name, score in variants.items():
            Router._score = score  # type: ignore[method-assign]
            for router_seed in (0, 1):
                cfg = replace(CFG, strategy=Strategy.EXPECTED_LATENCY, seed=router_seed)
                r = asyncio.run(FleetSimulator(cfg, POLICY, w).run()).row()
                agg.setdefault(name, []).append((r["hit_rate"], r["ttft_mean"], r["ttft_p99"]))
    Router._score = ORIGINAL_SCORE  # type: ignore[method-assign]
    print(f"{WORKLOAD} load {LOAD} knee {KNEE:.2f} seeds {seeds}, 2 router seeds each")
    for name, rows in agg.items():
        h, m, p = zip(*rows, strict=True)
        print(f"  {name:8s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
              f"p99 {statistics.mean(p):.3f} (median {statistics.median(p):.3f})")  # fmt: skip


def busy_fraction(cands: Any) -> float:
    return sum(1 for c in cands if c.load.queued_requests or c.load.waiting) / len(cands)


def scaled_recompute(scale: Callable[[float], float]) -> Callable[[Any, Any, Any, Any], Any]:
    def score(self: Any, req: Any, cands: Any, coeffs: Any) -> Any:
        weight = coeffs.recompute_weight * scale(busy_fraction(cands))
        return ORIGINAL_SCORE(self, req, cands, replace(coeffs, recompute_weight=weight))

    return score


def guarded(fraction: float | None) -> Callable[[Any, Any, Any, Any], Any]:
    def score(self: Any, req: Any, cands: Any, coeffs: Any) -> Any:
        out = ORIGINAL_SCORE(self, req, cands, coeffs)
        if fraction is not None:
            best = min(s.ttft_ms for s in out if s.eligible)
            for s in out:
                if s.eligible and s.ttft_ms > best * (1 + fraction):
                    s.eligible = False
        return out

    return score


SCALES: dict[str, Callable[[float], float]] = {
    "fixed": lambda b: 1.0,
    "zero": lambda b: 0.0,
    "busy": lambda b: b,
    "busy2": lambda b: min(1.0, 2 * b),
    "half": lambda b: 0.5,
}

if __name__ == "__main__":
    study, seeds = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    if study == "slow":
        slow(seeds)
    elif study == "recompute":
        compare(seeds, {v: scaled_recompute(SCALES[v]) for v in sys.argv[3].split(",")})
    elif study == "guard":
        names = sys.argv[3].split(",")
        compare(seeds, {v: guarded(None if v == "none" else float(v)) for v in names})
    else:
        raise SystemExit(f"unknown study {study!r}")
