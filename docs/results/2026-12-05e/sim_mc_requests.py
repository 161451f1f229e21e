"""Per request, in the simulator: the pooled-LRU bound's hit tokens against the engine-reported
hit under expected_latency and prefix_affinity, with expected_latency's scores (predicted
cached tokens / queue ms / cost ms per replica). Requests that no one could hit are skipped.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05e/sim_mc_requests.py mooncake 0 0.85
"""

import asyncio
import sys
from typing import Any

from cachecore.traceanalysis import lru_bound
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, request_blocks, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

wl, seed, load = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
text = TextSource()
policy = load_policy(builtin_policy_path("default"))
w = make_workload(wl, 120, 4, load * simulated_knee(wl, 4, text), seed, text)
reqs = request_blocks(w)
lru = lru_bound(reqs, 4 * 4096)
decisions: dict[str, dict[int, tuple[float, Any]]] = {}
hits: dict[str, dict[int, tuple[int, int]]] = {}
for st in ("expected_latency", "prefix_affinity"):
    cfg = SimConfig(
        replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
        strategy=Strategy(st),
    )  # fmt: skip
    sim = FleetSimulator(cfg, policy, w)
    dec: dict[int, tuple[float, Any]] = decisions.setdefault(st, {})
    got: dict[int, tuple[int, int]] = hits.setdefault(st, {})

    def wrap_route(sim: Any = sim, dec: Any = dec) -> None:
        route, decide = sim._route, sim.router.decide

        async def recorded(i: int, item: Any, now: float) -> None:
            def rec(*a: Any) -> Any:
                d = decide(*a)
                dec[i] = (now, d)
                return d

            sim.router.decide = rec
            try:
                await route(i, item, now)
            finally:
                sim.router.decide = decide

        sim._route = recorded

    def wrap_outputs(sim: Any = sim, got: Any = got) -> None:
        outputs = sim._outputs

        def recorded(r: int, outs: Any, now: float) -> None:
            for o in outs:
                if o.finished:
                    got[int(o.request_id[1:])] = (o.num_cached_tokens, r)
            outputs(r, outs, now)

        sim._outputs = recorded

    wrap_route()
    wrap_outputs()
    res = asyncio.run(sim.run())
    print(st, f"hit {res.cached_tokens / res.prompt_tokens:.2%}")
print("bound", f"{lru.hit_rate:.2%}")
el, pa = hits["expected_latency"], hits["prefix_affinity"]
for i, h in enumerate(lru.request_hits):
    if h == 0 and el[i][0] == 0 and pa[i][0] == 0:
        continue
    now, d = decisions["expected_latency"][i]
    scores = " ".join(
        f"{s.replica}:{s.predicted_cached_tokens}/{s.queue_ms:.0f}/{s.cost_ms:.0f}"
        for s in d.scores
    )
    print(
        f"q{i} t={now:.1f} n={reqs[i].prompt_tokens} bound={h} EL={el[i][0]}@r{el[i][1]} "
        f"PA={pa[i][0]}@r{pa[i][1]} EL pick={d.replica} ({d.reason}) [{scores}]"
    )
