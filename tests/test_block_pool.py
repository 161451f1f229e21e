"""Block pool invariants under random operation sequences (hypothesis state machine),
following the pool's own KV events through the real codec."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachecore.engine.block_pool import BlockPool, BlockPoolError, KVBlock, NoFreeBlocksError
from cachecore.engine.hashing import EngineHasher, ExtraKeysFn, WireHashFormat, int_hash
from cachecore.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
    EventBatch,
    decode_batch,
    encode_batch,
)

BS = 4
NUM_BLOCKS = 16


def _tokens(family: int, diverge_at: int, n_blocks: int) -> list[int]:
    """Block i of the sequence: shared by every sequence of the family up to block
    ``diverge_at``, unique to (family, diverge_at) after it."""
    out: list[int] = []
    for i in range(n_blocks):
        base = family * 1000 + i * 10 if i < diverge_at else 50_000 + diverge_at * 100 + i
        out.extend(base + j for j in range(BS))
    return out


class BlockPoolMachine(RuleBasedStateMachine):
    """Requests arrive (longest cached prefix is touched, the rest allocated and cached,
    sometimes plus a partial tail block), finish (freed tail-first) or the cache is reset.
    The events are decoded and replayed into a copy counter that must always equal the
    pool's registered blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.hasher = EngineHasher(seed=7)
        self.live: dict[int, list[KVBlock]] = {}
        self.next_id = 0
        self.copies: Counter[int] = Counter()  # engine hash -> copies, from the events
        self.salted = False

    @initialize(fmt=st.sampled_from(list(WireHashFormat)), salted=st.booleans())
    def setup(self, fmt: WireHashFormat, salted: bool) -> None:
        self.pool = BlockPool(NUM_BLOCKS, BS, wire_format=fmt)
        self.salted = salted

    def _drain(self) -> None:
        events = self.pool.take_events()
        if not events:
            return
        batch = decode_batch(encode_batch(EventBatch(ts=0.0, events=events), Encoding.MAP))
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                assert ev.block_size == BS and ev.medium == "GPU"
                for h in ev.block_hashes:
                    self.copies[h] += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert self.copies[h] > 0, "BlockRemoved for a block never stored"
                    self.copies[h] -= 1
                    if not self.copies[h]:
                        del self.copies[h]
            elif isinstance(ev, AllBlocksCleared):
                self.copies.clear()

    @rule(
        family=st.integers(0, 2),
        diverge_at=st.integers(0, 5),
        n_blocks=st.integers(1, 6),
        partial_tail=st.booleans(),
    )
    def start_request(
        self, family: int, diverge_at: int, n_blocks: int, partial_tail: bool
    ) -> None:
        tokens = _tokens(family, diverge_at, n_blocks)
        xk = ExtraKeysFn(None, "kvg1:salt" if self.salted else None)
        hashes = self.hasher.chain(None, tokens, BS, 0, xk)
        hits: list[KVBlock] = []
        for h in hashes:
            blk = self.pool.get_cached_block(h)
            if blk is None:
                break
            hits.append(blk)
        assert self.pool.longest_cached_prefix(hashes) == hits  # the one-call lookup agrees
        need = n_blocks - len(hits) + (1 if partial_tail else 0)
        evictable = sum(1 for b in hits if b.ref_cnt == 0)
        held = {b.block_id for blocks in self.live.values() for b in blocks}
        if need + evictable > self.pool.num_free_blocks:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(self.pool.num_free_blocks + 1)
            return
        self.pool.touch(hits)
        new = self.pool.allocate(need)
        assert not {b.block_id for b in new} & held, "a block in use was handed out again"
        full_new = new[: n_blocks - len(hits)]
        start = len(hits)
        self.pool.cache_full_blocks(
            full_new,
            hashes[start:],
            hashes[start - 1] if start else None,
            tokens[start * BS :],
            [xk(i) for i in range(start, n_blocks)],
        )
        self.live[self.next_id] = hits + new
        self.next_id += 1
        self._drain()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        blocks = self.live.pop(rid)
        self.pool.free(reversed(blocks))
        self._drain()

    @rule()
    def reset(self) -> None:
        before = self.pool.num_cached_blocks
        ok = self.pool.reset()
        assert ok == (not self.live)
        if not ok:
            assert self.pool.num_cached_blocks == before
        self._drain()

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_invariants()

    @invariant()
    def events_mirror_the_pool(self) -> None:
        registered = Counter(
            int_hash(blk.block_hash) for blk in self.pool.blocks if blk.block_hash is not None
        )
        assert registered == self.copies

    @invariant()
    def held_blocks_keep_their_content(self) -> None:
        for blocks in self.live.values():
            for blk in blocks:
                assert blk.ref_cnt > 0


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _cache(pool: BlockPool, blocks: list[KVBlock], hashes: list[bytes]) -> None:
    pool.cache_full_blocks(
        blocks, hashes, None, list(range(BS * len(blocks))), [None] * len(blocks)
    )


def test_freed_tail_first_is_evicted_first() -> None:
    pool = BlockPool(4, BS)
    blocks = pool.allocate(3)
    hashes = [bytes([i]) * 32 for i in range(3)]
    _cache(pool, blocks, hashes)
    pool.free(reversed(blocks))  # tail first, as a finishing request does
    pool.take_events()
    # the never-used block 3 goes first (no hash), then block 2 (the tail), then 1
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [3, 2, 1]
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[int_hash(hashes[2])], [int_hash(hashes[1])]]
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_unhashed_free_block_goes_to_the_head() -> None:
    pool = BlockPool(3, BS)
    a, b, c = pool.allocate(3)
    _cache(pool, [a], [b"\x01" * 32])
    pool.free([a])  # cached: tail
    pool.free([b])  # partial / never cached: head
    assert pool.free_queue_ids() == [b.block_id, a.block_id]
    pool.free([c])
    assert pool.free_queue_ids() == [c.block_id, b.block_id, a.block_id]


