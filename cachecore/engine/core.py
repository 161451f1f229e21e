"""The simulated engine core: vLLM v1's scheduler over the prefix-caching block pool, with
a step-time model instead of a GPU. Clock-agnostic: callers pass ``now`` (any monotonic
clock, real or virtual) and decide how long to wait for ``StepResult.duration_s``; nothing
here sleeps, reads a clock or uses asyncio, so a real-time HTTP replica and a virtual-time
fleet simulator run the same code.

Scheduling policy (vLLM v1, FCFS, chunked prefill):

1. RUNNING requests first, in admission order; each asks for all its missing tokens (one,
   when decoding), capped by the step's remaining token budget (``max_num_batched_tokens``).
   When the pool cannot hold them, the NEWEST running request is preempted (its blocks freed,
   its cached blocks stay cached, it goes back to the FRONT of the waiting queue and is
   recomputed later), repeatedly, until the allocation fits or the request preempted itself.
2. If nobody was preempted, WAITING requests are admitted in order while the budget lasts and
   fewer than ``max_num_seqs`` run: prefix-cache hit (longest cached prefix of full blocks,
   at most ``num_tokens - 1`` tokens), then a chunk of the rest. The first one that does not
   fit stops admission (no skipping: FCFS).
3. A request whose known tokens are all computed samples one token. It finishes after exactly
   ``max_tokens`` tokens; its blocks are freed tail-first and stay cached.

All KV events of a step come back as one list (one vLLM event batch).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

from cachecore.engine.block_pool import BlockPool, CachedBlockInfo
from cachecore.engine.hashing import EngineHasher, ExtraKeysFn, HashAlgo, WireHashFormat
from cachecore.engine.kv_manager import KVCacheManager
from cachecore.engine.latency import PROFILES, LatencyProfile
from cachecore.engine.request import (
    EngineRequest,
    RequestOutput,
    RequestRejectedError,
    RequestState,
    RequestStatus,
)
from cachecore.engine.tokens import OutputTokens, bytes_fingerprint
from cachecore.keys import tokens_to_bytes
from cachecore.kvevents import KVEvent

if TYPE_CHECKING:
    from cachecore.tokenizer import HFTokenizer

DEFAULT_NUM_BLOCKS = 4096  # x 16 tokens = 65,536 tokens per replica
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_MODEL_LEN = 32768
_EXTRA_KEYS_MAX = 4096  # (adapter, salt) pairs whose ExtraKeysFn an engine keeps
_PLAN_TOKENS = 256  # output tokens worked out per request ahead of the steps that sample them


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine shape. ``None`` for max_num_seqs / max_num_batched_tokens takes the profile's.
    ``max_model_len`` is capped to the pool's capacity (vLLM refuses to start otherwise), so
    one request of any admissible length always fits alone and preemption always progresses.
    """

    profile: LatencyProfile = PROFILES["8b-h100"]
    num_blocks: int = DEFAULT_NUM_BLOCKS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    hash_algo: HashAlgo = HashAlgo.SHA256
    hash_seed: int | None = None  # None: random per engine instance, as vLLM
    wire_hash_format: WireHashFormat = WireHashFormat.INT
    lora_names: tuple[str, ...] = ()
    enable_events: bool = True
    # vLLM's scheduler_reserve_full_isl (default on): a waiting request is admitted only if
    # its whole sequence fits in the free blocks, not just its first chunk; otherwise a
    # long chunked prompt is admitted into a nearly full cache and preempted part-way
    reserve_full_sequence: bool = True
    # vLLM with EAGLE/EAGLE3/MTP speculative decoding (SpeculativeConfig.use_eagle()): every
    # prefix-cache hit loses its last matched block, recomputed for the drafter's hidden
    # states (FullAttentionManager.find_longest_cache_hit)
    drop_last_hit_block: bool = False

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1 or self.max_model_len < 2:
            raise ValueError("num_blocks, block_size must be >= 1 and max_model_len >= 2")
        if len(set(self.lora_names)) != len(self.lora_names):
            raise ValueError("duplicate LoRA names")

    @property
    def effective_max_num_seqs(self) -> int:
        return self.max_num_seqs or self.profile.max_num_seqs

    @property
    def effective_max_num_batched_tokens(self) -> int:
        return self.max_num_batched_tokens or self.profile.max_num_batched_tokens

    @property
    def effective_max_model_len(self) -> int:
        return min(self.max_model_len, self.num_blocks * self.block_size)

    @property
    def latency(self) -> LatencyProfile:
        return self.profile.with_overrides(
            max_num_seqs=self.effective_max_num_seqs,
            max_num_batched_tokens=self.effective_max_num_batched_tokens,
        )


