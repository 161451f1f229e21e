"""The chunked-prefill budget and mooncake-groups' tail: vLLM's default budget (8,192
tokens, as long as the longest prompt) against 8,192 + 256, at the same offered rate (85% of
the default engine's knee), in the simulator, 4 replicas, 2 router seeds each:

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04e/sim_budget.py 0,1,2,3,4
"""

import asyncio
import statistics
import sys
from dataclasses import replace

from cachecore.engine.latency import PROFILES
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

seeds = [int(x) for x in sys.argv[1].split(",")]
base = PROFILES["8b-h100"]
wide = base.with_overrides(name="8b-h100-b8448", max_num_batched_tokens=8192 + 256)
PROFILES[wide.name] = wide  # this script's process only
text = TextSource()
pol = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile=base.name, num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
rate = 0.85 * simulated_knee("mooncake-groups", 4, text)
agg: dict[str, list[tuple[float, float]]] = {}
for seed in seeds:
    w = make_workload("mooncake-groups", 120, 4, rate, seed, text)
    for prof in (base.name, wide.name):
        for st in (Strategy.EXPECTED_LATENCY, Strategy.PREFIX_AFFINITY):
            for sd in (0, 1):
                c = replace(cfg, profile=prof, strategy=st, seed=sd)
                r = asyncio.run(FleetSimulator(c, pol, w).run()).row()
                agg.setdefault(f"{prof} {st.value}", []).append((r["ttft_mean"], r["ttft_p99"]))
print(f"mooncake-groups at {rate:.2f} requests/s, seeds {seeds}")
for name, rows in agg.items():
    m, p = zip(*rows, strict=True)
    print(f"  {name:36s} mean {statistics.mean(m):.3f} p99 {statistics.mean(p):.3f}")
