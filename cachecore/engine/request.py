"""Requests as the engine sees them: the caller's :class:`EngineRequest`, the engine's
internal :class:`RequestState`, and the per-step :class:`RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from cachecore.engine.block_pool import KVBlock
from cachecore.engine.hashing import EngineHash, ExtraKeysFn

DEFAULT_MAX_TOKENS = 16


class RequestRejectedError(ValueError):
    """A request the engine cannot serve (too long for the model, bad parameters)."""


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV freed; recomputed later
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(StrEnum):
    LENGTH = "length"  # max_tokens reached: the only way a simulated request ends
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What a caller submits. ``cache_salt`` enters block 0's extra keys only;
    ``lora_name`` enters every block's (and must be one of the engine's adapters)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    cache_salt: str | None = None
    lora_name: str | None = None
    # the prompt's ids as uint32 little-endian (cachecore.keys.tokens_to_bytes), when the
    # caller has them already (the simulator builds them from cached pieces); None: the
    # engine converts them. Trusted: the engine checks only their length and first and
    # last id, so a caller that cannot vouch for them must leave them out
    prompt_bytes: bytes | None = None
    # vLLM's skip_reading_prefix_cache (prompt logprobs asked: cachecore.cacheread): no
    # prefix hit, and no prefix-cache query counted; the blocks are still cached
    skip_reading_prefix_cache: bool = False
    # a pooling request (an embedding): prefill only, as vLLM v1 runs one (its max_tokens
    # is 1 internally): it finishes at the step that computes its prompt's last token,
    # with no output token; ``max_tokens`` is not read
    pooling: bool = False
    # what the simulated model generates instead of its drawn words (a tool call the
    # replica decided on: cachecore.replica.toolcalls), its first ``max_tokens`` ids
    output_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class RequestOutput:
    """What one step (or one fast-forward) produced for one request."""

    request_id: str
    new_token_ids: list[int]
    num_output_tokens: int  # total generated so far, including new_token_ids
    first_token: bool  # new_token_ids starts with the request's first output token
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # tokens served from the prefix cache at first scheduling
    arrival_time: float
    first_scheduled_time: float | None
    num_preemptions: int


@dataclass(slots=True, eq=False)
class RequestState:
    """The engine's view of one request. ``all_token_ids`` = prompt + outputs so far; KV is
    computed for the first ``num_computed_tokens`` of them; ``blocks`` hold that KV (the
    first ``num_cached_blocks`` are registered in the prefix cache)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    extra_keys: ExtraKeysFn
    fingerprint: int
    arrival_time: float
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    num_cached_blocks: int = 0
    block_hashes: list[EngineHash] = field(default_factory=list)
    num_cached_tokens: int = -1  # set at first scheduling (vLLM's num_cached_tokens)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    # the output tokens of positions 0..len-1, worked out ahead in chunks (each a pure
    # function of the fingerprint and its position: EngineCore._planned_tokens)
    output_plan: list[int] = field(default_factory=list)
    # the prompt's ids as the hashes consume them (uint32 little-endian), made once for
    # the fingerprint and kept until the prompt's full blocks are hashed
    prompt_bytes: bytes = b""
    skip_reading_prefix_cache: bool = False  # EngineRequest's
    pooling: bool = False  # EngineRequest's

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - (len(self.all_token_ids) - self.num_prompt_tokens)

    @property
    def is_decoding(self) -> bool:
        """Has an output token and only that last token's KV is missing."""
        n = len(self.all_token_ids)  # num_tokens read once: called per request per step
        return n > self.num_prompt_tokens and self.num_computed_tokens == n - 1

    def output(self, new_token_ids: list[int], first_token: bool) -> RequestOutput:
        status = self.status
        reason = None
        if status is RequestStatus.FINISHED:
            reason = FinishReason.LENGTH
        elif status is RequestStatus.ABORTED:
            reason = FinishReason.ABORT
        cached = self.num_cached_tokens
        return RequestOutput(
            self.request_id,
            new_token_ids,
            len(self.all_token_ids) - self.num_prompt_tokens,
            first_token,
            reason is not None,
            reason,
            self.num_prompt_tokens,
            cached if cached > 0 else 0,
            self.arrival_time,
            self.first_scheduled_time,
            self.num_preemptions,
        )
