# ruff: noqa  (a measurement script kept as it was run)
"""The parts of one 256-replica decision: cost terms, score records, ties, the scope-tree
pick. Usage: PYTHONPATH=. .venv/bin/python docs/results/2026-12-06c/decide_parts.py"""

import random, timeit
from gateway.routing import Router, RoutingParams, Candidate, RouteRequest, ReplicaScore
from cachecore.scoring import Coefficients, LoadView, cost_terms, predict_hit
from cachecore.index.base import PrefixMatch, NO_MATCH

N = 256
rng = random.Random(0)
co = Coefficients()
cands = [
    Candidate(
        f"r{i}", LoadView(rng.random() * 3000, rng.randrange(3), rng.randrange(40), 0, 256, 0.5)
    )
    for i in range(N)
]
loads = [c.load for c in cands]
nh = predict_hit(NO_MATCH, 2100, 16, co)
n = 3000
print(
    "cost_terms",
    timeit.timeit(lambda: cost_terms(nh, [c.load for c in cands], co), number=n) / n * 1e6,
)
terms = cost_terms(nh, loads, co)


def mk():
    return [
        ReplicaScore(
            c.replica,
            t[0],
            t[1],
            t[2],
            t[3],
            0,
            0,
            (ld.queued_requests if ld.queued_requests > ld.waiting else ld.waiting) + ld.running,
            True,
            "",
            t[4],
            0.0,
        )
        for c, t in zip(cands, terms)
        for ld in (c.load,)
    ]


print("scores", timeit.timeit(mk, number=n) / n * 1e6)
r = Router(RoutingParams(), random.Random(1))
sc = mk()
print("ties", timeit.timeit(lambda: r._ties(sc), number=n) / n * 1e6)
print("smallest", timeit.timeit(lambda: r._smallest_scope_tree(sc, {}), number=n) / n * 1e6)
import numpy as np


def arrs():
    q = np.fromiter([l.queued_prefill_tokens for l in loads], float, N)
    run = np.fromiter([l.running for l in loads], float, N)
    return q, run


print("np arrays 2", timeit.timeit(arrs, number=n) / n * 1e6)