@dataclass(slots=True)
class StepResult:
    """One engine step (or ``num_steps`` fast-forwarded decode steps)."""

    duration_s: float
    outputs: list[RequestOutput] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    num_steps: int = 1
    num_prefill_tokens: int = 0
    num_decode_seqs: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return self.num_prefill_tokens == 0 and self.num_decode_seqs == 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks in use by requests
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens served from the prefix cache at admission
    num_preemptions: int
    num_steps: int
    # prefill tokens computed, every chunk and recomputation after preemption (kvgate's
    # own counter; not vLLM's prompt_tokens)
    num_prompt_tokens_computed: int
    # vLLM's prompt_tokens / prompt_tokens_cached: each request's whole prompt and its
    # prefix-cache hit, added once, at its first token
    num_prompt_tokens: int
    num_prompt_tokens_cached: int
    num_generation_tokens: int
    num_finished: int
    num_evictions: int


def default_output_vocab(tokenizer: HFTokenizer | None = None) -> tuple[int, ...]:
    """Ids of the tokenizer's single-token words (the built-in tokenizer by default)."""
    if tokenizer is None:
        from cachecore.tokenizer import builtin_tokenizer

        tokenizer = builtin_tokenizer()
    return tokenizer.word_vocabulary.ids


class EngineCore:
    """See the module docstring. Not thread-safe; one instance per simulated replica."""

    def __init__(self, config: EngineConfig, output_vocab: Sequence[int] | None = None) -> None:
        self.config = config
        self.latency = config.latency
        self.block_size = config.block_size
        self.max_num_seqs = config.effective_max_num_seqs
        self.max_num_batched_tokens = config.effective_max_num_batched_tokens
        self.reserve_full_sequence = config.reserve_full_sequence
        self.max_model_len = config.effective_max_model_len
        self.hasher = EngineHasher(config.hash_algo, config.hash_seed)
        self.pool = BlockPool(
            config.num_blocks, config.block_size, config.wire_hash_format, config.enable_events
        )
        self.kv = KVCacheManager(self.pool, self.hasher, config.drop_last_hit_block)
        self.tokens = OutputTokens(
            output_vocab if output_vocab is not None else default_output_vocab()
        )
        self._lora_ids = {name: i + 1 for i, name in enumerate(config.lora_names)}
        self._extra_keys: dict[tuple[str | None, str | None], ExtraKeysFn] = {}
        self.running: list[RequestState] = []
        self.waiting: deque[RequestState] = deque()
        self._requests: dict[str, RequestState] = {}
        self._num_preemptions = 0
        self._num_steps = 0
        self._num_prompt_computed = 0
        self._num_prompt = 0
        self._num_prompt_cached = 0
        self._num_generated = 0
        self._num_finished = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineRequest, now: float) -> None:
        """Queue a request (FCFS). Raises RequestRejectedError for requests vLLM rejects."""
        n_prompt = len(request.prompt_token_ids)
        if n_prompt == 0:
            raise RequestRejectedError("the prompt is empty")
        if request.pooling:
            if n_prompt > self.max_model_len:
                raise RequestRejectedError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {n_prompt} tokens in the input for embedding "
                    "generation. Please reduce the length of the input."
                )
        elif request.max_tokens < 1:
            raise RequestRejectedError("max_tokens must be at least 1")
        elif n_prompt + request.max_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n_prompt + request.max_tokens} tokens ({n_prompt} in the "
                f"messages, {request.max_tokens} in the completion). Please reduce the length "
                "of the messages or completion."
            )
        if request.request_id in self._requests:
            raise RequestRejectedError(f"duplicate request id {request.request_id!r}")
        lora_id = None
        if request.lora_name is not None:
            lora_id = self._lora_ids.get(request.lora_name)
            if lora_id is None:
                raise RequestRejectedError(f"unknown LoRA adapter {request.lora_name!r}")
        salt = request.cache_salt
        if salt is not None and (not isinstance(salt, str) or not salt):
            # a string as vLLM takes it; the ExtraKeysFn cache below also relies on it
            # (1 == True == 1.0 would share one entry while their encodings differ)
            raise RequestRejectedError("cache_salt must be a non-empty string")
        ids = request.prompt_token_ids
        prompt_bytes = request.prompt_bytes
        if prompt_bytes is None:
            prompt_bytes = tokens_to_bytes(ids)
        elif len(prompt_bytes) != 4 * n_prompt or (
            prompt_bytes[:4] != tokens_to_bytes(ids[:1])
            or prompt_bytes[-4:] != tokens_to_bytes(ids[-1:])
        ):
            # trusted input (the caller converted the same ids), checked at constant cost:
            # bytes of another prompt would cache blocks under hashes they do not hold
            raise ValueError("prompt_bytes is not the prompt's ids as uint32")
        # one per (adapter, salt), immutable: its keys' msgpack encodings made once, not
        # per request (a tenant's requests share it)
        xk_key = (request.lora_name, request.cache_salt)
        extra_keys = self._extra_keys.get(xk_key)
        if extra_keys is None:
            if len(self._extra_keys) >= _EXTRA_KEYS_MAX:
                self._extra_keys.clear()
            extra_keys = self._extra_keys[xk_key] = ExtraKeysFn(*xk_key)
        state = RequestState(
            request_id=request.request_id,
            all_token_ids=list(ids),
            num_prompt_tokens=n_prompt,
            max_tokens=1 if request.pooling else request.max_tokens,
            extra_keys=extra_keys,
            fingerprint=bytes_fingerprint(prompt_bytes),
            arrival_time=now,
            cache_salt=request.cache_salt,
            lora_name=request.lora_name,
            lora_id=lora_id,
            prompt_bytes=prompt_bytes,
            skip_reading_prefix_cache=request.skip_reading_prefix_cache,
            pooling=request.pooling,
            output_plan=list(request.output_token_ids[: request.max_tokens]),
        )
        self._requests[request.request_id] = state
        self.waiting.append(state)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its blocks are freed (cached ones stay cached)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.ABORTED
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ stepping
    def _preempt(self, req: RequestState) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(req)

    def step(self, now: float) -> StepResult:
        """Schedule and "execute" one step. ``now`` is the step's start time."""
        kv = self.kv
        running = self.running
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[RequestState, int]] = []
        preempted: list[str] = []

        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.num_computed_tokens
            n = min(len(req.all_token_ids) - c, budget)
            if n == 1 and c % bs:
                # decode fast path: the token's slot is in the last block; register that
                # block if this token fills it (same outcome as allocate_slots)
                if (c + 1) % bs == 0:
                    kv.cache_blocks(req, (c + 1) // bs)
                scheduled.append((req, 1))
                budget -= 1
                i += 1
                continue
            scheduled_it = True
            while not kv.allocate_slots(req, n):
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    scheduled_it = False
                    break
            if not scheduled_it:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1

        if not preempted:
            waiting = self.waiting
            stats = kv.prefix_stats
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[0]
                hits, n_hit = kv.get_computed_blocks(req)
                n = min(req.num_tokens - n_hit, budget)
                if not kv.allocate_slots(req, n, hits, self.reserve_full_sequence):
                    break
                waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.num_cached_tokens < 0:
                    # first admission: vLLM's prefix-cache query/hit counters leave out the
                    # re-admissions of preempted requests (it counts those apart) and the
                    # requests that read no cache (it returns before recording them)
                    if not req.skip_reading_prefix_cache:
                        stats.requests += 1
                        stats.queries += req.num_tokens
                        stats.hits += n_hit
                    req.num_cached_tokens = n_hit
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = now
                running.append(req)
                scheduled.append((req, n))
                budget -= n

        return self._execute(scheduled, preempted)

    def _execute(
        self, scheduled: list[tuple[RequestState, int]], preempted: list[str]
    ) -> StepResult:
        n_prefill = 0
        n_decode = 0
        outputs: list[RequestOutput] = []
        any_finished = False
        pooled = 0
        for req, n in scheduled:
            ids = req.all_token_ids
            n_tokens = len(ids)
            n_out = n_tokens - req.num_prompt_tokens
            c = req.num_computed_tokens
            if n == 1 and n_out > 0 and c == n_tokens - 1:
                n_decode += 1
            else:
                n_prefill += n
            c += n
            req.num_computed_tokens = c
            if c < n_tokens:
                continue  # a prefill chunk: nothing sampled yet
            if req.pooling:
                # the prompt's hidden states are the answer: counted as vLLM counts a
                # prompt, finished with no token sampled
                self._num_prompt += req.num_prompt_tokens
                self._num_prompt_cached += req.num_cached_tokens
                self._finish(req)
                any_finished = True
                pooled += 1
                outputs.append(req.output([], True))
                continue
            plan = req.output_plan
            t = plan[n_out] if n_out < len(plan) else self._planned_tokens(req, n_out, 1)[0]
            ids.append(t)
            if n_out == 0:
                # vLLM counts a prompt when its first token comes out (IterationStats'
                # is_prefilling): whole, hits included, never its recomputation after a
                # preemption (a preempted request recomputes with n_out > 0)
                self._num_prompt += req.num_prompt_tokens
                self._num_prompt_cached += req.num_cached_tokens
            if n_out + 1 >= req.max_tokens:
                self._finish(req)
                any_finished = True
            outputs.append(req.output([t], n_out == 0))
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        self._num_steps += 1
        self._num_prompt_computed += n_prefill
        self._num_generated += len(outputs) - pooled
        return StepResult(
            duration_s=self.latency.step_time(n_prefill, n_decode),
            outputs=outputs,
            events=self.pool.take_events(),
            num_prefill_tokens=n_prefill,
            num_decode_seqs=n_decode,
            preempted=preempted,
        )

    def _planned_tokens(self, req: RequestState, start: int, count: int) -> list[int]:
        """``req``'s output tokens at positions ``start .. start+count-1`` from its plan,
        extended first when short (by up to _PLAN_TOKENS, never past ``max_tokens``): one
        vectorised pass per chunk instead of one per step or fast-forward."""
        plan = req.output_plan
        end = start + count
        have = len(plan)
        if end > have:
            upto = max(end, min(req.max_tokens, have + _PLAN_TOKENS))
            plan += self.tokens.tokens(req.fingerprint, have, upto - have)
        return plan[start:end]

    def _finish(self, req: RequestState) -> None:
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self._requests[req.request_id]
        self._num_finished += 1

    # ------------------------------------------------------------------ fast forward
    def decode_only(self) -> bool:
        """True when the next steps are pure decode of the current batch: every running
        request decodes and no waiting request can be admitted (none waits, or the batch is
        full)."""
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return False
        if self.waiting and len(running) < self.max_num_seqs:
            return False
        return all(r.is_decoding for r in running)

    def fast_forward(
        self, now: float, max_steps: int, max_duration_s: float | None = None
    ) -> StepResult:
        """Advance up to ``max_steps`` steps (and at most ``max_duration_s`` of step time,
        but at least one step) at once when the batch is decode-only; else one :meth:`step`.

        The outcome equals that many single steps: the same tokens, block allocations,
        evictions, cached blocks and events (in the same order, as one list), the same
        finishes. It stops before the step where a preemption would happen and at the step
        where the first request finishes. Cost: O(batch + block boundaries crossed).
        """
        if max_steps <= 1 or not self.decode_only():
            return self.step(now)
        running = self.running
        n = len(running)
        t_step = self.latency.step_time(0, n)
        k = min(max_steps, min(r.remaining_tokens for r in running))
        if max_duration_s is not None and t_step > 0:
            k = min(k, max(1, int(max_duration_s / t_step)))
        bs = self.block_size
        # Block-boundary crossings within steps 1..k, in single-step order: step, then
        # position in the batch, then allocation (kind 0) before caching (kind 1).
        crossings: list[tuple[int, int, int]] = []
        n_alloc = 0
        for idx, r in enumerate(running):
            c = r.num_computed_tokens  # step s computes the KV of position c + s - 1
            s_alloc = (-c) % bs + 1
            s_cache = (-c - 1) % bs + 1
            # the tuples built by C loops (a generator per request cost 1/3 of this)
            if s_alloc <= k:
                allocs = range(s_alloc, k + 1, bs)
                n_alloc += len(allocs)
                crossings += zip(allocs, repeat(idx), repeat(0))
            if s_cache <= k:
                crossings += zip(range(s_cache, k + 1, bs), repeat(idx), repeat(1))
        crossings.sort()
        free = self.pool.num_free_blocks
        if n_alloc > free:  # some allocation would preempt: stop before its step
            n_alloc = 0
            for pos, (s, _, kind) in enumerate(crossings):
                if kind == 0:
                    n_alloc += 1
                    if n_alloc > free:
                        k = s - 1
                        crossings = crossings[:pos]
                        while crossings and crossings[-1][0] > k:
                            crossings.pop()
                        break
        if k <= 1:
            return self.step(now)
        planned = self._planned_tokens
        new_tokens = [planned(r, r.num_output_tokens, k) for r in running]
        for r, toks in zip(running, new_tokens, strict=True):
            r.all_token_ids.extend(toks)
        kv, pool = self.kv, self.pool
        for s, idx, kind in crossings:
            r = running[idx]
            if kind == 0:
                r.blocks.append(pool.allocate_one())
            else:
                kv.cache_blocks(r, (r.num_computed_tokens + s) // bs)
        outputs: list[RequestOutput] = []
        any_finished = False
        for r, toks in zip(running, new_tokens, strict=True):
            r.num_computed_tokens += k
            if r.num_output_tokens >= r.max_tokens:
                self._finish(r)
                any_finished = True
            outputs.append(r.output(toks, False))
        if any_finished:
            self.running = [r for r in running if r.status is RequestStatus.RUNNING]
        self._num_steps += k
        self._num_generated += n * k
        return StepResult(
            duration_s=k * t_step,
            outputs=outputs,
            events=self.pool.take_events(),
            num_steps=k,
            num_decode_seqs=n,
        )

    # ------------------------------------------------------------------ cache control
    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache: succeeds (AllBlocksCleared) only when no block is in
        use, i.e. no request is running."""
        return self.pool.reset()

    def take_events(self) -> list[KVEvent]:
        """Events produced outside a step (e.g. by reset_prefix_cache)."""
        return self.pool.take_events()

    def cached_blocks(self) -> list[CachedBlockInfo]:
        return self.pool.cached_blocks()

    # ------------------------------------------------------------------ stats
    def stats(self) -> EngineStats:
        pool = self.pool
        ps = self.kv.prefix_stats
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=pool.usage(),
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=ps.queries,
            prefix_cache_hits=ps.hits,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            num_prompt_tokens_computed=self._num_prompt_computed,
            num_prompt_tokens=self._num_prompt,
            num_prompt_tokens_cached=self._num_prompt_cached,
            num_generation_tokens=self._num_generated,
            num_finished=self._num_finished,
            num_evictions=pool.num_evictions,
        )

    def num_tokens_in_flight(self) -> int:
        """Tokens (prompt + generated) of every running and waiting request: /get_load."""
        return sum(r.num_tokens for r in self.running) + sum(r.num_tokens for r in self.waiting)
