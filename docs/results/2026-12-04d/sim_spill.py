"""Simulator sweep of the spill bound (seventh session, before D12; run from the repo root
with the .venv's python). Variants: a spill_queue_ms value, "none", "pa" (prefix_affinity),
"ll" (least_loaded); 4 replicas, 85% of least_loaded's knee unless a load is given:

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04d/sim_spill.py \
        mooncake-groups 120 0,1,2,3,4 2000,none,6000,pa,ll
    ... hot-prefix 200 0,1,2 2000,none,6000,ll        (and with a 6th argument 1.0, 1.2)
    ... shared-prefix 200 0,1,2 2000,none,6000,ll
    ... mooncake 120 0,1,2,3,4 2000,none

The first run had the absolute spill rule; later runs the relative one (commit 0dc34e4).
"""

import asyncio
import statistics
import sys
from dataclasses import replace

from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

wl = sys.argv[1]
n = int(sys.argv[2])
seeds = [int(x) for x in sys.argv[3].split(",")]
variants = sys.argv[4].split(",")
text = TextSource()
base = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
knee = simulated_knee(wl, 4, text)
rate = float(sys.argv[5]) * knee if len(sys.argv) > 5 else 0.85 * knee
print(f"{wl} knee {knee:.2f} rate {rate:.2f}")
agg = {}
for seed in seeds:
    w = make_workload(wl, n, 4, rate, seed, text)
    for v in variants:
        if v == "ll":
            pol, strat = base, Strategy.LEAST_LOADED
        elif v == "pa":
            pol, strat = base, Strategy.PREFIX_AFFINITY
        else:
            sp = None if v == "none" else float(v)
            pol = base.model_copy(
                update={"routing": base.routing.model_copy(update={"spill_queue_ms": sp})}
            )
            strat = Strategy.EXPECTED_LATENCY
        for sd in (0, 1):
            r = asyncio.run(
                FleetSimulator(replace(cfg, strategy=strat, seed=sd), pol, w).run()
            ).row()
            agg.setdefault(v, []).append(
                (r["hit_rate"], r["ttft_mean"], r["ttft_p99"], r["e2e_p99"])
            )
for v, rows in agg.items():
    h, m, p, e = zip(*rows, strict=False)
    print(
        f"{v:6s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
        f"p99 {statistics.mean(p):.3f} (med {statistics.median(p):.3f}) "
        f"e2e99 {statistics.mean(e):.2f}"
    )
