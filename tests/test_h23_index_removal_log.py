"""The removal log when the agent's clock steps back (its ``now_ms`` is wall-clock time, which
NTP may step), and pending expiries set back by a withdrawal: both backends, a real
redis-server for RedisIndex."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.lifecycle import IndexWrite
from tests.test_index_backends import KEYS, make_index

pytestmark = pytest.mark.redis

T = 1_000_000


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    idx = make_index(request.param, request, removal_log=4)
    yield idx
    await idx.close()


async def test_a_removal_is_not_forgotten_when_a_later_one_is_stamped_earlier(
    index: PrefixIndex,
) -> None:
    """k removed at T, stored again, removed again after the agent's clock stepped back a
    second: the removal at T happened, so a check since T must be told so (the gateway's
    claim check asks exactly this; "never removed" accuses an honest agent of a false
    claim). It read as not removed: the second stamp overwrote the first."""
    k = KEYS[0]
    await index.apply("a", 0, IndexWrite({k: 1}), T - 10)
    await index.apply("a", 0, IndexWrite({k: 0}), T)
    await index.apply("a", 0, IndexWrite({k: 1}), T + 5)
    await index.apply("a", 0, IndexWrite({k: 0}), T + 5 - 1000)  # the clock stepped back
    assert await index.removal_times("a", [k], T) == [T]
    assert await index.removed_since("a", [k], T) == [True]
    # deleted and stored again within one write (the relog path), stamped earlier still
    await index.apply("a", 0, IndexWrite({k: 1}, removed={k}), T - 2000)
    assert await index.removal_times("a", [k], T) == [T]


async def test_both_backends_trim_the_log_alike_after_the_clock_stepped_back(
    index: PrefixIndex,
) -> None:
    """A log of 4, full with removals at T; one more stamped T - 1 (the clock stepped back).
    Redis trims the lowest time (that one), the log still complete from T; the memory
    backend trimmed the oldest logged (one of T) and read every check since T as "cannot
    tell" (its floor T), unlike Redis."""
    ks = KEYS[:5]
    await index.apply("a", 0, IndexWrite(dict.fromkeys(ks, 1)), T - 10)
    await index.apply("a", 0, IndexWrite(dict.fromkeys(ks[:4], 0)), T)
    await index.apply("a", 0, IndexWrite({ks[4]: 0}), T - 1)
    assert (await index.removal_floor("a")).floor_ms == T - 1
    assert await index.removal_times("a", ks, T) == [T, T, T, T, None]
    assert await index.removal_times("a", ks, T - 1) is None
    if isinstance(index, MemoryIndex):
        index.check_invariants()


async def test_a_later_add_does_not_lower_an_expiry_a_withdrawal_restored(
    index: PrefixIndex,
) -> None:
    """remove_pending may set a key back to a later expiry than any add gave (``restore``:
    another write's); an add with an expiry between must not lower it (``ZADD GT``). The
    memory backend's fast path for an add "later than every expiry held" did, while Redis
    kept it, so the two answered differently."""
    await index.set_state("a", ReplicaState.LIVE, 0)
    keys = KEYS[:3]
    await index.add_pending("a", keys, 100, 0)  # expiry 100
    await index.remove_pending("a", keys, 100, 0, restore=[500, 500, 500])
    await index.add_pending("a", keys, 200, 0)  # expiry 200 < 500: GT keeps 500
    got = await index.lookup(keys, ["a"], 300)
    assert got["a"].pending_blocks == 3
    if isinstance(index, MemoryIndex):
        index.check_invariants()


async def test_the_memory_removal_log_sheds_its_stale_heap_items() -> None:
    """A key removed again and again leaves one heap item per removal, all but the last
    stale: past a bound the heap is rebuilt from the log, which must still trim and answer
    as before (the log's invariants hold)."""
    index = MemoryIndex(removal_log=4)
    ks = KEYS[:3]
    t = T
    for _ in range(700):  # 2,100 removals of three keys
        for k in ks:
            await index.apply("a", 0, IndexWrite({k: 1}), t)
            await index.apply("a", 0, IndexWrite({k: 0}), t + 1)
            t += 2
    rep = index._replicas["a"]
    assert len(rep.removed_heap) <= 2 * len(rep.removed) + 1024
    index.check_invariants()
    assert await index.removal_times("a", ks, T) == [t - 5, t - 3, t - 1]
    await index.apply("a", 0, IndexWrite(dict.fromkeys(KEYS[3:6], 1)), t)
    await index.apply("a", 0, IndexWrite(dict.fromkeys(KEYS[3:6], 0)), t + 1)
    # a log of 4 holds the three latest and one of the earlier ones: the lowest trimmed
    assert await index.removal_times("a", ks, T) is None
    assert (await index.removal_floor("a")).floor_ms == t - 3
    assert await index.removal_times("a", [ks[2], *KEYS[3:6]], t - 2) == [t - 1] + [t + 1] * 3
    index.check_invariants()
