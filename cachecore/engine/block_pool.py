"""The paged KV-cache block pool with automatic prefix caching (vLLM v1 semantics).

A fixed set of ``num_blocks`` blocks of ``block_size`` token slots. A request holds a list of
blocks; a FULL block whose content is known gets a hash and is registered in the hash map so
later requests with the same prefix can reuse it. Free blocks (ref count 0) sit in an LRU
queue; a free block that still has a hash is an eviction candidate: it stays addressable
until the pool hands it out for new data, which evicts it (``BlockRemoved``).

Ordering rules copied from vLLM:

* allocation pops the HEAD of the free queue;
* a freed block with a hash goes to the TAIL (most recently used, evicted last); a freed block
  without a hash goes to the HEAD (it holds nothing reusable, so it is reused first);
* callers free a request's blocks tail-first, so a request's last blocks are evicted before
  its first ones (shared prefixes survive longest);
* blocks are never de-duplicated: two requests that compute the same block each register
  their own copy under the same hash; each copy's eviction emits its own ``BlockRemoved``.

Invariants (checked by :meth:`BlockPool.check_invariants`):

1. every block has ``ref_cnt >= 0``; a block is in the free queue iff ``ref_cnt == 0``;
2. a block has a hash iff it is registered in the hash map, exactly once, under that hash;
   only full blocks get a hash;
3. a block in use (``ref_cnt > 0``) is never evicted: eviction only pops the free queue;
4. each registration emits the block in exactly one ``BlockStored``; a registration ends by
   eviction (one ``BlockRemoved`` for that copy) or by :meth:`reset` (``AllBlocksCleared``);
5. ``num_cached_blocks`` equals the number of blocks that have a hash;
6. each cached hash's first registered copy still held is the one prefix lookups return.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import cast

from cachecore.engine.hashing import EngineHash, ExtraKeys, WireHashFormat, int_hash, to_wire
from cachecore.kvevents import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class BlockPoolError(RuntimeError):
    """A caller broke the pool's contract (double free, touching a foreign block...)."""


class NoFreeBlocksError(BlockPoolError):
    """More blocks were requested than the free queue holds."""


