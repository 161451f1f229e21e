"""R1's E1 and E2 on the recorded reference runs (twenty-sixth session): at what fraction of
its own workload's least_loaded knee each seed of a recorded run really ran, and its
fleet-capacity bound with the LRU that evicts a request's tail first.

    KVGATE_TRACE_DIR=/work/shared/traces .venv/bin/python docs/results/2026-12-06d/loadpoints.py \
        docs/results/2026-12-05g/sp120.json ...

Deterministic (virtual time, no fleet). Per run: the knee the run used (the 200-request
probe), each seed's own knee (simulated_knee on that seed's workload, the run's request
count) and the recorded rate as a fraction of it; the bound recorded with the run (head
first) and the corrected one; expected_latency's hit rate against 90% of each (the
verdict on the seed means, as the bench judges it)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from cachecore.traceanalysis import lru_bound
from loadtest.bench_routers import make_workload, request_blocks, simulated_knee
from loadtest.workloads import TextSource

SHARED = ("shared-prefix", "mooncake", "mooncake-groups")


def _share(hit: float, bound: float) -> str:
    return f"{hit / bound:.0%}" if bound > 0 else "-"


def main(paths: list[str]) -> None:
    text = TextSource()
    for path in paths:
        doc = json.loads(Path(path).read_text())
        wl, n, seeds, rate = doc["workload"], doc["requests"], doc["seeds"], doc["rate"]
        print(
            f"## {path}: {wl}, {n} requests, seeds {seeds}, {rate:.3f} req/s "
            f"(= {rate / doc['knee']:.0%} of the probe's knee {doc['knee']:.3f})"
        )
        old_b, new_b, hits, fracs = [], [], [], []
        for s in seeds:
            knee = simulated_knee(wl, doc["replicas"], text, requests=n, seed=s)
            w = make_workload(wl, n, doc["replicas"], rate, s, text)
            cap = doc["bounds"][str(s)]["capacity_blocks"]
            new = lru_bound(request_blocks(w), cap).hit_rate
            old = doc["bounds"][str(s)]["fleet_lru"]
            el = [
                r["summary"]["token_hit_rate"]
                for r in doc["runs"]
                if r["system"] == "expected_latency"
                and r["seed"] == s
                and r["status"] == "ok"
                and r["summary"]
            ]
            hit = el[0] if el else float("nan")
            old_b.append(old)
            new_b.append(new)
            hits.append(hit)
            fracs.append(rate / knee)
            print(
                f"  seed {s}: own knee {knee:.3f} req/s, ran at {rate / knee:.0%} of it "
                f"(85% = {0.85 * knee:.3f}, 50% = {0.5 * knee:.3f}); bound head-first "
                f"{old:.2%} tail-first {new:.2%}; expected_latency hit {hit:.2%} "
                f"= {_share(hit, old)} / {_share(hit, new)} of the bound"
            )
        valid = [h for h in hits if h == h]
        line = (
            f"  mean: ran at {statistics.fmean(fracs):.0%} of own knee "
            f"({min(fracs):.0%}-{max(fracs):.0%}); bound {statistics.fmean(old_b):.2%} -> "
            f"{statistics.fmean(new_b):.2%}"
        )
        if valid and wl in SHARED:
            h, ob, nb = statistics.fmean(valid), statistics.fmean(old_b), statistics.fmean(new_b)
            v = ["met" if h >= 0.9 * b else "MISSED" for b in (ob, nb)]
            line += (
                f"; expected_latency hit {h:.2%}: vs 90% of {ob:.2%} {v[0]}, vs 90% of "
                f"{nb:.2%} {v[1]}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
