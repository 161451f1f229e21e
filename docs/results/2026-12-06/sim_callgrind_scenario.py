# ruff: noqa: E501  (a measurement script kept as it was run)
import asyncio
import sys
import time
from dataclasses import replace

from loadtest import simulate as S
from policies.schema import builtin_policy_path, load_policy


async def main(n_req, n_rep, rate, blocks):
    S.batch_gc()
    policy = load_policy(builtin_policy_path("default"))
    text = S.TextSource()
    cfg = S.SimConfig(replicas=n_rep, seed=0, num_blocks=blocks)
    wl = S.scaled_workload("shared-prefix", n_req, n_rep, rate, 0, text)
    S.freeze_startup_heap()
    sim = S.FleetSimulator(replace(cfg, strategy=S.strategy_name("expected_latency")), policy, wl)
    if len(sys.argv) > 5:
        return
    orig = sim._route
    marks = []
    step = max(1, n_req // 8)

    def route(i, item, now):
        if i % step == 0:
            marks.append((i, time.perf_counter(), sum(e.pool.num_evictions for e in sim.engines)))
        orig(i, item, now)

    sim._route = route
    res = await sim.run()
    prev = None
    for i, w, ev in marks:
        if prev:
            print(
                f"{i:6d} wall {w - prev[1]:6.2f}s  ms/req {(w - prev[1]) / (i - prev[0]) * 1000:.3f} evictions/req {(ev - prev[2]) / (i - prev[0]):.1f}"
            )
        prev = (i, w, ev)
    print(
        "total wall",
        res.wall_seconds,
        "sim",
        res.sim_seconds,
        "hit",
        res.cached_tokens / res.prompt_tokens,
    )


asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])))