def test_touch_pulls_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(2, BS)
    (a,) = pool.allocate(1)
    _cache(pool, [a], [b"\x02" * 32])
    pool.free([a])
    assert pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.check_invariants()


def test_duplicates_are_not_merged_and_each_copy_is_removed() -> None:
    pool = BlockPool(2, BS, wire_format=WireHashFormat.BYTES)
    h = b"\x03" * 32
    a, b = pool.allocate(2)
    _cache(pool, [a], [h])
    _cache(pool, [b], [h])
    stored = pool.take_events()
    # bytes mode: the raw digests travel as they are
    assert [list[object](e.block_hashes) for e in stored if isinstance(e, BlockStored)] == [
        [h],
        [h],
    ]
    pool.free([a])
    pool.free([b])
    pool.allocate(2)
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [list[object](e.block_hashes) for e in removed] == [[h], [h]]
    assert pool.num_cached_blocks == 0


@pytest.mark.parametrize("fmt", ["int", "bytes"])
def test_a_removal_travels_in_the_format_of_its_store(fmt: str) -> None:
    """A format given as its plain value (a CLI string) still puts a block's BlockRemoved in
    the same wire form as its BlockStored: one that differed would never match in the mirror
    (the eviction path once compared the format by identity with the enum)."""
    pool = BlockPool(1, BS, wire_format=fmt)  # type: ignore[arg-type]
    h = b"\x05" * 32
    (a,) = pool.allocate(1)
    _cache(pool, [a], [h])
    pool.free([a])
    pool.allocate(1)  # evicts it
    events = pool.take_events()
    stored = [e.block_hashes[0] for e in events if isinstance(e, BlockStored)]
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    want = int_hash(h) if fmt == "int" else h
    assert stored == [want] and removed == [want]


def test_reset_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(2, BS)
    (a,) = pool.allocate(1)
    _cache(pool, [a], [b"\x04" * 32])
    assert not pool.reset()
    assert pool.take_events() and pool.num_cached_blocks == 1  # only the BlockStored
    pool.free([a])
    assert pool.reset()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(b"\x04" * 32) is None
    pool.check_invariants()


def test_contract_violations_raise() -> None:
    pool = BlockPool(2, BS)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(BlockPoolError):
        pool.free([a])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    with pytest.raises(BlockPoolError):
        _cache(pool, [a], [b"\x05" * 32])  # a is free: cannot be registered


@pytest.mark.parametrize("lora, salt", [(None, None), (None, "kvg1:s"), ("ad", "kvg1:s")])
def test_chain_equals_block_by_block_hashes(lora: str | None, salt: str | None) -> None:
    """The chained pass gives the block_hash chain, with the salt in block 0 only, whether
    it starts at block 0 or continues a request from its last hash."""
    hasher = EngineHasher(seed=3)
    xk = ExtraKeysFn(lora, salt)
    tokens = list(range(5 * BS))
    expected: list[bytes] = []
    parent: bytes | None = None
    for i in range(5):
        parent = hasher.block_hash(parent, tokens[i * BS : (i + 1) * BS], xk(i))
        expected.append(parent)
    assert hasher.chain(None, tokens, BS, 0, xk) == expected
    tail = hasher.chain(expected[1], tokens[2 * BS :], BS, 2, xk)
    assert tail == expected[2:]
    unsalted = hasher.chain(None, tokens, BS, 0, ExtraKeysFn(lora, None))
    assert (unsalted[0] == expected[0]) == (salt is None)  # the salt goes into block 0
    assert hasher.next_hash(expected[2], tokens[3 * BS : 4 * BS], xk.rest_bytes) == expected[3]


@pytest.mark.parametrize("fmt", list(WireHashFormat))
@pytest.mark.parametrize("extra", [None, ("ad",)])
def test_one_block_paths_equal_the_batch_ones(
    fmt: WireHashFormat, extra: tuple[str] | None
) -> None:
    """allocate_one and cache_full_block leave the state and send the events that
    allocate(1) and cache_full_blocks of one block do, evictions included."""
    pools = [BlockPool(3, BS, wire_format=fmt) for _ in range(2)]
    for one, pool in enumerate(pools):
        parent = b"\x01" * 32
        for i in range(5):  # 3 blocks: the 4th and 5th allocations evict
            toks = list(range(i * BS, (i + 1) * BS))
            h = bytes([i + 2]) * 32
            if one:
                blk = pool.allocate_one()
                pool.cache_full_block(blk, h, parent, toks, extra, 1, "ad")
            else:
                (blk,) = pool.allocate(1)
                pool.cache_full_blocks([blk], [h], parent, toks, [extra], 1, "ad")
            pool.free([blk])
            parent = h
        pool.check_invariants()
    assert pools[0].take_events() == pools[1].take_events()
    assert pools[0].cached_blocks() == pools[1].cached_blocks()
    assert pools[0].free_queue_ids() == pools[1].free_queue_ids()
    empty = BlockPool(1, BS)
    empty.allocate_one()
    with pytest.raises(NoFreeBlocksError):
        empty.allocate_one()
    with pytest.raises(BlockPoolError):
        empty.cache_full_block(empty.blocks[0], b"\x09" * 32, None, [1], None)  # short
