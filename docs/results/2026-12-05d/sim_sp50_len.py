"""The p99 floor at the 50% load point, in the simulator (4 replicas, the shipped policy, the
same engine and router as the HTTP fleet): strategies side by side at two run lengths.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05d/sim_sp50_len.py \\
        shared-prefix 0.5 120,600 0,1,2,3,4,5

Arguments: workload, load (fraction of least_loaded's knee), run lengths, seeds.
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
    Strategy.ROUND_ROBIN,
    Strategy.PREFIX_AFFINITY,
    Strategy.LEAST_LOADED,
)


def main(workload: str, load: float, lengths: list[int], seeds: list[int]) -> None:
    text = TextSource()
    policy = load_policy(builtin_policy_path("default"))
    cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE)
    knee = simulated_knee(workload, 4, text)
    print(f"{workload}: knee {knee:.2f} req/s, load {load}")
    for n in lengths:
        agg: dict[Strategy, list[tuple[float, float, float]]] = {s: [] for s in STRATEGIES}
        for seed in seeds:
            w = make_workload(workload, n, 4, load * knee, seed, text)
            for s in STRATEGIES:
                sim = FleetSimulator(replace(cfg, strategy=s, seed=0), policy, w)
                r = asyncio.run(sim.run()).row()
                agg[s].append((r["hit_rate"], r["ttft_mean"], r["ttft_p99"]))
        print(f"{n} requests, seeds {seeds}")
        for s, rows in agg.items():
            h, m, p = zip(*rows, strict=True)
            print(
                f"  {s.value:18s} hit {statistics.mean(h):.1%} mean {statistics.mean(m):.3f} "
                f"p99 {statistics.mean(p):.3f} per seed {[round(x, 3) for x in p]}"
            )


if __name__ == "__main__":
    main(
        sys.argv[1],
        float(sys.argv[2]),
        [int(x) for x in sys.argv[3].split(",")],
        [int(x) for x in sys.argv[4].split(",")],
    )
