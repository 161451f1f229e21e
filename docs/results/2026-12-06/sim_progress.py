# ruff: noqa: E501  (a measurement script kept as it was run)
import asyncio
import gc
import sys
import time
from dataclasses import replace

from loadtest import simulate as S
from loadtest.simulate import *  # noqa
from loadtest.simulate import builtin_policy_path, load_policy


async def main(n_req: int, n_rep: int, rate: float) -> None:
    S.batch_gc()
    policy = load_policy(builtin_policy_path("default"))
    text = S.TextSource()
    cfg = S.SimConfig(replicas=n_rep, seed=0)
    wl = S.scaled_workload("shared-prefix", n_req, n_rep, rate, 0, text)
    S.freeze_startup_heap()
    import os

    if os.environ.get("NOGC"):
        gc.disable()
    sim = S.FleetSimulator(replace(cfg, strategy=S.strategy_name("expected_latency")), policy, wl)
    orig = sim._route
    marks = []

    def route(i, item, now):
        if i % 10000 == 0:
            marks.append((i, time.perf_counter(), now, gc.get_count()))
        orig(i, item, now)

    sim._route = route
    res = await sim.run()
    prev = None
    for i, w, now, _c in marks:
        if prev:
            print(
                f"{i:6d} wall {w - prev[1]:6.2f}s sim {now - prev[2]:6.1f}s ratio {(now - prev[2]) / (w - prev[1]):5.1f}x"
            )
        prev = (i, w, now)
    print(
        "total wall", res.wall_seconds, "sim", res.sim_seconds, res.sim_seconds / res.wall_seconds
    )


asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
