"""expected_latency against a vllm-router kv_aware-like rule in the simulator (4 replicas,
120 requests per seed, the bench's windows and load point): the kv-like rule takes the
lowest (own uncached prefill ms + queued prefill ms) x (requests on the replica + 1), at
random among equals, from the same scores expected_latency computes.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05e/sim_kv_like.py \
        shared-prefix 0,1,2,3,4,5 0.85
"""

import asyncio
import statistics
import sys
from collections.abc import Sequence
from random import Random

from gateway.routing import ReplicaScore, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

wl, seeds, load = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3])
text = TextSource()
policy = load_policy(builtin_policy_path("default"))
knee = simulated_knee(wl, 4, text)
cols = ("hit_rate", "ttft_mean", "ttft_p99")
rows: dict[str, list[dict[str, float]]] = {}
for seed in seeds:
    w = make_workload(wl, 120, 4, load * knee, seed, text)
    for name in ("expected_latency", "kv_like"):
        kv = name == "kv_like"
        cfg = SimConfig(
            replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
            strategy=Strategy.LEAST_LOADED if kv else Strategy.EXPECTED_LATENCY,
        )  # fmt: skip
        sim = FleetSimulator(cfg, policy, w)
        if kv:

            def kv_like(
                scores: Sequence[ReplicaScore], rng: Random = sim.router.rng
            ) -> tuple[str, str]:
                cost = [(s.prefill_ms + s.queue_ms) * (s.requests + 1) for s in scores]
                low = min(cost)
                return rng.choice(
                    [s for s, c in zip(scores, cost, strict=True) if c <= low]
                ).replica, "kv_like"

            sim.router._least_loaded = kv_like  # type: ignore[method-assign]
        row = asyncio.run(sim.run()).row()
        rows.setdefault(name, []).append(row)
        print(seed, name, " ".join(f"{k} {row[k]:.3f}" for k in cols), flush=True)
for name, rs in rows.items():
    means = " ".join(f"{k} {statistics.fmean(r[k] for r in rs):.3f}" for k in cols)
    print(f"{name}, mean over seeds: {means}")
