# ruff: noqa: E501  (a measurement script kept as it was run)
"""Router-seed spread on one workload: the same requests (workload seed W), routers seeded R."""

import asyncio
import sys
from dataclasses import replace

from loadtest import simulate as S
from policies.schema import builtin_policy_path, load_policy


async def main():
    S.batch_gc()
    wl, n, req, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    wseeds = [int(x) for x in sys.argv[5].split(",")]
    rseeds = [int(x) for x in sys.argv[6].split(",")]
    policy = load_policy(builtin_policy_path("default"))
    text = S.TextSource()
    for ws in wseeds:
        w = S.scaled_workload(wl, req, n, rate, ws, text)
        for rs in rseeds:
            cfg = S.SimConfig(replicas=n, seed=rs)
            sim = S.FleetSimulator(
                replace(cfg, strategy=S.strategy_name("expected_latency")), policy, w
            )
            res = await sim.run()
            r = res.row()
            print(
                f"{wl} w={ws} r={rs} hit={r['hit_rate']:.4f} mean={r['ttft_mean']:.3f} p99={r['ttft_p99']:.3f} pre={res.preemptions}",
                flush=True,
            )


asyncio.run(main())