class KVBlock:
    """One KV block. ``parent_hash``/``token_ids``/``extra_keys`` describe a cached block's
    content (what its BlockStored carried) so the pool can be dumped and compared;
    ``wire_hash`` is its hash as its events carry it (``to_wire``; None with events off),
    kept from its BlockStored for its BlockRemoved. These four are meaningful only while
    ``block_hash`` is set: an evicted block keeps stale values until it is cached again."""

    __slots__ = (
        "block_hash",
        "block_id",
        "extra_keys",
        "next_free",
        "parent_hash",
        "prev_free",
        "ref_cnt",
        "token_ids",
        "wire_hash",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: EngineHash | None = None
        self.parent_hash: EngineHash | None = None
        self.token_ids: Sequence[int] = ()
        self.extra_keys: ExtraKeys = None
        self.wire_hash: int | bytes | None = None
        # neighbours in the pool's free queue (both None while the block is not in it)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def _clear_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()
        self.extra_keys = None
        self.wire_hash = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


@dataclass(frozen=True, slots=True)
class CachedBlockInfo:
    """A cached block as ``GET /debug/blocks`` shows it."""

    block_id: int
    block_hash: int  # as decode_batch reports it (last 8 bytes of the digest)
    parent_block_hash: int | None
    digest: bytes  # the engine's full hash (what the events carry in bytes mode)
    token_ids: list[int]
    extra_keys: ExtraKeys
    ref_cnt: int

    @property
    def in_use(self) -> bool:
        return self.ref_cnt > 0


def _wire_hashes(hashes: Iterable[EngineHash], fmt: WireHashFormat) -> list[int]:
    # BlockStored/BlockRemoved are typed with the decoded (int) form; vLLM may also put the
    # raw digest on the wire, which encode_batch passes through unchanged.
    if fmt is WireHashFormat.BYTES:
        return cast("list[int]", list(hashes))
    return list(map(int_hash, hashes))  # to_wire's INT form, one C loop


class BlockPool:
    """Blocks, their ref counts, the free LRU queue and the hash map. Collects the KV events
    of everything it does; the engine takes them once per step (:meth:`take_events`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        wire_format: WireHashFormat = WireHashFormat.INT,
        enable_events: bool = True,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.wire_format = WireHashFormat(wire_format)  # a plain "int" / "bytes" too
        self.enable_events = enable_events
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # The free queue, vLLM's FreeKVCacheBlockQueue: a doubly linked list through the
        # blocks' prev_free/next_free, circular around a sentinel (its next_free is the
        # head, its prev_free the tail). O(1) pop-head, append-tail, push-head and remove
        # that touch only the block and its neighbours: no hash table (an OrderedDict's
        # insert was the costliest line of a simulated fleet's block frees).
        self._sentinel = sentinel = KVBlock(-1)
        prev = sentinel
        for blk in self.blocks:
            prev.next_free = blk
            blk.prev_free = prev
            prev = blk
        prev.next_free = sentinel
        sentinel.prev_free = prev
        self._num_free = num_blocks
        # hash -> {block_id: block}; several ids when several requests computed the same block
        self._cached: dict[EngineHash, dict[int, KVBlock]] = {}
        # hash -> the first registered copy (the first of its _cached entry): the prefix
        # lookup of every admission reads it, one dict get per block
        self._first: dict[EngineHash, KVBlock] = {}
        self._num_cached = 0
        self._events: list[KVEvent] = []
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def usage(self) -> float:
        """Fraction of blocks in use by requests (vLLM's kv_cache_usage_perc, 0..1); free
        blocks that still hold cached data count as free."""
        return 1.0 - self._num_free / self.num_blocks

    def get_cached_block(self, block_hash: EngineHash) -> KVBlock | None:
        """A cached block with this hash (the first registered copy), or None."""
        found = self.longest_cached_prefix((block_hash,))
        return found[0] if found else None

    def longest_cached_prefix(self, block_hashes: Sequence[EngineHash]) -> list[KVBlock]:
        """The cached block of each hash in order (the first registered copy), up to the
        first miss (vLLM's ``find_longest_cache_hit``): one call per request, not one per
        block."""
        # KVBlock has no __len__ or __bool__: every block is true, a miss (None) is not
        get: Callable[[EngineHash], KVBlock | None] = self._first.get
        return cast("list[KVBlock]", list(takewhile(bool, map(get, block_hashes))))

    def is_cached(self, block_hash: EngineHash) -> bool:
        return block_hash in self._cached

    # ------------------------------------------------------------------ mutations
    def allocate(self, n: int) -> list[KVBlock]:
        """``n`` blocks from the head of the free queue, each with ref_cnt 1; cached ones are
        evicted first (BlockRemoved)."""
        if n > self._num_free:
            raise NoFreeBlocksError(f"need {n} blocks, {self._num_free} free")
        out: list[KVBlock] = []
        sentinel = self._sentinel
        blk = sentinel
        for _ in range(n):
            blk = blk.next_free  # type: ignore[assignment]  # no cast(): a call per block
            blk.prev_free = None  # out of the queue (next_free cleared below, read first)
            if blk.block_hash is not None:
                self._evict(blk)
            blk.ref_cnt = 1
            out.append(blk)
        # the n blocks left the head at once: link the sentinel to the one after them
        head: KVBlock = blk.next_free  # type: ignore[assignment]
        for taken in out:
            taken.next_free = None
        sentinel.next_free = head
        head.prev_free = sentinel
        self._num_free -= n
        return out

    def allocate_one(self) -> KVBlock:
        """:meth:`allocate` of one block, without the list (a decode step crossing into a
        new block: most allocations)."""
        if not self._num_free:
            raise NoFreeBlocksError("need 1 blocks, 0 free")
        sentinel = self._sentinel
        blk: KVBlock = sentinel.next_free  # type: ignore[assignment]
        head: KVBlock = blk.next_free  # type: ignore[assignment]
        sentinel.next_free = head
        head.prev_free = sentinel
        blk.prev_free = blk.next_free = None
        self._num_free -= 1
        if blk.block_hash is not None:
            self._evict(blk)
        blk.ref_cnt = 1
        return blk

    def _evict(self, blk: KVBlock) -> None:
        """Drop a free cached block's hash (one BlockRemoved per block, as vLLM sends)."""
        h = blk.block_hash
        assert h is not None and blk.ref_cnt == 0
        copies = self._cached[h]
        del copies[blk.block_id]
        if not copies:
            del self._cached[h]
            del self._first[h]
        elif self._first[h] is blk:
            self._first[h] = next(iter(copies.values()))
        # the other content fields go stale (see KVBlock): one store instead of five
        blk.block_hash = None
        self._num_cached -= 1
        self.num_evictions += 1
        if self.enable_events:
            # the wire form its BlockStored computed, not converted again
            removed: list[int] = [blk.wire_hash]  # type: ignore[list-item]  # no cast() call
            self._events.append(BlockRemoved(removed, MEDIUM_GPU))

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A cache hit: take a reference, pulling free blocks out of the eviction queue."""
        for blk in blocks:
            ref = blk.ref_cnt
            if not ref:
                if blk.block_hash is None:
                    raise BlockPoolError(f"touching uncached free block {blk.block_id}")
                prev, nxt = blk.prev_free, blk.next_free
                prev.next_free = nxt  # type: ignore[union-attr]
                nxt.prev_free = prev  # type: ignore[union-attr]
                blk.prev_free = blk.next_free = None
                self._num_free -= 1
            blk.ref_cnt = ref + 1

    def free(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue in the
        given order (first given = evicted first among them)."""
        sentinel = self._sentinel
        for blk in ordered_blocks:
            ref = blk.ref_cnt - 1  # read once: a request frees 100+ blocks at its finish
            if not ref:  # the common case first: one test per block
                blk.ref_cnt = 0
                if blk.block_hash is None:  # nothing reusable: to the head, reused first
                    nxt: KVBlock = sentinel.next_free  # type: ignore[assignment]
                    blk.prev_free = sentinel
                    blk.next_free = nxt
                    sentinel.next_free = nxt.prev_free = blk
                else:  # to the tail: evicted last
                    last: KVBlock = sentinel.prev_free  # type: ignore[assignment]
                    blk.prev_free = last
                    blk.next_free = sentinel
                    sentinel.prev_free = last.next_free = blk
                self._num_free += 1
            elif ref > 0:
                blk.ref_cnt = ref
            else:
                raise BlockPoolError(f"double free of block {blk.block_id}")

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[EngineHash],
        parent_hash: EngineHash | None,
        token_ids: Sequence[int],
        extra_keys: Sequence[ExtraKeys],
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Register consecutive newly full blocks of one request (one BlockStored for all).

        ``token_ids`` are the blocks' tokens concatenated; ``parent_hash`` is the hash of the
        block before the first one in the request (None for a request's block 0)."""
        n = len(blocks)
        if not n:
            return
        bs = self.block_size
        if len(block_hashes) != n or len(extra_keys) != n or len(token_ids) != n * bs:
            raise BlockPoolError("cache_full_blocks: blocks, hashes, keys and tokens disagree")
        parent = parent_hash
        cached = self._cached
        first = self._first
        fmt = self.wire_format
        wires = _wire_hashes(block_hashes, fmt) if self.enable_events else [None] * n
        for i, blk in enumerate(blocks):
            if blk.block_hash is not None:
                raise BlockPoolError(f"block {blk.block_id} is already cached")
            if blk.ref_cnt <= 0:
                raise BlockPoolError(f"caching free block {blk.block_id}")
            h = block_hashes[i]
            blk.block_hash = h
            blk.parent_hash = parent
            blk.token_ids = token_ids[i * bs : (i + 1) * bs]
            blk.extra_keys = extra_keys[i]
            blk.wire_hash = wires[i]
            copies = cached.get(h)
            if copies is None:
                cached[h] = {blk.block_id: blk}
                first[h] = blk
            else:
                copies[blk.block_id] = blk
            parent = h
        self._num_cached += n
        if self.enable_events:
            has_extra = extra_keys.count(None) < n
            self._events.append(
                BlockStored(
                    block_hashes=cast("list[int]", wires),
                    parent_block_hash=None
                    if parent_hash is None
                    else cast("int", to_wire(parent_hash, fmt)),
                    token_ids=list(token_ids),
                    block_size=bs,
                    lora_id=lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=lora_name,
                    extra_keys=list(extra_keys) if has_extra else None,
                )
            )

    def cache_full_block(
        self,
        blk: KVBlock,
        block_hash: EngineHash,
        parent_hash: EngineHash | None,
        token_ids: list[int],
        extra_keys: ExtraKeys,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """:meth:`cache_full_blocks` of one block (what a decode step that fills a block
        registers): the same state and event without the batch's slices and loop.
        ``token_ids`` is kept by the block and its event: pass a list nobody changes
        afterwards."""
        if len(token_ids) != self.block_size:
            raise BlockPoolError("cache_full_blocks: blocks, hashes, keys and tokens disagree")
        if blk.block_hash is not None:
            raise BlockPoolError(f"block {blk.block_id} is already cached")
        if blk.ref_cnt <= 0:
            raise BlockPoolError(f"caching free block {blk.block_id}")
        blk.block_hash = block_hash
        blk.parent_hash = parent_hash
        blk.token_ids = token_ids
        blk.extra_keys = extra_keys
        copies = self._cached.get(block_hash)
        if copies is None:
            self._cached[block_hash] = {blk.block_id: blk}
            self._first[block_hash] = blk
        else:
            copies[blk.block_id] = blk
        self._num_cached += 1
        if self.enable_events:
            fmt = self.wire_format
            wire = blk.wire_hash = to_wire(block_hash, fmt)
            if parent_hash is None:
                parent_wire = None
            else:
                # the parent's own wire form when it is cached (a request's previous block
                # is, while the request holds it), not converted again
                held = self._first.get(parent_hash)
                parent_wire = held.wire_hash if held is not None else to_wire(parent_hash, fmt)
            # the event's int-typed fields hold either wire form (no cast() calls per block)
            stored: list[int] = [wire]  # type: ignore[list-item]
            parent_int: int | None = parent_wire  # type: ignore[assignment]
            self._events.append(
                BlockStored(
                    stored,
                    parent_int,
                    token_ids,  # shared with the block: neither changes it
                    self.block_size,
                    lora_id,
                    MEDIUM_GPU,
                    lora_name,
                    None if extra_keys is None else [extra_keys],
                )
            )

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's reset_prefix_cache). Only when no block is in use:
        returns False and changes nothing otherwise."""
        if self._num_free != self.num_blocks:
            return False
        for copies in self._cached.values():
            for blk in copies.values():
                blk._clear_hash()
        self._cached.clear()
        self._first.clear()
        self._num_cached = 0
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ introspection
    def cached_blocks(self) -> list[CachedBlockInfo]:
        out: list[CachedBlockInfo] = []
        for h, copies in self._cached.items():
            for blk in copies.values():
                out.append(
                    CachedBlockInfo(
                        block_id=blk.block_id,
                        block_hash=int_hash(h),
                        parent_block_hash=None
                        if blk.parent_hash is None
                        else int_hash(blk.parent_hash),
                        digest=h,
                        token_ids=list(blk.token_ids),
                        extra_keys=blk.extra_keys,
                        ref_cnt=blk.ref_cnt,
                    )
                )
        return out

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (head first). O(num_blocks): tests and debugging."""
        out: list[int] = []
        blk = self._sentinel.next_free
        while blk is not self._sentinel:
            assert blk is not None
            out.append(blk.block_id)
            blk = blk.next_free
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError when an invariant of the class docstring is broken.
        O(num_blocks): for tests and debugging, never on the hot path."""
        n_hashed = 0
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, f"negative ref count on {blk}"
            queued = blk.next_free is not None
            assert (blk.ref_cnt == 0) == queued, f"free queue vs {blk}"
            assert (blk.prev_free is not None) == queued, f"half-linked {blk}"
            if blk.block_hash is not None:
                n_hashed += 1
                copies = self._cached.get(blk.block_hash)
                assert copies is not None and copies.get(blk.block_id) is blk, f"unmapped {blk}"
                assert len(blk.token_ids) == self.block_size, f"partial block cached: {blk}"
                if self.enable_events:
                    want = to_wire(blk.block_hash, self.wire_format)
                    assert blk.wire_hash == want, f"wire hash of {blk}"
        n_mapped = 0
        for h, copies in self._cached.items():
            assert copies, f"empty copy set for {h.hex()}"
            assert self._first.get(h) is next(iter(copies.values())), f"first copy of {h.hex()}"
            for bid, blk in copies.items():
                assert blk.block_id == bid and blk.block_hash == h, f"map entry {bid} is {blk}"
                n_mapped += 1
        assert n_hashed == n_mapped == self._num_cached, (n_hashed, n_mapped, self._num_cached)
        assert len(self._first) == len(self._cached), "first copies"
        ids = self.free_queue_ids()
        assert len(ids) == len(set(ids)) == self._num_free, "free queue length"
        assert self._num_free == sum(1 for b in self.blocks if b.ref_cnt == 0)
        blk = self._sentinel
        for _ in range(self._num_free + 1):  # every link is mirrored by its back link
            nxt = blk.next_free
            assert nxt is not None and nxt.prev_free is blk, f"broken link after {blk}"
            blk = nxt
        assert blk is self._sentinel
