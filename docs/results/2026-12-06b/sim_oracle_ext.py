"""Could any rule that knows the present exactly lower mooncake-groups' TTFT tail if it also
counted the delay a placement imposes on the requests already waiting (the externality)?
D18's oracle of the present routed each request to the replica where the request's own TTFT
is lowest, given every engine's exact state (4% better p99). Here, for each arrival and each
replica, a copy of that replica's engine is stepped with and without the request until every
request waiting there for its first token (and the new one) has it. Rules:

* ``own``: the new request's own TTFT (D18's oracle);
* ``sum``: its own TTFT plus the delay it adds to the first tokens of the requests already
  waiting on that replica (the total TTFT the placement adds to the fleet);
* ``minmax``: the replica that keeps the largest predicted TTFT (since arrival) among the
  waiting requests of the whole fleet and the new one lowest; ties by ``sum``.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-06b/sim_oracle_ext.py \
        mooncake-groups 0-7 0.85 120 base,own,sum,minmax

Decode is stepped (``defer_decode`` off) so every engine is current at each arrival. The
copies know nothing of later arrivals. Deep copies of the engine recurse along its linked
free-block queue, hence the deep stack (a thread with 512 MiB).
"""

import asyncio
import copy
import math
import statistics
import sys
import threading
from typing import Any

from sim_variants import seeds_arg

from cachecore.engine.request import EngineRequest
from gateway.routing import Decision, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

MAX_STEPS = 10_000


class Oracle:
    def __init__(self, sim: Any, rule: str) -> None:
        self.sim, self.rule = sim, rule
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

        def o_route(i: int, item: Any, now: float) -> None:
            self.item, self.now = item, now
            route(i, item, now)

        def o_decide(req: Any, cands: Any, coeffs: Any, strategy: Any = None) -> Decision:
            d = decide(req, cands, coeffs, strategy)
            return Decision(self.best_replica(), d.strategy, "oracle", d.scores)

        sim._kick, sim._route, sim.router.decide = o_kick, o_route, o_decide

    def first_tokens(self, r: int, new: tuple[list[int], str] | None) -> dict[str, float]:
        """Absolute first-token times of the requests waiting on replica r (and the new
        one, id ``oracle``), stepping a copy of its engine."""
        sim, now = self.sim, self.now
        waiting = {rid for rid, st in sim._reqs.items() if st.replica == r and st.ttft is None}
        engine = copy.deepcopy(sim.engines[r])
        if new is not None:
            tokens, salt = new
            engine.add_request(EngineRequest("oracle", tokens, self.item.max_tokens, salt), now)
            waiting.add("oracle")
        busy = sim._busy[r]
        clock = max(now, self.busy_until[r]) if busy else now
        got: dict[str, float] = {}
        for _ in range(MAX_STEPS):
            if not waiting - got.keys() or not engine.has_work():
                break
            res = engine.step(clock)
            clock += res.duration_s if res.duration_s > 0 else 1e-4
            for o in res.outputs:
                if o.first_token and o.request_id in waiting:
                    got[o.request_id] = clock
        for rid in waiting - got.keys():  # its first token is in the step in flight
            got[rid] = self.busy_until[r] if busy and rid != "oracle" else math.inf
        return got

    def best_replica(self) -> str:
        sim = self.sim
        tokens = sim._tokens(self.item)[0]
        salt = sim._salt(self.item.tenant)
        n = len(sim.engines)
        arrival = {rid: st.arrival for rid, st in sim._reqs.items()}
        arrival["oracle"] = self.now
        with_new = [self.first_tokens(r, (tokens, salt)) for r in range(n)]
        own = [w["oracle"] - self.now for w in with_new]
        if self.rule == "own":
            return str(sim.ids[own.index(min(own))])
        without = [self.first_tokens(r, None) for r in range(n)]
        delta = [own[r] + sum(with_new[r][k] - t for k, t in without[r].items()) for r in range(n)]
        if self.rule == "sum":
            return str(sim.ids[delta.index(min(delta))])
        worst_without = [max((t - arrival[k] for k, t in w.items()), default=0.0) for w in without]
        worst_with = [max(t - arrival[k] for k, t in w.items()) for w in with_new]
        keys = []
        for r in range(n):
            others = max((worst_without[q] for q in range(n) if q != r), default=0.0)
            keys.append((round(max(others, worst_with[r]), 6), delta[r]))
        return str(sim.ids[keys.index(min(keys))])


def run(rule: str, w: Any, policy: Any) -> dict[str, float]:
    cfg = SimConfig(
        replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
        strategy=Strategy.EXPECTED_LATENCY, defer_decode=False,
    )  # fmt: skip
    sim = FleetSimulator(cfg, policy, w)
    if rule != "base":
        Oracle(sim, rule)
    return asyncio.run(sim.run()).row()


def main() -> None:
    wl, seeds, load, n = sys.argv[1], seeds_arg(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    rules = sys.argv[5].split(",")
    text = TextSource()
    policy = load_policy(builtin_policy_path("default"))
    knee = simulated_knee(wl, 4, text)
    works = [make_workload(wl, n, 4, load * knee, s, text) for s in seeds]
    print(f"{wl} at {load:.0%}, seeds {seeds}, {n} requests")
    for rule in rules:
        rows = [run(rule, w, policy) for w in works]
        p99 = [r["ttft_p99"] for r in rows]
        mean = statistics.fmean(r["ttft_mean"] for r in rows)
        hit = statistics.fmean(r["hit_rate"] for r in rows)
        print(
            f"{rule:8s} p99 {statistics.fmean(p99):.3f} mean {mean:.3f} hit {hit:.2%} | per seed "
            + " ".join(f"{x:.3f}" for x in p99),
            flush=True,
        )


# the engine's free block queue is a linked list (4d4fe95): deepcopy recurses along it
sys.setrecursionlimit(1_000_000)
threading.stack_size(1 << 29)
t = threading.Thread(target=main)
t.start()
t.join()
