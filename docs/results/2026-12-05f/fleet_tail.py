"""Where the TTFT tail of a fleet run lies: per system, over the valid runs of one or more
`kvgate bench routers --json` files (written since the per-request records), the pooled
TTFT p99 and mean, then the same for the first fifth of each run's requests and for the rest.

    .venv/bin/python docs/results/2026-12-05f/fleet_tail.py \
        docs/results/2026-12-05f/sp120-requests.json
"""

import json
import statistics
import sys

from cachecore.traceanalysis import percentile

VALID = "ok"


def main() -> None:
    every: dict[str, list[float]] = {}
    first: dict[str, list[float]] = {}
    rest: dict[str, list[float]] = {}
    seeds: dict[str, int] = {}
    for path in sys.argv[1:]:
        with open(path) as f:
            doc = json.load(f)
        for run in doc["runs"]:
            if run["status"] != VALID or not run.get("requests"):
                continue
            name = run["system"]
            seeds[name] = seeds.get(name, 0) + 1
            cut = len(run["requests"]) // 5
            for index, ttft, _prompt, _cached in run["requests"]:
                if ttft is None:
                    continue
                every.setdefault(name, []).append(ttft)
                (first if index < cut else rest).setdefault(name, []).append(ttft)
    print(
        "| system | runs | TTFT p99 s | mean s | first fifth: p99 / mean s "
        "| the rest: p99 / mean s |"
    )
    print("|---|---|---|---|---|---|")
    for name in every:
        a, b, c = every[name], first.get(name, []), rest.get(name, [])
        print(
            f"| {name} | {seeds[name]} | {percentile(a, 99):.3f} | {statistics.fmean(a):.3f} | "
            f"{percentile(b, 99):.3f} / {statistics.fmean(b):.3f} | "
            f"{percentile(c, 99):.3f} / {statistics.fmean(c):.3f} |"
        )


main()
