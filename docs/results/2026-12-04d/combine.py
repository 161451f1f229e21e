"""Summary and verdicts of several `kvgate bench routers --json` outputs of one workload, as
if they were one run (used for shared-prefix 85%: seeds 0-2 and 3-5 ran separately).

    .venv/bin/python docs/results/2026-12-04d/combine.py shared-prefix \
        docs/results/2026-12-04d/sp85.json docs/results/2026-12-04d/sp85b.json
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

from loadtest.bench_routers import SystemRun, aggregate, seed_p99_ratios, summary_table, verdicts


def main(workload: str, paths: list[str]) -> None:
    runs: list[SystemRun] = []
    fleet_bounds: list[float] = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        fleet_bounds += [b["fleet_lru"] for b in d["bounds"].values()]
        for r in d["runs"]:
            # the JSON writes a missing figure (a peer's prediction error) as null
            summary = {k: math.nan if v is None else v for k, v in r["summary"].items()}
            run = SystemRun(r["system"], r["seed"], r["status"], summary)
            run.warm_hits, run.lag_p99_ms = r["warm_hits"], r["lag_p99_ms"]
            runs.append(run)
    counted = [r for r in runs if r.counts]
    agg = aggregate(counted)
    print(summary_table(agg, Counter(r.system for r in counted)))  # seeds per system
    bound = sum(fleet_bounds) / len(fleet_bounds)
    lagged = sum(r.status == "lag" for r in runs)
    for v in verdicts(workload, agg, bound, lagged, seed_ratios=seed_p99_ratios(counted)):
        print(v)
    print(f"runs: {len(runs)}, counted {len(counted)}, lag-flagged {lagged}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
