"""The lookup scan at chunk boundaries: every backend (RedisIndex with tiny and default
chunk sizes, MemoryIndex) must equal :func:`cachecore.index.base.longest_prefix` for short
prompts whose keys mix every per-key state (stored on one or several tiers, pending,
expired pending, absent), including stored keys after a pending gap that lie beyond the
last block-hash chunk read (the script's second HMGET path) and replicas looked up together
(the script splits the request's keys once and shares them across replicas)."""

from __future__ import annotations

import random

import pytest

from cachecore.index.base import PrefixIndex, PrefixMatch, ReplicaState, longest_prefix
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import ALL_TIERS, IndexWrite, Tier

pytestmark = pytest.mark.redis

N = 9
KEYS = BlockKeyer(2).keys(list(range(2 * N)), "kvg1:scan", "m")
NOW = 10_000
G, C, D, R = int(Tier.GPU), int(Tier.CPU), int(Tier.DISK), int(Tier.REMOTE)
KeyState = tuple[int, int | None]
"""Per key: (tier bits, pending expiry relative to NOW, or None for no pending entry)."""
STATES: tuple[KeyState, ...] = (
    (0, None),
    (G, None),
    (G, None),
    (G | C, None),
    (C, None),
    (G | D | R, None),
    (0, 500),  # pending
    (0, -1),  # expired pending
    (G, 500),  # stored and pending
    (0, 0),  # expires exactly now: not pending
)


def _cases(seed: int, count: int) -> list[list[KeyState]]:
    rng = random.Random(seed)
    hole: list[KeyState] = [(0, 500)]
    gpu: list[KeyState] = [(G, None)]
    cases: list[list[KeyState]] = [
        gpu * N,
        [(0, None)] * N,
        hole * N,
        # a hole that is pending, then stored keys that are not pending
        gpu * 3 + hole + gpu * (N - 4),
        gpu + hole + gpu * 2 + hole + gpu * (N - 5),
        [(G | C, None)] * 3 + gpu * 3 + hole * 2 + [(C, None)],
    ]
    # weighted towards stored and pending keys so that deep positions are reached
    weights = (1, 6, 6, 2, 1, 1, 4, 1, 2, 1)
    while len(cases) < count:
        cases.append(rng.choices(STATES, weights, k=N))
    return cases


def _expected(case: list[KeyState]) -> PrefixMatch:
    bits = [b for b, _ in case]
    pending = [p is not None and NOW + p > NOW for _, p in case]
    tiers, stored, pend = longest_prefix(bits, pending)
    return PrefixMatch(tiers, stored, pend, ReplicaState.LIVE)


async def _load(idx: PrefixIndex, rid: str, case: list[KeyState]) -> None:
    await idx.set_state(rid, ReplicaState.LIVE, 0)
    blocks = {k: b for k, (b, _) in zip(KEYS, case, strict=True) if b}
    if blocks:
        await idx.apply(rid, 0, IndexWrite(blocks), 0)
    for k, (_, p) in zip(KEYS, case, strict=True):
        if p is not None:
            # written at NOW - 1000 with a TTL, so the expiry is NOW + p
            await idx.add_pending(rid, [k], 1000 + p, NOW - 1000)


@pytest.mark.parametrize(
    ("backend", "first", "most"),
    [("redis", 1, 2), ("redis", 1, 3), ("redis", 2, 8), ("redis", 1, 512), ("memory", 0, 0)],
)
async def test_scan_matches_longest_prefix(
    backend: str, first: int, most: int, request: pytest.FixtureRequest
) -> None:
    idx: PrefixIndex
    if backend == "redis":
        idx = RedisIndex.from_url(
            request.getfixturevalue("redis_url"), first_chunk=first, max_chunk=most
        )
    else:
        idx = MemoryIndex()
    cases = _cases(seed=first * 100 + most, count=160)
    try:
        rids = [f"c{i}" for i in range(len(cases))]
        for rid, case in zip(rids, cases, strict=True):
            await _load(idx, rid, case)
        for start in range(0, len(rids), 16):  # several replicas per lookup
            group = rids[start : start + 16]
            got = await idx.lookup(KEYS, group, NOW)
            for rid in group:
                exp = _expected(cases[int(rid[1:])])
                assert got[rid] == exp, (rid, cases[int(rid[1:])], got[rid], exp)
        # a shorter prompt after a longer one: the shared split must not leak
        got = await idx.lookup(KEYS[:3], rids[:16], NOW)
        for rid in rids[:16]:
            exp = _expected(cases[int(rid[1:])][:3])
            assert got[rid] == exp
        assert {t for m in got.values() for t in m.tier_blocks} == set(ALL_TIERS)
    finally:
        await idx.close()
