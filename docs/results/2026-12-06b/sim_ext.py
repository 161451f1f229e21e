"""expected_latency with and without candidate routing terms (``sim_variants.py``), in the
simulator: per run TTFT p99, and over runs the mean p99, mean TTFT and hit rate.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-06b/sim_ext.py \
        mooncake-groups 0-7 0.85 120 base,ext [router seeds, default 0]
"""

import asyncio
import statistics
import sys
from dataclasses import replace
from typing import Any

from sim_variants import install, seeds_arg

from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy


def run_one(cfg: SimConfig, pol: Any, w: Any, variant: str) -> dict[str, float]:
    sim = FleetSimulator(cfg, pol, w)
    install(sim, variant)
    return asyncio.run(sim.run()).row()


def main() -> None:
    wl, seeds, load, n = sys.argv[1], seeds_arg(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    variants = sys.argv[5].split(",")
    router_seeds = [0] if len(sys.argv) <= 6 else seeds_arg(sys.argv[6])
    text = TextSource()
    pol = load_policy(builtin_policy_path("default"))
    cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE)
    knee = simulated_knee(wl, 4, text)
    works = [make_workload(wl, n, 4, load * knee, s, text) for s in seeds]
    print(f"{wl} at {load:.0%} ({load * knee:.2f} req/s), seeds {seeds}, router {router_seeds}")
    for v in variants:
        rows = [
            run_one(replace(cfg, seed=rs, strategy=Strategy.EXPECTED_LATENCY), pol, w, v)
            for w in works
            for rs in router_seeds
        ]
        p99 = [r["ttft_p99"] for r in rows]
        mean = statistics.fmean(r["ttft_mean"] for r in rows)
        hit = statistics.fmean(r["hit_rate"] for r in rows)
        print(
            f"{v:10s} p99 {statistics.fmean(p99):.3f} mean {mean:.3f} hit {hit:.2%} | per run "
            + " ".join(f"{x:.3f}" for x in p99)
            + " | hit per run "
            + " ".join(f"{r['hit_rate']:.1%}" for r in rows),
            flush=True,
        )


main()
