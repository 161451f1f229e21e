"""Candidate routing terms for expected_latency, applied in the simulator by post-processing
the router's scores (``Router._score``) before the strategy picks, so the rest of the
decision (ties, the scope-tree tie-break) is the shipped code's."""

import math
from collections.abc import Callable, Sequence
from typing import Any

from gateway.routing import Candidate, Coefficients, ReplicaScore, RouteRequest

BUDGET = 8192  # the 8b-h100 profile's max_num_batched_tokens


def seeds_arg(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


Adjust = Callable[[RouteRequest, Sequence[Candidate], Coefficients, list[ReplicaScore]], None]


def chunk_ext(weight: float, decoders: str, misses_only: bool = False) -> Adjust:
    """The delay this request's first chunk adds to the step in which the replica's last
    queued prefill ends (vLLM fills a step's token budget with the next waiting request)."""

    def adjust(
        req: RouteRequest, cands: Sequence[Candidate], co: Coefficients, scores: list[ReplicaScore]
    ) -> None:
        pt = co.prefill_ms_per_token
        for s, c in zip(scores, cands, strict=True):
            ld = c.load
            if ld.queued_requests <= 0 or ld.queued_prefill_tokens <= 0 or pt <= 0:
                continue
            if misses_only and s.matched_blocks > 0:
                continue
            d = ld.running if decoders == "running" else max(0, ld.running - ld.queued_requests)
            cap = BUDGET - d
            if cap <= 0:
                continue
            tail = ld.queued_prefill_tokens % cap
            spare = cap - tail if tail > 0 else 0.0
            own = s.prefill_ms / pt
            e = weight * pt * min(own, spare)
            s.cost_ms += e

    return adjust


def budget_steps() -> Adjust:
    """The queue estimate with the engine's token budget: the queued prefill and this
    request's, packed into steps of ``BUDGET - running`` tokens, each step paying the step
    overhead and the decode of the running requests (the shipped model pays them once)."""

    def adjust(
        req: RouteRequest, cands: Sequence[Candidate], co: Coefficients, scores: list[ReplicaScore]
    ) -> None:
        pt = co.prefill_ms_per_token
        for s, c in zip(scores, cands, strict=True):
            ld = c.load
            cap = BUDGET - ld.running
            if cap <= 0 or pt <= 0:
                continue
            tokens = ld.queued_prefill_tokens + s.prefill_ms / pt
            steps = max(1, math.ceil(tokens / cap))
            s.cost_ms += (steps - 1) * (co.overhead_ms + co.decode_ms_per_running * ld.running)

    return adjust


VARIANTS: dict[str, Adjust | None] = {
    "base": None,
    "ext": chunk_ext(1.0, "running"),
    "ext_dec": chunk_ext(1.0, "decoding"),
    "ext_half": chunk_ext(0.5, "running"),
    "ext_miss": chunk_ext(1.0, "running", misses_only=True),
    "budget": budget_steps(),
}


def install(sim: Any, name: str) -> None:
    """Apply variant ``name`` to a simulator's router (``nofit``: the online fit off, the
    policy's coefficients, which are the simulated profile's, throughout)."""
    if name == "nofit":
        sim.fit_enabled = False
        return
    adjust = VARIANTS[name]
    if adjust is not None:
        router = sim.router
        score = router._score

        def scored(req: RouteRequest, cands: Sequence[Candidate], co: Coefficients) -> Any:
            out = score(req, cands, co)
            adjust(req, cands, co, out)
            return out

        router._score = scored
