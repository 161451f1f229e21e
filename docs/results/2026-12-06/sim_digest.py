# ruff: noqa: E501  (a measurement script kept as it was run)
"""Digest of SimResult fields (minus wall_seconds, decision_us) over 11 configs."""

import asyncio
import hashlib
import sys
import time
from dataclasses import fields, replace

from loadtest import simulate as S
from policies.schema import builtin_policy_path, load_policy

CONFIGS = [
    ("shared-prefix", 8, 5000, "expected_latency", 9.0),
    ("shared-prefix", 8, 5000, "least_loaded", 9.0),
    ("shared-prefix", 8, 5000, "prefix_affinity", 9.0),
    ("shared-prefix", 64, 20000, "expected_latency", 65.1),
    ("mooncake", 8, 3000, "expected_latency", 3.0),
    ("mooncake", 8, 3000, "least_loaded", 3.0),
    ("mooncake", 8, 3000, "prefix_affinity", 3.0),
    ("multi-turn", 8, 2000, "expected_latency", 8.0),
    ("tenant-mix", 8, 2000, "expected_latency", 8.0),
    ("rag", 8, 2000, "expected_latency", 8.0),
    ("hot-prefix", 8, 2000, "expected_latency", 8.0),
]


async def main():
    S.batch_gc()
    policy = load_policy(builtin_policy_path("default"))
    text = S.TextSource()
    total = hashlib.sha256()
    only = sys.argv[1:]
    for wl, n, req, strat, rate in CONFIGS:
        if only and wl not in only:
            continue
        cfg = S.SimConfig(replicas=n, seed=0)
        w = S.scaled_workload(wl, req, n, rate, 0, text)
        t0 = time.perf_counter()
        sim = S.FleetSimulator(replace(cfg, strategy=S.strategy_name(strat)), policy, w)
        res = await sim.run()
        h = hashlib.sha256()
        for f in fields(res):
            if f.name in ("wall_seconds", "decision_us"):
                continue
            h.update(f.name.encode())
            h.update(repr(getattr(res, f.name)).encode())
        d = h.hexdigest()[:16]
        total.update(d.encode())
        print(
            f"{wl:14s} {n:3d} {req:6d} {strat:17s} {d} rej={res.rejected} pre={res.preemptions} hit={res.cached_tokens / max(1, res.prompt_tokens):.3f} wall={time.perf_counter() - t0:.1f}",
            flush=True,
        )
    print("TOTAL", total.hexdigest()[:16])


asyncio.run(main())
