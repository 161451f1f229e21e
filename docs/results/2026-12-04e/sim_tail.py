"""Which requests make expected_latency's TTFT tail, and how far the cost model's predicted
TTFT (queue + prefill, without the stall and recompute charges) was from the actual one.
Simulator, 4 replicas, 2 router seeds per workload seed:

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04e/sim_tail.py \
        mooncake-groups 120 0,1,2,3,4 0.85
"""

import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from cachecore.engine.request import RequestOutput
from gateway.routing import Candidate, Coefficients, Decision, RouteRequest, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource, WorkItem
from policies.schema import builtin_policy_path, load_policy

wl, n = sys.argv[1], int(sys.argv[2])
seeds = [int(x) for x in sys.argv[3].split(",")]
load = float(sys.argv[4]) if len(sys.argv) > 4 else 0.85
text = TextSource()
pol = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE, seed=0)
knee = simulated_knee(wl, 4, text)
rate = load * knee
print(f"{wl} knee {knee:.2f} rate {rate:.2f}")


class Probe(FleetSimulator):
    """Keeps each request's decision and its TTFT."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rec: dict[str, dict[str, Any]] = {}
        self._last: Decision | None = None
        decide = self.router.decide

        def keep(
            req: RouteRequest,
            cands: Sequence[Candidate],
            coeffs: Coefficients,
            strategy: Strategy | None = None,
        ) -> Decision:
            self._last = decide(req, cands, coeffs, strategy)
            return self._last

        self.router.decide = keep  # type: ignore[method-assign]

    async def _route(self, i: int, item: WorkItem, now: float) -> None:
        await super()._route(i, item, now)
        if self._last is not None:
            self.rec[f"q{i}"] = {"now": now, "dec": self._last}
            self._last = None

    def _outputs(self, r: int, outputs: Sequence[RequestOutput], now: float) -> None:
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is not None and out.first_token and out.request_id in self.rec:
                self.rec[out.request_id].update(
                    ttft=now - st.arrival, cached=out.num_cached_tokens, n=st.prompt_tokens
                )
        super()._outputs(r, outputs, now)


records: list[dict[str, Any]] = []
for seed in seeds:
    w = make_workload(wl, n, 4, rate, seed, text)
    for sd in (0, 1):
        sim = Probe(replace(cfg, strategy=Strategy.EXPECTED_LATENCY, seed=sd), pol, w)
        row = asyncio.run(sim.run()).row()
        print(
            f"seed {seed}/{sd}: hit {row['hit_rate']:.1%} mean {row['ttft_mean']:.3f} "
            f"p99 {row['ttft_p99']:.3f}"
        )
        for rec in sim.rec.values():
            if "ttft" in rec:
                rec["seed"] = (seed, sd)
                records.append(rec)
records.sort(key=lambda v: -v["ttft"])
tt = sorted(v["ttft"] for v in records)
print(f"pooled p99 {tt[int(0.99 * len(tt))]:.3f} mean {statistics.mean(tt):.3f} N {len(tt)}")
for v in records[: max(8, len(records) // 50)]:
    d = v["dec"]
    print(
        f"ttft {v['ttft']:.3f} seed {v['seed']} t {v['now']:.1f} n {v['n']} "
        f"cached {v['cached']} -> {d.replica} ({d.reason})"
    )
    for s in d.scores:
        mark = "*" if s.replica == d.replica else " "
        print(
            f"   {mark}{s.replica} cost {s.cost_ms:7.0f} queue {s.queue_ms:7.0f} "
            f"prefill {s.prefill_ms:6.0f} recompute {s.recompute_ms:6.0f} "
            f"stall {s.stall_ms:5.0f} cached {s.predicted_cached_tokens:5d} in flight {s.requests}"
        )


def quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


print("actual - predicted TTFT of the chosen replica, s")
for lo, hi in ((0, 2048), (2048, 6000), (6000, 10**9)):
    errs = sorted(v["ttft"] - v["dec"].chosen.ttft_ms / 1000 for v in records if lo <= v["n"] < hi)
    if errs:
        qs = " ".join(f"p{int(q * 100)} {quantile(errs, q):+.3f}" for q in (0.1, 0.5, 0.9, 0.99))
        print(f"  prompt tokens [{lo}, {hi}): N {len(errs)} {qs}")
