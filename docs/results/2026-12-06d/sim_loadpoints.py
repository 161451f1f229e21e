"""The reference load points before and after R1's E1 (twenty-sixth session), in the
simulator (4 replicas, the shipped policy, the same engine and router as the HTTP fleet, no
peers): strategies side by side at the old rate (``load`` x the 200-request probe's knee,
every seed alike) and at the corrected one (``load`` x each seed's own knee).

    KVGATE_TRACE_DIR=/work/shared/traces .venv/bin/python \\
        docs/results/2026-12-06d/sim_loadpoints.py shared-prefix 0.85,0.5 120,600 0,1,2,3,4,5

Arguments: workload, loads, run lengths, seeds. Deterministic (virtual time).
"""

import asyncio
import statistics
import sys
from dataclasses import replace

from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

STRATEGIES = (
    Strategy.EXPECTED_LATENCY,
    Strategy.PREFIX_AFFINITY,
    Strategy.ROUND_ROBIN,
    Strategy.LEAST_LOADED,
)


def main(workload: str, loads: list[float], lengths: list[int], seeds: list[int]) -> None:
    text = TextSource()
    policy = load_policy(builtin_policy_path("default"))
    cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE)
    probe = simulated_knee(workload, 4, text)
    for n in lengths:
        own = {s: simulated_knee(workload, 4, text, requests=n, seed=s) for s in seeds}
        print(
            f"{workload}, {n} requests: probe knee {probe:.3f}; own knees "
            + ", ".join(f"{own[s]:.3f}" for s in seeds),
            flush=True,
        )
        for load in loads:
            old = {s: load * probe for s in seeds}
            new = {s: load * own[s] for s in seeds}
            for label, rate in (("old", old), ("new", new)):
                agg: dict[Strategy, list[tuple[float, float, float]]] = {s: [] for s in STRATEGIES}
                for seed in seeds:
                    w = make_workload(workload, n, 4, rate[seed], seed, text)
                    for st in STRATEGIES:
                        sim = FleetSimulator(replace(cfg, strategy=st, seed=0), policy, w)
                        r = asyncio.run(sim.run()).row()
                        agg[st].append((r["hit_rate"], r["ttft_mean"], r["ttft_p99"]))
                frac = statistics.fmean(rate[s] / own[s] for s in seeds)
                print(f"  load {load} {label} ({frac:.0%} of own knee on average)")
                el_p99 = statistics.fmean(p for _, _, p in agg[Strategy.EXPECTED_LATENCY])
                for st, rows in agg.items():
                    h, m, p = zip(*rows, strict=True)
                    print(
                        f"    {st.value:18s} hit {statistics.fmean(h):.1%} mean "
                        f"{statistics.fmean(m):.3f} p99 {statistics.fmean(p):.3f} "
                        f"(EL / this {el_p99 / statistics.fmean(p):.2f})",
                        flush=True,
                    )


if __name__ == "__main__":
    main(
        sys.argv[1],
        [float(x) for x in sys.argv[2].split(",")],
        [int(x) for x in sys.argv[3].split(",")],
        [int(x) for x in sys.argv[4].split(",")],
    )
