"""How much of the shared-prefix tail better load information could remove: an *oracle of
the present* beside expected_latency, in the simulator. For each request the oracle copies
every replica's engine as it is at the arrival (its cache, its running and waiting requests,
the step in flight), adds the request and steps the copy until the request's first token:
the TTFT it would get there if nothing else arrived. It sends the request where that is
lowest (ties: the first). No online router can know more about the present; what it cannot
know is the future arrivals that will share the engine's next steps.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05g/sim_oracle.py shared-prefix 0-9 0.85 120

Arguments: workload, seeds (``a-b`` or a comma list), load (fraction of least_loaded's
simulated knee), requests per seed. Decode is stepped, not fast-forwarded (the simulator's
``defer_decode`` off, which its tests show gives the same results), so every replica's
engine state is current at each arrival.
"""

import asyncio
import copy
import math
import statistics
import sys
from typing import Any

from cachecore.engine.request import EngineRequest
from cachecore.traceanalysis import percentile
from gateway.routing import Decision, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

MAX_STEPS = 10_000  # a copy's steps until the first token: bounded


def seeds_arg(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


class Oracle:
    """Wraps a simulator: tracks when each replica's step in flight ends, and replaces the
    router's pick by the replica with the lowest TTFT its engine's copy predicts."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.busy_until = [0.0] * len(sim.engines)
        self.item: Any = None
        self.now = 0.0
        kick, route, decide = sim._kick, sim._route, sim.router.decide

        def o_kick(r: int, now: float) -> None:
            kick(r, now)
            self.busy_until[r] = max(now, self.busy_until[r])
            for t, _seq, _kind, data in sim._heap:  # the step just pushed, if any
                if isinstance(data, tuple) and data and data[0] == r and t > now:
                    self.busy_until[r] = max(self.busy_until[r], t)

        async def o_route(i: int, item: Any, now: float) -> None:
            self.item, self.now = item, now
            await route(i, item, now)

        def o_decide(req: Any, cands: Any, coeffs: Any, strategy: Any = None) -> Decision:
            d = decide(req, cands, coeffs, strategy)
            pick = self.best_replica()
            return Decision(pick, d.strategy, "oracle", d.scores)

        sim._kick, sim._route, sim.router.decide = o_kick, o_route, o_decide

    def predicted_ttft(self, r: int, tokens: list[int], salt: str) -> float:
        sim, now = self.sim, self.now
        engine = copy.deepcopy(sim.engines[r])
        engine.add_request(EngineRequest("oracle", tokens, self.item.max_tokens, salt), now)
        clock = max(now, self.busy_until[r]) if sim._busy[r] else now
        for _ in range(MAX_STEPS):
            if not engine.has_work():
                break
            res = engine.step(clock)
            clock += res.duration_s if res.duration_s > 0 else 1e-4
            if any(o.request_id == "oracle" and o.first_token for o in res.outputs):
                return clock - now
        return math.inf

    def best_replica(self) -> str:
        sim = self.sim
        tokens = sim._tokens(self.item)
        salt = sim._salt(self.item.tenant)
        ttft = [self.predicted_ttft(r, tokens, salt) for r in range(len(sim.engines))]
        return str(sim.ids[ttft.index(min(ttft))])


def run(rule: str, w: Any, policy: Any) -> list[tuple[int, float]]:
    cfg = SimConfig(
        replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
        strategy=Strategy.EXPECTED_LATENCY, defer_decode=False,
    )  # fmt: skip
    sim = FleetSimulator(cfg, policy, w)
    if rule == "oracle":
        Oracle(sim)
    got: list[tuple[int, float]] = []
    outputs = sim._outputs

    def recorded(r: int, outs: Any, now: float) -> None:
        for o in outs:
            st = sim._reqs.get(o.request_id)
            if st is not None and o.first_token:
                got.append((int(o.request_id[1:]), now - st.arrival))
        outputs(r, outs, now)

    sim._outputs = recorded
    asyncio.run(sim.run())
    return got


def main() -> None:
    wl, seeds, load, n = sys.argv[1], seeds_arg(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    text = TextSource()
    policy = load_policy(builtin_policy_path("default"))
    knee = simulated_knee(wl, 4, text)
    workloads = [make_workload(wl, n, 4, load * knee, s, text) for s in seeds]
    cut = n // 5
    print(f"{wl}, {len(seeds)} seeds x {n} requests at {load:.0%}; first fifth = requests < {cut}")
    print("| rule | TTFT p99 s (mean of seeds) | pooled p99 s | mean s | first fifth: p99 / mean s "
          "| the rest: p99 / mean s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for rule in ("expected_latency", "oracle"):
        every: list[float] = []
        first: list[float] = []
        rest: list[float] = []
        per_seed: list[float] = []
        for w in workloads:
            got = run(rule, w, policy)
            per_seed.append(percentile([t for _, t in got], 99))
            for i, ttft in got:
                every.append(ttft)
                (first if i < cut else rest).append(ttft)
        print(
            f"| {rule} | {statistics.fmean(per_seed):.3f} | {percentile(every, 99):.3f} | "
            f"{statistics.fmean(every):.3f} | "
            f"{percentile(first, 99):.3f} / {statistics.fmean(first):.3f} | "
            f"{percentile(rest, 99):.3f} / {statistics.fmean(rest):.3f} |",
            flush=True,
        )
        print("  per seed: " + ", ".join(f"{x:.3f}" for x in per_seed), flush=True)


main()
