"""Per-request data of expected_latency on a workload, in the simulator: for every request,
its arrival, prompt tokens, predicted and actual cached tokens, the chosen replica's queued
prefill tokens, queued requests and running requests at dispatch, its own prefill time alone
(8b-h100: 30 ms + 0.25 ms a token), the cost model's predicted TTFT and the actual one.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-06b/sim_probe.py \
        mooncake-groups 0-7 0.85 120 [variant of sim_variants.py, default base]

With a variant, ``pred`` includes the variant's added term (it is added to the cost).
"""

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sim_variants import install

from cachecore.engine.request import RequestOutput
from gateway.routing import Candidate, Coefficients, Decision, RouteRequest, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource, WorkItem
from policies.schema import builtin_policy_path, load_policy


def seeds_arg(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


class Probe(FleetSimulator):
    """Keeps each request's decision, its load at dispatch and its TTFT."""

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

    def _route(self, i: int, item: WorkItem, now: float) -> None:
        super()._route(i, item, now)
        if self._last is not None:
            self.rec[f"q{i}"] = {"i": i, "now": now, "dec": self._last, "tenant": item.tenant}
            self._last = None

    def _outputs(self, r: int, outputs: Sequence[RequestOutput], now: float) -> None:
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is not None and out.first_token and out.request_id in self.rec:
                self.rec[out.request_id].update(
                    ttft=now - st.arrival, cached=out.num_cached_tokens, n=st.prompt_tokens,
                    r=r, load=st.load_at_dispatch,
                )  # fmt: skip
        super()._outputs(r, outputs, now)


def main() -> None:
    wl, seeds, load, n = sys.argv[1], seeds_arg(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    variant = sys.argv[5] if len(sys.argv) > 5 else "base"
    text = TextSource()
    pol = load_policy(builtin_policy_path("default"))
    cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE)
    knee = simulated_knee(wl, 4, text)
    for seed in seeds:
        w = make_workload(wl, n, 4, load * knee, seed, text)
        sim = Probe(replace(cfg, strategy=Strategy.EXPECTED_LATENCY, seed=0), pol, w)
        install(sim, variant)
        row = asyncio.run(sim.run()).row()
        print(f"seed {seed}: hit {row['hit_rate']:.1%} mean {row['ttft_mean']:.3f} "
              f"p99 {row['ttft_p99']:.3f}")  # fmt: skip
        recs = sorted(sim.rec.values(), key=lambda v: v["i"])
        for v in recs:
            d = v["dec"]
            c = d.chosen
            ld = v["load"]
            own = 0.030 + 0.00025 * (v["n"] - v["cached"])
            print(
                f"  q{v['i']:3d} t {v['now']:6.2f} {v['tenant']:>10} n {v['n']:5d} "
                f"pc {c.predicted_cached_tokens:5d} ac {v['cached']:5d} -> {d.replica} "
                f"qtok {ld.queued_prefill_tokens:6.0f} qreq {ld.queued_requests} run {ld.running} "
                f"own {own:.3f} pred {c.ttft_ms / 1000:.3f} ttft {v['ttft']:.3f} {d.reason}"
            )


main()
