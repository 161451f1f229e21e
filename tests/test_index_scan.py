"""The lookup's binary search over run certificates, in both backends.

* On consistent data (entry values as the agent's mirror writes them, :func:`chain_values`;
  pending entries written as whole chains from the root, as the gateway does) every backend
  must equal the exact definition, :func:`cachecore.index.base.longest_prefix`, for prompts
  that mix every per-key state (stored on one or several tiers, holes, tier changes, pending,
  expired pending, expiring exactly now), many replicas per lookup.
* On arbitrary data (any valid entry values, pending keys anywhere) the Redis script and
  MemoryIndex must still give identical answers: they run the same steps.
"""

from __future__ import annotations

import random

import pytest

from cachecore.index.base import PrefixIndex, PrefixMatch, ReplicaState, longest_prefix
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import ALL_TIERS, IndexWrite, Tier, chain_values
from cachecore.testing import PATIENT_TIMEOUT_S

pytestmark = pytest.mark.redis

NOW = 10_000
G, C, D, R = int(Tier.GPU), int(Tier.CPU), int(Tier.DISK), int(Tier.REMOTE)
TIER_SETS = (0, G, G, G, G | C, C, G | D | R, G | C | D | R)
VALID_VALUES = (1, 2, 3, 9, 15, 0x101, 0x13, 0x123, 0x1FF, 0x122)


class Case:
    """One replica's contents over a prompt of ``n`` keys: tier bits per key, and pending
    writes (prefix length, expiry relative to NOW) applied in order."""

    def __init__(self, bits: list[int], pending: list[tuple[int, int]]) -> None:
        self.bits = bits
        self.pending = pending

    def pending_flags(self) -> list[bool]:
        expiry = [0] * len(self.bits)
        for length, rel in self.pending:
            for i in range(length):
                expiry[i] = max(expiry[i], NOW + rel)
        return [e > NOW for e in expiry]


def _consistent_cases(rng: random.Random, n: int, count: int) -> list[Case]:
    full = [G] * n
    cases = [
        Case(full, []),
        Case([0] * n, []),
        Case([0] * n, [(n, 500)]),
        Case([*full[: n // 2], 0, *full[n // 2 + 1 :]], [(n // 2 + 3, 500)]),  # hole, pending
        Case([G | C] * 3 + [G] * 3 + [C] * (n - 6), []),  # a tier run ends, one starts late
        Case(full, [(n, -1)]),
        Case(full[:5] + [0] * (n - 5), [(7, 0), (6, 1)]),  # one expires exactly now
    ]
    while len(cases) < count:
        # runs of the same tier set: what engines produce (a few changes per prompt)
        bits: list[int] = []
        while len(bits) < n:
            bits.extend([rng.choice(TIER_SETS)] * rng.randint(1, max(1, n // 3)))
        pending = [
            (rng.randint(0, n), rng.choice((-1, 0, 1, 500))) for _ in range(rng.randint(0, 3))
        ]
        cases.append(Case(bits, pending))
    for case in cases:  # the fixed cases are written for long prompts
        case.bits = (case.bits + [0] * n)[:n]
        case.pending = [(min(length, n), rel) for length, rel in case.pending]
    return cases


async def _load(idx: PrefixIndex, rid: str, keys: list[bytes], case: Case) -> None:
    await idx.set_state(rid, ReplicaState.LIVE, 0)
    blocks = {k: v for k, v in zip(keys, chain_values(case.bits), strict=True) if v}
    if blocks:
        await idx.apply(rid, 0, IndexWrite(blocks), 0)
    for length, rel in case.pending:
        # written at NOW - 1000 with a TTL, so the expiry is NOW + rel
        await idx.add_pending(rid, keys[:length], 1000 + rel, NOW - 1000)


def _expected(case: Case, n: int) -> PrefixMatch:
    tiers, stored, pend = longest_prefix(case.bits[:n], case.pending_flags()[:n])
    return PrefixMatch(tiers, stored, pend, ReplicaState.LIVE)


def _index(backend: str, request: pytest.FixtureRequest) -> PrefixIndex:
    if backend == "redis":
        return RedisIndex.from_url(
            request.getfixturevalue("redis_url"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    return MemoryIndex()


@pytest.mark.parametrize("n", [1, 2, 9, 40])
@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_search_is_exact_on_consistent_data(
    backend: str, n: int, request: pytest.FixtureRequest
) -> None:
    keys = BlockKeyer(2).keys(list(range(2 * n)), "kvg1:scan", "m")
    idx = _index(backend, request)
    cases = _consistent_cases(random.Random(n), n, count=96)
    try:
        rids = [f"c{i}" for i in range(len(cases))]
        for rid, case in zip(rids, cases, strict=True):
            await _load(idx, rid, keys, case)
        for start in range(0, len(rids), 16):  # several replicas per lookup
            group = rids[start : start + 16]
            got = await idx.lookup(keys, group, NOW)
            for rid in group:
                case = cases[int(rid[1:])]
                assert got[rid] == _expected(case, n), (rid, case.bits, case.pending, got[rid])
        # a shorter prompt after a longer one: nothing of the longer one may leak
        short = max(1, n // 3)
        got = await idx.lookup(keys[:short], rids[:16], NOW)
        for rid in rids[:16]:
            assert got[rid] == _expected(cases[int(rid[1:])], short)
        if n >= 9:
            assert {t for m in got.values() for t in m.tier_blocks} == set(ALL_TIERS)
    finally:
        await idx.close()


async def test_redis_and_memory_agree_on_arbitrary_data(request: pytest.FixtureRequest) -> None:
    rng = random.Random(7)
    n = 24
    keys = BlockKeyer(2).keys(list(range(2 * n)), "kvg1:any", "m")
    red = RedisIndex.from_url(
        request.getfixturevalue("redis_url"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    mem = MemoryIndex()
    try:
        rids = [f"x{i}" for i in range(64)]
        for rid in rids:
            for idx in (mem, red):
                await idx.set_state(rid, ReplicaState.LIVE, 0)
            blocks = {k: rng.choice(VALID_VALUES) for k in keys if rng.random() < 0.8}
            pend = [k for k in keys if rng.random() < 0.3]
            rel = rng.choice((-1, 0, 500))
            for idx in (mem, red):
                await idx.apply(rid, 0, IndexWrite(blocks), 0)
                await idx.add_pending(rid, pend, 1000 + rel, NOW - 1000)
        for length in (1, 5, n):
            for start in range(0, len(rids), 16):
                group = rids[start : start + 16]
                a = await mem.lookup(keys[:length], group, NOW)
                b = await red.lookup(keys[:length], group, NOW)
                assert a == b
    finally:
        await red.close()
