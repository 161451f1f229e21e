"""Would placing cold prompts where one pooled LRU would evict close the mooncake hit-rate
gap? In the simulator (4 replicas, the shipped policy, 85% of least_loaded's knee), a rule
beside expected_latency with knowledge no router has: when no replica holds any of the
prompt, among the replicas whose cost is within a band of the best it picks the one whose
next evictions (the head of its engine's free queue, as many blocks as the prompt needs)
hold the oldest freed content: per-replica LRUs then evict in the pooled LRU's order.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05h/sim_lru_place.py mooncake 0,1,5 tie 120

Arguments: workload, seeds (a comma list), band (``off``: expected_latency itself; ``tie``:
D9's no-match band, max(0.5 ms, 10% of the best cost); ``inf``: by cache age alone;
a number: that many ms), requests per seed.
"""

import asyncio
import dataclasses
import itertools
import statistics
import sys
from collections.abc import Iterable
from typing import Any

from cachecore.engine.block_pool import BlockPool, KVBlock
from cachecore.engine.latency import get_profile
from cachecore.traceanalysis import percentile
from gateway.routing import Decision, Strategy
from loadtest.bench_routers import BLOCK_SIZE, make_workload, simulated_knee, workload_bounds
from loadtest.simulate import FleetSimulator, SimConfig
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

workload, band = sys.argv[1], sys.argv[3]
seeds = [int(x) for x in sys.argv[2].split(",")]
n_requests = int(sys.argv[4])
text = TextSource()
policy = load_policy(builtin_policy_path("default"))
cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
                strategy=Strategy.EXPECTED_LATENCY)  # fmt: skip
knee = simulated_knee(workload, 4, text)


def run(seed: int) -> None:
    w = make_workload(workload, n_requests, 4, 0.85 * knee, seed, text)
    bound = workload_bounds(w, 4 * 4096, get_profile("8b-h100")).fleet_lru
    sim = FleetSimulator(cfg, policy, w)
    clock = itertools.count(1)  # events are processed in time order: a global free order
    freed_at: list[dict[int, int]] = [{} for _ in sim.engines]

    def recording_free(pool: BlockPool, stamps: dict[int, int]) -> Any:
        free = pool.free

        def wrapped(blocks: Iterable[KVBlock]) -> None:
            blocks = list(blocks)
            free(blocks)
            t = next(clock)
            for b in blocks:
                if not b.ref_cnt:
                    stamps[b.block_id] = t

        return wrapped

    for e, stamps in zip(sim.engines, freed_at, strict=True):
        e.pool.free = recording_free(e.pool, stamps)  # type: ignore[method-assign]

    def eviction_age(r: int, need: int) -> int:
        """The free stamp of the youngest cached block that ``need`` new blocks evict."""
        youngest = 0
        pool = sim.engines[r].pool
        for i, block_id in enumerate(pool.free_queue_ids()):
            if i >= need:
                break
            blk = pool.blocks[block_id]
            if blk.block_hash is not None:
                youngest = max(youngest, freed_at[r].get(blk.block_id, 0))
        return youngest

    decide = sim.router.decide
    moved = 0

    def deciding(req: Any, cands: Any, coeffs: Any, strategy: Any) -> Decision:
        nonlocal moved
        d = decide(req, cands, coeffs, strategy)
        if band == "off" or any(s.predicted_cached_tokens for s in d.scores):
            return d
        best = min(s.cost_ms for s in d.scores)
        width = {"tie": max(0.5, 0.1 * best), "inf": float("inf")}.get(band)
        limit = best + (float(band) if width is None else width)
        need = -(-req.prompt_tokens // BLOCK_SIZE)
        tied = [s for s in d.scores if s.cost_ms <= limit]
        pick = min(tied, key=lambda s: (eviction_age(sim._pos[s.replica], need), s.cost_ms))
        if pick.replica == d.replica:
            return d
        moved += 1
        return dataclasses.replace(d, replica=pick.replica)

    sim.router.decide = deciding  # type: ignore[method-assign]
    res = asyncio.run(sim.run())
    print(
        f"{workload} seed {seed} band {band}: hit {res.cached_tokens / res.prompt_tokens:.2%} "
        f"of a {bound:.2%} bound; TTFT mean {statistics.fmean(res.ttft):.3f} s, "
        f"p99 {percentile(res.ttft, 99):.3f} s; decisions moved {moved}",
        flush=True,
    )


for s in seeds:
    run(s)
