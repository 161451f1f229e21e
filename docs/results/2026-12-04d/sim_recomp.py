"""Simulator sweep of the recompute charge before it was built into the router (seventh
session): it patches ``Router._score`` to add ``w x (prefill_ms - min prefill_ms)``.
Variants: a weight w, "nsW" (weight W with the spill off), "pa", "ll":

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04d/sim_recomp.py \
        mooncake-groups 120 0,1,2,3,4 0,0.5,1,2,pa
    ... mooncake-groups 120 0,1,2,3,4 ns0,ns0.5,ns1,ns2
    ... shared-prefix | hot-prefix | long-prefix-pressure 200 0,1,2 0,1,ns0,ns1
    ... tenant-mix | rag 200 0,1,2 0,ns1;  mooncake 120 0,1,2 0,ns1
    ... shared-prefix 200 0,1,2 0,ns1 0.5;  hot-prefix 200 0,1,2 0,ns1 1.1

Run at commit 0dc34e4, whose default policy has the relative spill at 2,000 ms and no
recompute charge; at a later commit the charge is already in the router and adds up.
"""

import asyncio
import statistics
import sys
from dataclasses import replace

import gateway.routing as R
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

orig = R.Router._score
W = {"w": 0.0}


def patched(self, req, cands, coeffs):
    out = orig(self, req, cands, coeffs)
    w = W["w"]
    if w > 0:
        el = [s for s in out if s.eligible]
        if el:
            best = min(s.prefill_ms for s in el)
            for s in out:
                s.cost_ms += w * (s.prefill_ms - best)
    return out


R.Router._score = patched
wl = sys.argv[1]
n = int(sys.argv[2])
seeds = [int(x) for x in sys.argv[3].split(",")]
variants = sys.argv[4].split(",")
load = float(sys.argv[5]) if len(sys.argv) > 5 else 0.85
text = TextSource()
pol = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
knee = simulated_knee(wl, 4, text)
rate = load * knee
print(f"{wl} knee {knee:.2f} rate {rate:.2f}")
agg = {}
for seed in seeds:
    w = make_workload(wl, n, 4, rate, seed, text)
    for v in variants:
        strat = Strategy.EXPECTED_LATENCY
        if v == "pa":
            strat = Strategy.PREFIX_AFFINITY
            W["w"] = 0
        elif v == "ll":
            strat = Strategy.LEAST_LOADED
            W["w"] = 0
        elif v.startswith("ns"):
            W["w"] = float(v[2:])
            strat = Strategy.EXPECTED_LATENCY
        else:
            W["w"] = float(v)
        for sd in (0, 1):
            p2 = (
                pol.model_copy(
                    update={"routing": pol.routing.model_copy(update={"spill_queue_ms": None})}
                )
                if v.startswith("ns")
                else pol
            )
            r = asyncio.run(
                FleetSimulator(replace(cfg, strategy=strat, seed=sd), p2, w).run()
            ).row()
            agg.setdefault(v, []).append(
                (r["hit_rate"], r["ttft_mean"], r["ttft_p99"], r["e2e_p99"])
            )
for v, rows in agg.items():
    h, m, p, e = zip(*rows, strict=False)
    print(
        f"{v:6s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
        f"p99 {statistics.mean(p):.3f} (med {statistics.median(p):.3f}) "
        f"e2e99 {statistics.mean(e):.2f}"
    )
