# ruff: noqa  (a measurement script kept as it was run)
"""Router.decide p50 over synthetic candidates, 8-256 replicas (twenty-fifth session).
Usage: PYTHONPATH=. .venv/bin/python docs/results/2026-12-06c/decide_cost.py"""

import random, time, sys
from gateway.routing import Router, RoutingParams, Candidate, RouteRequest
from cachecore.scoring import Coefficients, LoadView
from cachecore.index.base import PrefixMatch
from cachecore.lifecycle import Tier

for N in (8, 64, 128, 256):
    rng = random.Random(0)
    r = Router(RoutingParams(), random.Random(1))
    co = Coefficients()
    cands = [
        Candidate(
            f"r{i}", LoadView(rng.random() * 3000, rng.randrange(3), rng.randrange(40), 0, 256, 0.5)
        )
        for i in range(N)
    ]
    m = PrefixMatch({Tier.GPU: 100}, 100, 100)
    hit = list(cands)
    hit[3] = Candidate("r3", cands[3].load, m)
    for name, cs in (("hit", hit), ("miss", cands)):
        req = RouteRequest(prompt_tokens=2100, block_size=16, session_key="s", scope_key="t")
        ts = []
        for _ in range(2000):
            t0 = time.perf_counter()
            r.decide(req, cs, co)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        print(N, name, f"p50 {ts[len(ts) // 2] * 1e6:.1f} us")
