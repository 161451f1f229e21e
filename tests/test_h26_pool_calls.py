"""The block pool's per-block paths make no ``typing.cast`` call: a Python function call per
block (167 per simulated request at 256 replicas), for a no-op the type checker alone needs.
The events those paths send keep their wire hashes."""

from __future__ import annotations

import sys
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from cachecore.engine.block_pool import BlockPool
from cachecore.engine.hashing import EngineHasher, ExtraKeysFn, WireHashFormat, to_wire
from cachecore.kvevents import BlockRemoved, BlockStored

BS = 4


@contextmanager
def _casts() -> Iterator[list[int]]:
    """Count the calls of ``typing.cast`` made inside the block."""
    seen = [0]
    cast_code = typing.cast.__code__

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is cast_code:
            seen[0] += 1

    old: Callable[..., Any] | None = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(old)


def test_allocate_cache_evict_and_free_call_no_cast_per_block() -> None:
    pool = BlockPool(8, BS, WireHashFormat.INT)
    hasher = EngineHasher()
    extra = ExtraKeysFn(None, None)
    tokens = list(range(6 * BS))
    hashes = hasher.chain(None, tokens, BS, 0, extra)
    with _casts() as seen:
        blocks = pool.allocate(5)
        one = pool.allocate_one()
        pool.cache_full_block(one, hashes[5], hashes[4], tokens[5 * BS :], extra(5))
        pool.free([*blocks, one])  # 5 uncached to the head, 1 cached to the tail
        more = pool.allocate(8)  # takes every block: evicts the cached one
        pool.free(more)
    assert seen[0] == 0
    events = pool.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    wire = to_wire(hashes[5], WireHashFormat.INT)
    assert [e.block_hashes for e in stored] == [[wire]]
    assert stored[0].parent_block_hash == to_wire(hashes[4], WireHashFormat.INT)
    assert [e.block_hashes for e in removed] == [[wire]]
    assert pool.num_free_blocks == 8
