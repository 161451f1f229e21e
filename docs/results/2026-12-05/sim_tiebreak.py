"""expected_latency's miss tie-break, random rounds (D9) against the per-scope smallest tree
(D14), in the simulator: 4 replicas, 2 router seeds per workload seed.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05/sim_tiebreak.py \
        shared-prefix 200 0,1,2,3,4 0.85
    ... shared-prefix 200 5,6,7,8,9 0.85 | shared-prefix 200 0,1,2,3,4 0.5 |
        shared-prefix 200 5,6,7,8,9 0.5 | hot-prefix 200 0,1,2 0.85 | hot-prefix 200 3,4,5 0.85 |
        mooncake-groups 120 0,1,2,3,4 0.85 | mooncake-groups 120 5,6,7,8,9 0.85 |
        short-unique 200 0,1,2 0.85 | short-unique 200 3,4,5 0.85 | short-unique 200 0,1,2 0.5 |
        tenant-mix 200 0,1,2 0.85
"""

import asyncio
import statistics
import sys
from dataclasses import replace

from gateway.routing import MissTieBreak, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

wl, n = sys.argv[1], int(sys.argv[2])
seeds = [int(x) for x in sys.argv[3].split(",")]
load = float(sys.argv[4])
text = TextSource()
pol = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
knee = simulated_knee(wl, 4, text)
agg: dict[str, list[tuple[float, float, float]]] = {}
for seed in seeds:
    w = make_workload(wl, n, 4, load * knee, seed, text)
    for tie in MissTieBreak:
        for sd in (0, 1):
            sim = FleetSimulator(replace(cfg, strategy=Strategy.EXPECTED_LATENCY, seed=sd), pol, w)
            sim.router.params = replace(sim.router.params, miss_tie_break=tie)
            r = asyncio.run(sim.run()).row()
            agg.setdefault(tie.value, []).append((r["hit_rate"], r["ttft_mean"], r["ttft_p99"]))
print(f"{wl} load {load} knee {knee:.2f} seeds {seeds}")
for name, rows in agg.items():
    h, m, p = zip(*rows, strict=True)
    print(
        f"  {name:12s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
        f"p99 {statistics.mean(p):.3f} (med {statistics.median(p):.3f})"
    )
