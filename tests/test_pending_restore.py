"""A refused request's pending entries given back (GatewayIndex.withdraw): what it shared
with this gateway's other in-flight requests goes back to theirs, found without reading
every key of every request in flight (block keys are chained: two requests share one run
of positions). A real MemoryIndex as the primary."""

from __future__ import annotations

import time

import pytest

from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKey
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.timeout(60)

R = "r1"


def chain(tag: bytes, n: int, shared: list[BlockKey] | None = None) -> list[BlockKey]:
    """``n`` keys of a prompt: ``shared``'s (a common prefix) first, then its own."""
    own = [tag + b"%014d" % i for i in range(len(shared or []), n)]
    return [*(shared or []), *own]


def index() -> tuple[GatewayIndex, MemoryIndex]:
    mem = MemoryIndex()
    mem.set_state_now(R, ReplicaState.LIVE, 0)
    return GatewayIndex(mem, GatewayMetrics()), mem


async def pending(mem: MemoryIndex, keys: list[BlockKey], now_ms: int) -> int:
    return (await mem.lookup(keys, [R], now_ms))[R].pending_blocks


@pytest.mark.parametrize("their_start", [2, 7])
async def test_a_refusal_gives_back_the_run_it_shares_with_another_request(
    their_start: int,
) -> None:
    """Two prompts share blocks 0-9; the in-flight one was sent from block ``their_start``
    (the blocks before were stored), the refused one from block 5. The shared blocks go
    back to the in-flight request's expiry, the refused one's own blocks go."""
    gi, mem = index()
    common = chain(b"c", 10)
    a, b = chain(b"a", 20, common), chain(b"b", 20, common)
    now = 1_000_000
    theirs = gi.add_pending(R, a[their_start:], 5_000, now, their_start)
    refused = gi.add_pending(R, b[5:], 60_000, now + 1, 5)
    assert theirs is not None and refused is not None
    gi.withdraw(refused, now + 2)
    first = max(5, their_start)
    assert await pending(mem, b[first:10], now + 3) == 10 - first  # theirs again
    assert await pending(mem, b[first:10], now + 5_001) == 0  # at their expiry, not ours
    assert await pending(mem, b[10:], now + 3) == 0  # the refused request's own
    assert await pending(mem, a[10:], now + 3) == 10  # theirs, untouched
    if their_start > 5:
        assert await pending(mem, b[5:their_start], now + 3) == 0


async def test_a_refusal_costs_no_look_at_unrelated_requests_keys() -> None:
    """4,000 long requests in flight on the replica, none sharing a block with the refused
    one: the undo read every key of each (4 million), over 100 ms of the event loop per
    refused request (a client's too-long prompts, 400s, stalled every other request)."""
    gi, mem = index()
    now = int(time.time() * 1000)
    other = chain(b"o", 1024)
    for _ in range(4_000):  # one list shared: the keys are what the undo reads, not memory
        gi.add_pending(R, other, 60_000, now)
    best = float("inf")
    for n in range(5):
        w = gi.add_pending(R, chain(b"w%d" % n, 64), 60_000, now + 1)
        assert w is not None
        t0 = time.perf_counter()
        gi.withdraw(w, now + 2)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.02, f"{best * 1000:.1f} ms"
    assert await pending(mem, other, now + 3) == 1024


async def test_finished_writes_leave_no_per_replica_entry_behind() -> None:
    """Review: the in-flight table kept an empty set for every replica id it had seen, a
    slow growth where discovery brings replica ids and takes them away."""
    gi, _ = index()
    now = 1_000_000
    done = gi.add_pending(R, chain(b"a", 4), 5_000, now)
    refused = gi.add_pending(R, chain(b"b", 4), 5_000, now)
    assert done is not None and refused is not None
    gi.done(done)
    gi.withdraw(refused, now + 1)
    assert gi._inflight == {}
