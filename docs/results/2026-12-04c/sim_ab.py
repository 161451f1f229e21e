"""Simulator A/B used for D10: the benchmark's workloads (``make_workload``, as
``kvgate bench routers`` builds them) through ``FleetSimulator`` on 4 replicas, with the
shipped policy and ``cost.stall_weight`` overridden by ``STALL`` when set.

From the repository root::

    STALL=0    .venv/bin/python docs/results/2026-12-04c/sim_ab.py expected_latency \
        6,7,8,9,10,11 120 7.39 shared-prefix
    STALL=0.15 .venv/bin/python docs/results/2026-12-04c/sim_ab.py expected_latency \
        6,7,8,9,10,11 120 7.39 shared-prefix

Arguments: strategies, seeds, requests, rate (req/s), workload.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.getcwd())

from gateway.routing import Strategy
from loadtest.bench_routers import make_workload
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


def main() -> None:
    strategies = sys.argv[1].split(",")
    seeds = [int(s) for s in sys.argv[2].split(",")]
    requests, rate, workload = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    pol = load_policy(builtin_policy_path("default"))
    if "STALL" in os.environ:
        cost = pol.cost.model_copy(update={"stall_weight": float(os.environ["STALL"])})
        pol = pol.model_copy(update={"cost": cost})
    text = TextSource()
    rows: dict[str, list[tuple[float, float, float]]] = {}
    for seed in seeds:
        w = make_workload(workload, requests, 4, rate, seed, text)
        for s in strategies:
            cfg = replace(SimConfig(replicas=4, num_blocks=4096), strategy=Strategy(s), seed=seed)
            r = asyncio.run(FleetSimulator(cfg, pol, w).run())
            row = (statistics.fmean(r.ttft), pct(r.ttft, 99), pct(r.e2e, 99))
            rows.setdefault(s, []).append(row)
            hit = r.cached_tokens / max(1, r.prompt_tokens)
            print(f"seed {seed} {s:18s} mean {row[0]:.3f} p99 {row[1]:.3f} e2e99 {row[2]:.2f}"
                  f" hit {hit:.3f} per-replica {r.per_replica_requests}")  # fmt: skip
    for s, rs in rows.items():
        mean, p99, e2e = (statistics.fmean(x[i] for x in rs) for i in range(3))
        print(f"ALL {s:18s} mean {mean:.3f} p99 {p99:.3f} e2e99 {e2e:.2f}")


if __name__ == "__main__":
    main()
