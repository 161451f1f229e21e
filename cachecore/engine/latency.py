"""Step-time model of a simulated engine, with named hardware profiles.

One engine step runs the prefill chunks and the decode tokens scheduled together::

    t_step = [P > 0] * (prefill_overhead + P * prefill_per_token)
           + [D > 0] * inter_token_latency * (1 + (decode_load_factor - 1) * (D - 1) / (S - 1))

P = prompt tokens actually computed in the step (prefix-cache hits cost nothing), D = decode
sequences in the step, S = max_num_seqs. A request alone therefore sees
``TTFT = prefill_overhead + uncached_tokens * prefill_per_token`` (llm-d-inference-sim's model,
when the prompt fits one step's token budget) and an inter-token latency that grows linearly
from ``inter_token_latency`` at one sequence to ``decode_load_factor`` times that at S.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LatencyProfile:
    name: str
    prefill_overhead_s: float
    prefill_per_token_s: float
    inter_token_latency_s: float
    max_num_seqs: int
    decode_load_factor: float = 1.5
    max_num_batched_tokens: int = 8192
    description: str = ""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.decode_load_factor < 1.0:
            raise ValueError("decode_load_factor must be >= 1")
        if min(self.prefill_overhead_s, self.prefill_per_token_s, self.inter_token_latency_s) < 0:
            raise ValueError("latencies must be >= 0")

    def prefill_time(self, prefill_tokens: int) -> float:
        if prefill_tokens <= 0:
            return 0.0
        return self.prefill_overhead_s + prefill_tokens * self.prefill_per_token_s

    def decode_time(self, decode_seqs: int) -> float:
        if decode_seqs <= 0:
            return 0.0
        span = self.max_num_seqs - 1
        load = min(decode_seqs - 1, span) / span if span > 0 else 0.0
        return self.inter_token_latency_s * (1.0 + (self.decode_load_factor - 1.0) * load)

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.prefill_time(prefill_tokens) + self.decode_time(decode_seqs)

    def ttft_alone(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """TTFT of a request alone on the engine: its uncached tokens in chunks of
        ``max_num_batched_tokens``, one step (and one step overhead) per chunk."""
        n = prompt_tokens - cached_tokens
        if n <= 0:
            return 0.0
        steps = -(-n // self.max_num_batched_tokens)
        return steps * self.prefill_overhead_s + n * self.prefill_per_token_s

    def with_overrides(self, **changes: object) -> LatencyProfile:
        return replace(self, **changes)  # type: ignore[arg-type]


PROFILES: dict[str, LatencyProfile] = {
    p.name: p
    for p in (
        LatencyProfile(
            name="8b-h100",
            prefill_overhead_s=0.030,
            prefill_per_token_s=250e-6,
            inter_token_latency_s=0.012,
            max_num_seqs=16,
            description="llm-d-inference-sim 8B/H100: conservative (slow) prefill",
        ),
        LatencyProfile(
            name="8b-h100-fast",
            prefill_overhead_s=0.030,
            prefill_per_token_s=60e-6,
            inter_token_latency_s=0.012,
            max_num_seqs=256,
            decode_load_factor=2.0,
            description="8B/H100 near vLLM's arithmetic: ~60 us per prefill token, 256 seqs",
        ),
        LatencyProfile(
            name="70b-tp8",
            prefill_overhead_s=0.080,
            prefill_per_token_s=500e-6,
            inter_token_latency_s=0.025,
            max_num_seqs=64,
            description="llm-d-inference-sim 70B/TP8",
        ),
    )
}


def get_profile(name: str) -> LatencyProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
