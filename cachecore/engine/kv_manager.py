"""Per-request KV block bookkeeping on top of the :class:`BlockPool` (vLLM's
KVCacheManager for one full-attention group): prefix-cache lookup, slot allocation, caching
of newly full blocks, freeing."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from cachecore.engine.block_pool import BlockPool, KVBlock
from cachecore.engine.hashing import EngineHasher
from cachecore.engine.request import RequestState

_REF_CNT = attrgetter("ref_cnt")  # read over a request's hit blocks at admission


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative, in tokens (vLLM's prefix_cache_queries/hits)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self, pool: BlockPool, hasher: EngineHasher, drop_last_hit_block: bool = False
    ) -> None:
        self.pool = pool
        self.hasher = hasher
        self.drop_last_hit_block = drop_last_hit_block  # EngineConfig's (vLLM's use_eagle)
        self.block_size = pool.block_size
        self.prefix_stats = PrefixCacheStats()

    def _ensure_hashes(self, req: RequestState, n_blocks: int) -> None:
        """Compute the request's chained block hashes up to ``n_blocks`` full blocks."""
        have = len(req.block_hashes)
        if have >= n_blocks:
            return
        bs = self.block_size
        parent = req.block_hashes[-1] if have else None
        prompt = req.prompt_bytes
        if prompt and n_blocks * bs <= req.num_prompt_tokens:
            # prompt blocks (the admission's lookup): from the bytes the fingerprint used
            hashes = self.hasher.chain_bytes(
                parent, prompt[have * bs * 4 : n_blocks * bs * 4], bs, have, req.extra_keys
            )
            if (n_blocks + 1) * bs > req.num_prompt_tokens:
                req.prompt_bytes = b""  # every full prompt block is hashed: not needed again
        else:
            hashes = self.hasher.chain(
                parent, req.all_token_ids[have * bs : n_blocks * bs], bs, have, req.extra_keys
            )
        req.block_hashes.extend(hashes)

    def get_computed_blocks(self, req: RequestState) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, capped so at least one prompt token is
        computed (the last token's logits are needed: a fully cached block-aligned prompt
        recomputes its last block). Returns the blocks and their token count. The caller
        records ``prefix_stats`` once the request is admitted (a blocked queue head is looked
        up again every step and must not count twice)."""
        if req.skip_reading_prefix_cache:
            return [], 0  # vLLM's early return: its blocks are hashed and cached later
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        # every full prompt block's hash at once (as vLLM does when a request arrives):
        # one chained pass, and the blocks get registered under them later anyway
        self._ensure_hashes(req, max_blocks)
        hits = self.pool.longest_cached_prefix(req.block_hashes[:max_blocks])
        if hits and self.drop_last_hit_block:
            hits.pop()  # vLLM under EAGLE/MTP: after the cap; the block is recomputed
        return hits, len(hits) * bs

    def num_blocks_needed(self, req: RequestState, num_new_tokens: int, num_hit_blocks: int) -> int:
        total = req.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        return -(-total // self.block_size) - len(req.blocks) - num_hit_blocks

    def allocate_slots(
        self,
        req: RequestState,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Reserve slots for ``num_new_tokens`` more tokens (after taking the prefix hit
        ``new_computed_blocks``, for a request being admitted) and register the blocks that
        become full. False, with nothing changed, when the free queue is too short: for the
        new tokens, or with ``full_sequence_must_fit`` (vLLM's admission rule) for the
        request's whole sequence, though only the new tokens' blocks are allocated."""
        hits = new_computed_blocks or []
        need = self.num_blocks_needed(req, num_new_tokens, len(hits))
        # hit blocks that sit in the free queue are taken out of it by touch()
        evictable_hits = list(map(_REF_CNT, hits)).count(0)
        check = need
        if full_sequence_must_fit:
            rest = req.num_tokens - req.num_computed_tokens - len(hits) * self.block_size
            check = max(need, self.num_blocks_needed(req, rest, len(hits)))
        if max(check, 0) + evictable_hits > self.pool.num_free_blocks:
            return False
        if hits:
            self.pool.touch(hits)
            req.blocks.extend(hits)
            req.num_cached_blocks = len(req.blocks)
            req.num_computed_tokens += len(hits) * self.block_size
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        n_full = min(req.num_computed_tokens + num_new_tokens, req.num_tokens) // self.block_size
        self.cache_blocks(req, n_full)
        return True

    def cache_blocks(self, req: RequestState, n_full: int) -> None:
        """Register the request's blocks ``num_cached_blocks .. n_full-1`` (now full)."""
        start = req.num_cached_blocks
        if n_full <= start:
            return
        bs = self.block_size
        xk = req.extra_keys
        if n_full == start + 1 and start and n_full * bs > req.num_prompt_tokens:
            # one block holding output tokens (a decode step filled it): most registrations;
            # the same hash and registration as below without the batch's lists
            hashes = req.block_hashes
            tokens = req.all_token_ids[start * bs : n_full * bs]
            parent = hashes[start - 1]
            if len(hashes) == start:  # >= start: blocks before it were registered
                hashes.append(self.hasher.next_hash(parent, tokens, xk.rest_bytes))
            self.pool.cache_full_block(
                req.blocks[start], hashes[start], parent, tokens, xk.rest, req.lora_id,
                req.lora_name,
            )  # fmt: skip
            req.num_cached_blocks = n_full
            return
        self._ensure_hashes(req, n_full)
        self.pool.cache_full_blocks(
            req.blocks[start:n_full],
            req.block_hashes[start:n_full],
            req.block_hashes[start - 1] if start else None,
            req.all_token_ids[start * bs : n_full * bs],
            # xk(i) for each block: the salt's keys in block 0, the rest's after
            [xk.first] + [xk.rest] * (n_full - 1) if start == 0 else [xk.rest] * (n_full - start),
            lora_id=req.lora_id,
            lora_name=req.lora_name,
        )
        req.num_cached_blocks = n_full

    def free(self, req: RequestState) -> None:
        """Release the request's blocks tail-first (its last blocks are evicted first)."""
        if req.blocks:
            self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0
