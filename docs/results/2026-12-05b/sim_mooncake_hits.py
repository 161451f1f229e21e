"""Where the mooncake windows' hits go, in the simulator (4 replicas, 120 requests at 85% of
least_loaded's knee, the shipped policy): the hit rate against the fleet-capacity bound, and
how many tokens of hits expected_latency gave up by routing away from the replica with the
best predicted match (the rest of the gap is per-replica LRUs evicting what one pooled
cache of the same size would keep).

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05b/sim_mooncake_hits.py 0,1
"""

import asyncio
import sys
from typing import Any

from cachecore.engine.latency import get_profile
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee, workload_bounds
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

seeds = [int(x) for x in sys.argv[1].split(",")]
text = TextSource()
policy = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
                strategy=Strategy.EXPECTED_LATENCY)  # fmt: skip
knee = simulated_knee("mooncake", 4, text)
for seed in seeds:
    w = make_workload("mooncake", 120, 4, 0.85 * knee, seed, text)
    bound = workload_bounds(w, 4 * 4096, get_profile("8b-h100")).fleet_lru
    sim = FleetSimulator(cfg, policy, w)
    decisions: list[Any] = []
    decide = sim.router.decide

    def recording(*args: Any, decide: Any = decide, decisions: list[Any] = decisions) -> Any:
        d = decide(*args)
        decisions.append(d)
        return d

    sim.router.decide = recording  # type: ignore[method-assign]
    res = asyncio.run(sim.run())
    away = sum(
        max(s.predicted_cached_tokens for s in d.scores) - d.predicted_cached_tokens
        for d in decisions
    )
    lost = bound * res.prompt_tokens - res.cached_tokens
    print(
        f"seed {seed}: hit {res.cached_tokens / res.prompt_tokens:.2%} of a {bound:.2%} bound "
        f"({res.cached_tokens:,} of {res.prompt_tokens:,} prompt tokens; {lost:,.0f} tokens "
        f"of hits short of the bound); routed away from a better match: {away:,} tokens"
    )
