"""Hit rate, TTFT mean / p99 and end-to-end p99 of kvgate strategies in the simulator (4
replicas, 8b-h100, 4,096 blocks each, the shipped policy), with the pooled-LRU bound.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05e/sim_strategies.py \
        mooncake 0,1,2,3,4 0.85 expected_latency,prefix_affinity 600

Arguments: workload, seeds, load (fraction of least_loaded's simulated knee), strategies,
requests per seed (default 120).
"""

import asyncio
import sys

from cachecore.engine.latency import get_profile
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee, workload_bounds
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

wl, seeds, load = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3])
strategies = sys.argv[4].split(",")
n_requests = int(sys.argv[5]) if len(sys.argv) > 5 else 120
text = TextSource()
policy = load_policy(builtin_policy_path("default"))
knee = simulated_knee(wl, 4, text)
for seed in seeds:
    w = make_workload(wl, n_requests, 4, load * knee, seed, text)
    bound = workload_bounds(w, 4 * 4096, get_profile("8b-h100")).fleet_lru
    for st in strategies:
        cfg = SimConfig(
            replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
            strategy=Strategy(st),
        )  # fmt: skip
        row = asyncio.run(FleetSimulator(cfg, policy, w).run()).row()
        names = ("hit_rate", "ttft_mean", "ttft_p99", "e2e_p99")
        cols = " ".join(f"{k} {row[k]:.4f}" for k in names)
        print(seed, st, f"bound {bound:.2%}", cols)
