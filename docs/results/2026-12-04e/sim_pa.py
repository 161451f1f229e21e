"""prefix_affinity (before / after D13's smallest tree: run it in a worktree of each),
expected_latency and least_loaded in the simulator, 4 replicas, 2 router seeds each:

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04e/sim_pa.py \
        mooncake-groups 120 0,1,2,3,4 0.85
    ... shared-prefix 200 0,1,2 0.85 | shared-prefix 200 0,1,2 0.5 | hot-prefix 200 0,1,2 0.85
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

wl, n = sys.argv[1], int(sys.argv[2])
seeds = [int(x) for x in sys.argv[3].split(",")]
load = float(sys.argv[4]) if len(sys.argv) > 4 else 0.85
text = TextSource()
pol = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
knee = simulated_knee(wl, 4, text)
rate = load * knee
agg: dict[str, list[tuple[float, float, float]]] = {}
for seed in seeds:
    w = make_workload(wl, n, 4, rate, seed, text)
    for st in (Strategy.PREFIX_AFFINITY, Strategy.EXPECTED_LATENCY, Strategy.LEAST_LOADED):
        for sd in (0, 1):
            sim = FleetSimulator(replace(cfg, strategy=st, seed=sd), pol, w)
            r = asyncio.run(sim.run()).row()
            agg.setdefault(st.value, []).append((r["hit_rate"], r["ttft_mean"], r["ttft_p99"]))
print(f"{wl} load {load} knee {knee:.2f} seeds {seeds}")
for name, rows in agg.items():
    h, m, p = zip(*rows, strict=True)
    print(
        f"  {name:18s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
        f"p99 {statistics.mean(p):.3f} (med {statistics.median(p):.3f})"
    )
