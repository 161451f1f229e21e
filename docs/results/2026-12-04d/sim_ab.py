"""expected_latency before D12 ("old": spill 2,000 ms, no recompute charge), after ("new":
the shipped default policy) and latency-first, in the simulator, on held-out seeds:

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04d/sim_ab.py mooncake-groups 120 5,6,7,8,9
    ... shared-prefix | hot-prefix | long-prefix-pressure 200 3,4,5
    ... shared-prefix | mooncake-groups 160 3,4       (latency-first without its spill)

The first runs' latency-first still had its 0.5 s spill; the last ones had it off.
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
load = float(sys.argv[4]) if len(sys.argv) > 4 else 0.85
text = TextSource()
new = load_policy(builtin_policy_path("default"))
old = new.model_copy(
    update={
        "routing": new.routing.model_copy(update={"spill_queue_ms": 2000.0}),
        "cost": new.cost.model_copy(update={"recompute_weight": 0.0}),
    }
)
lf = load_policy(builtin_policy_path("latency-first"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
knee = simulated_knee(wl, 4, text)
rate = load * knee
print(f"{wl} knee {knee:.2f} rate {rate:.2f} seeds {seeds}")
agg = {}
for seed in seeds:
    w = make_workload(wl, n, 4, rate, seed, text)
    for name, pol in (("old", old), ("new", new), ("latency-first", lf)):
        for sd in (0, 1):
            r = asyncio.run(
                FleetSimulator(
                    replace(cfg, strategy=Strategy.EXPECTED_LATENCY, seed=sd), pol, w
                ).run()
            ).row()
            agg.setdefault(name, []).append(
                (r["hit_rate"], r["ttft_mean"], r["ttft_p99"], r["e2e_p99"])
            )
for v, rows in agg.items():
    h, m, p, e = zip(*rows, strict=False)
    print(
        f"{v:14s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
        f"p99 {statistics.mean(p):.3f} (med {statistics.median(p):.3f}) "
        f"e2e99 {statistics.mean(e):.2f}"
    )
