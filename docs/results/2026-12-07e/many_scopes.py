# ruff: noqa: E501  (a measurement script kept as it was run)
"""D26's trade-off: short-unique at 85% (86.0 req/s on 8 replicas), each request's tenant drawn
from K tenants; miss_tie_break round (every miss tie taken in rounds) or scope_tree (default)."""

import asyncio
import random
import sys
from dataclasses import replace

from gateway.routing import MissTieBreak
from loadtest import simulate as S
from policies.schema import builtin_policy_path, load_policy


async def main():
    S.batch_gc()
    ks = [int(x) for x in sys.argv[1].split(",")]
    breaks = sys.argv[2].split(",")
    seeds = [int(x) for x in sys.argv[3].split(",")]
    policy = load_policy(builtin_policy_path("default"))
    text = S.TextSource()
    for seed in seeds:
        base = S.scaled_workload("short-unique", 2000, 8, 86.0, seed, text)
        for k in ks:
            rng = random.Random(1000 + seed)
            items = tuple(replace(it, tenant=f"t{rng.randrange(k)}") for it in base.items)
            w = replace(base, items=items, tenants=tuple(f"t{i}" for i in range(k)))
            for tb in breaks:
                cfg = S.SimConfig(replicas=8, seed=seed)
                sim = S.FleetSimulator(
                    replace(cfg, strategy=S.strategy_name("expected_latency")), policy, w
                )
                sim.router.params = replace(sim.router.params, miss_tie_break=MissTieBreak(tb))
                res = await sim.run()
                r = res.row()
                print(
                    f"short-unique85 seed={seed} K={k} {tb} mean={r['ttft_mean']:.3f} p90={r['ttft_p90']:.3f} p99={r['ttft_p99']:.3f} imb={r['imbalance']:.2f}",
                    flush=True,
                )


asyncio.run(main())
