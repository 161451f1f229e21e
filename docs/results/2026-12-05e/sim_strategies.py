"""Hit rate, TTFT mean / p99 and end-to-end p99 of routing rules in the simulator (4
replicas, 8b-h100, 4,096 blocks each, the shipped policy), per seed with the pooled-LRU
bound, then the means over seeds.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05e/sim_strategies.py \
        mooncake 0,1,2,3,4 0.85 expected_latency,prefix_affinity 600
    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05e/sim_strategies.py \
        shared-prefix 0,1,2,3,4,5 0.85 expected_latency,kv_like

Arguments: workload, seeds, load (fraction of least_loaded's simulated knee), rules, requests
per seed (default 120). A rule is a kvgate strategy or ``kv_like``: vllm-router kv_aware's
cost, the lowest (own uncached prefill ms + queued prefill ms) x (requests on the replica +
1), at random among equals, from the same scores expected_latency computes.
"""

import asyncio
import statistics
import sys
from collections.abc import Sequence
from random import Random

from cachecore.engine.latency import get_profile
from gateway.routing import ReplicaScore, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee, workload_bounds
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

KV_LIKE = "kv_like"


def kv_like(scores: Sequence[ReplicaScore], rng: Random) -> tuple[str, str]:
    cost = [(s.prefill_ms + s.queue_ms) * (s.requests + 1) for s in scores]
    low = min(cost)
    return rng.choice([s for s, c in zip(scores, cost, strict=True) if c <= low]).replica, KV_LIKE


wl, seeds, load = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3])
rules = sys.argv[4].split(",")
n_requests = int(sys.argv[5]) if len(sys.argv) > 5 else 120
text = TextSource()
policy = load_policy(builtin_policy_path("default"))
knee = simulated_knee(wl, 4, text)
cols = ("hit_rate", "ttft_mean", "ttft_p99", "e2e_p99")
rows: dict[str, list[dict[str, float]]] = {}
bounds: list[float] = []
for seed in seeds:
    w = make_workload(wl, n_requests, 4, load * knee, seed, text)
    bound = workload_bounds(w, 4 * 4096, get_profile("8b-h100")).fleet_lru
    bounds.append(bound)
    for rule in rules:
        # kv_like takes least_loaded's place in the router (same scores, its own choice)
        cfg = SimConfig(
            replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
            strategy=Strategy.LEAST_LOADED if rule == KV_LIKE else Strategy(rule),
        )  # fmt: skip
        sim = FleetSimulator(cfg, policy, w)
        if rule == KV_LIKE:
            rng = sim.router.rng
            sim.router._least_loaded = lambda scores, rng=rng: kv_like(scores, rng)  # type: ignore[method-assign]
        row = asyncio.run(sim.run()).row()
        rows.setdefault(rule, []).append(row)
        print(seed, rule, f"bound {bound:.2%}", " ".join(f"{k} {row[k]:.4f}" for k in cols))
print(f"mean over seeds: bound {statistics.fmean(bounds):.2%}")
for rule, rs in rows.items():
    print(f"  {rule}: " + " ".join(f"{k} {statistics.fmean(r[k] for r in rs):.4f}" for k in cols))
