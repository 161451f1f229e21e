"""Every engine step of one simulated replica between two virtual times (mooncake-groups,
120 requests, 85% of the knee = 3.24 requests/s): workload seed, router seed, replica
index, from, to.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-04e/sim_trace.py 0 0 1 1.5 9
"""

import asyncio
import sys

from cachecore.engine.core import StepResult
from cachecore.engine.request import EngineRequest
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

seed, sd, rep = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
t0, t1 = float(sys.argv[4]), float(sys.argv[5])
text = TextSource()
pol = load_policy(builtin_policy_path("default"))
cfg = SimConfig(
    replicas=4,
    profile="8b-h100",
    num_blocks=4096,
    block_size=BLOCK_SIZE,
    seed=sd,
    strategy=Strategy.EXPECTED_LATENCY,
)
sim = FleetSimulator(cfg, pol, make_workload("mooncake-groups", 120, 4, 3.24, seed, text))
engine = sim.engines[rep]
orig_step, orig_add = engine.step, engine.add_request


def step(now: float) -> StepResult:
    res = orig_step(now)
    if t0 <= now <= t1:
        # after the call the engine's state is that of the step's end
        done = [
            (r.request_id, r.num_computed_tokens, r.num_prompt_tokens)
            for r in engine.running
            if r.num_computed_tokens <= r.num_prompt_tokens
        ]
        firsts = [o.request_id for o in res.outputs if o.first_token]
        waiting = [x.request_id for x in engine.waiting]
        print(
            f"step {now:.3f} dur {res.duration_s:.3f} running {len(engine.running)} "
            f"waiting {waiting} prompt (id, computed, length) {done[:6]} first tokens {firsts}"
        )
    return res


def add(req: EngineRequest, now: float) -> None:
    if t0 <= now <= t1:
        print(f"ADD {now:.3f} {req.request_id} n {len(req.prompt_token_ids)}")
    orig_add(req, now)


engine.step = step  # type: ignore[method-assign]
engine.add_request = add  # type: ignore[method-assign]
asyncio.run(sim.run())
