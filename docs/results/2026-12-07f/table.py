"""The reference table of docs/benchmarks.md from `kvgate bench routers --json` files.

Usage: PYTHONPATH=. .venv/bin/python docs/results/2026-12-07f/table.py DIR [NAME ...]
For each file: per system, over the seeds where every system's run is valid (the bench's
judged seeds), the mean hit rate, TTFT mean, TTFT p99 (each seed's in parentheses), the
p99 over those seeds' requests pooled, and e2e p99; plus each seed's offered rate.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from loadtest.bench_routers import percentile


def pooled_p99(runs: list[dict[str, Any]]) -> float:
    """The bench's pooled p99: every request's TTFT of these runs ranked together."""
    return percentile([r[1] for run in runs for r in run["requests"] if r[1] is not None], 99)


def table(path: Path) -> None:
    d = json.loads(path.read_text())
    runs = d["runs"]
    systems = list(dict.fromkeys(r["system"] for r in runs))
    seeds = sorted({r["seed"] for r in runs})
    ok = {(r["system"], r["seed"]): r for r in runs if r["status"] == "ok"}
    judged = [s for s in seeds if all((sy, s) in ok for sy in systems)]
    rates = ", ".join(f"{d['rates'][str(s)]:.2f}" for s in seeds)
    valid = sum(1 for r in runs if r["status"] == "ok")
    print(f"## {path.name}: {d['workload']} {d['requests']} requests, load {d['load']}")
    print(f"rates per seed: {rates}; valid runs {valid}/{len(runs)}; judged seeds {judged}")
    print("| system | hit rate | TTFT mean s | TTFT p99 s (per seed) | pooled p99 s | e2e p99 s |")
    print("|---|---|---|---|---|---|")
    for sy in systems:
        rs = [ok[(sy, s)] for s in judged]
        if not rs:
            continue
        sm = [r["summary"] for r in rs]
        hit = statistics.mean(x["token_hit_rate"] for x in sm)
        mean = statistics.mean(x["ttft_mean_s"] for x in sm)
        p99s = [x["ttft_p99_s"] for x in sm]
        e2e = statistics.mean(x["e2e_p99_s"] for x in sm)
        per = ", ".join(f"{p:.3f}" for p in p99s)
        print(
            f"| {sy} | {hit:.1%} | {mean:.3f} | {statistics.mean(p99s):.3f} ({per}) "
            f"| {pooled_p99(rs):.3f} | {e2e:.2f} |"
        )
    for v in d["verdicts"]:
        print(v)
    print()


if __name__ == "__main__":
    root = Path(sys.argv[1])
    names = sys.argv[2:] or sorted(p.stem for p in root.glob("*.json"))
    for name in names:
        table(root / f"{name}.json")
