"""Differential property test: MemoryIndex and RedisIndex (a real redis-server) driven by the
same random operation sequences must give identical answers, and both must equal a plain
model built from the shared lookup semantics (:func:`cachecore.index.base.longest_prefix`).

Operations: engine event batches turned into IndexWrites by a per-replica ReplicaMirror
(BlockStored with known/unknown parents, scoped/unscoped/ephemeral salts, several tiers,
duplicates; BlockRemoved; AllBlocksCleared -> new epoch), raw random IndexWrites, stale-epoch
writes, pending entries with TTLs and an advancing clock, clears, state changes, and lookups of
random key chains across several replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachecore.index.base import (
    ROUTABLE_STATES,
    PrefixIndex,
    PrefixMatch,
    ReplicaState,
    StaleEpochError,
    empty_match,
    longest_prefix,
    search_prefix,
)
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKey, BlockKeyer
from cachecore.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cachecore.lifecycle import TIER_MASK, IndexWrite, ReplicaMirror
from cachecore.testing import PATIENT_TIMEOUT_S

pytestmark = pytest.mark.redis

BS = 2
MODEL = "m"
ALPHABET = 3
REPLICAS = ("r0", "r1", "r2@dp1")
SALTS: tuple[str | None, ...] = ("kvg1:s0", "kvg1:s1", "kvg1:e:eph", None)
MEDIA = ("GPU", "CPU", None, "DISK", "weird")
STATES = (ReplicaState.LIVE, ReplicaState.COLD, ReplicaState.UNAVAILABLE, ReplicaState.UNKNOWN)
KEYER = BlockKeyer(BS)


def _tokens(seed: int, n_blocks: int) -> list[int]:
    return [(seed >> (2 * i)) % ALPHABET for i in range(n_blocks * BS)]


@dataclass
class EngineModel:
    """Plausible vLLM events for one replica from small integer choices. Engine hashes are
    content hashes (same parent + tokens + salt -> same hash, as in vLLM)."""

    paths: dict[int, tuple[str | None, list[int]]] = field(default_factory=dict)
    copies: dict[int, list[str | None]] = field(default_factory=dict)

    def stored(self, parent_pick: int, n: int, seed: int, medium: int, salt: int) -> BlockStored:
        known = sorted(self.paths)
        parent = known[parent_pick % len(known)] if known and parent_pick >= 0 else None
        if parent_pick < -1:
            parent = 999_999  # unknown parent: the mirror drops it
        toks = _tokens(seed, n)
        if parent is None or parent not in self.paths:
            salt_v, prefix = SALTS[salt % len(SALTS)], list[int]()
        else:
            salt_v, prefix = self.paths[parent]
        hashes: list[int] = []
        h_prev = parent
        for b in range(n):
            blk = toks[b * BS : (b + 1) * BS]
            h = xxhash.xxh3_64_intdigest(repr((h_prev, blk, salt_v)).encode())
            hashes.append(h)
            if parent != 999_999:
                self.paths[h] = (salt_v, prefix + toks[: (b + 1) * BS])
                self.copies.setdefault(h, []).append(MEDIA[medium % len(MEDIA)])
            h_prev = h
        extra: list[tuple[Any, ...] | None] | None = (
            [(salt_v,)] if (parent is None and salt_v is not None) else None
        )
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=toks,
            block_size=BS,
            medium=MEDIA[medium % len(MEDIA)],
            extra_keys=extra,
        )

    def removed(self, pick: int, medium: int) -> BlockRemoved:
        known = sorted(self.copies)
        if not known or pick < 0:
            return BlockRemoved([pick & 0xFFFF], MEDIA[medium % len(MEDIA)])
        h = known[pick % len(known)]
        # medium >= 0: a copy the engine really holds; else possibly a tier it does not
        med = self.copies[h][0] if medium >= 0 else MEDIA[medium % len(MEDIA)]
        if med in self.copies[h]:
            self.copies[h].remove(med)
        if not self.copies[h]:
            del self.copies[h]
        return BlockRemoved([h], med)

    def cleared(self) -> AllBlocksCleared:
        self.copies.clear()
        return AllBlocksCleared()


@dataclass
class Model:
    """The reference: stored bits and pending expiries per replica, states, epochs."""

    stored: dict[str, dict[BlockKey, int]] = field(default_factory=dict)
    pending: dict[str, dict[BlockKey, int]] = field(default_factory=dict)
    state: dict[str, ReplicaState] = field(default_factory=dict)
    epoch: dict[str, int] = field(default_factory=dict)

    def lookup(
        self,
        keys: Sequence[BlockKey],
        replicas: Sequence[str],
        now: int,
        exact_for: Sequence[str] = (),
    ) -> dict[str, Any]:
        """The shared search over the model's dicts; for the replicas in ``exact_for``
        (certificates written by a mirror, pending written as whole chains) it must also
        equal the exact longest-prefix definition."""
        out: dict[str, PrefixMatch] = {}
        for r in replicas:
            st_ = self.state.get(r, ReplicaState.UNKNOWN)
            if st_ not in ROUTABLE_STATES:
                out[r] = empty_match(st_)
                continue
            s, p = self.stored.get(r, {}), self.pending.get(r, {})
            tiers, stored, pend = search_prefix(_getter(s, keys), _getter(p, keys), len(keys), now)
            out[r] = PrefixMatch(tiers, stored, pend, st_)
            if r in exact_for:
                ref = longest_prefix(
                    [s.get(k, 0) & TIER_MASK for k in keys], [p.get(k, 0) > now for k in keys]
                )
                assert (tiers, stored, pend) == ref, (r, (tiers, stored, pend), ref)
        return out


def _getter(d: dict[BlockKey, int], keys: Sequence[BlockKey]) -> Any:
    return lambda i: d.get(keys[i], 0)


# entry values for raw writes: plain tier bits and valid values with broken-run bits
RAW_VALUES = st.sampled_from([1, 2, 3, 9, 15, 0x101, 0x13, 0x123, 0x1F0 | 15, 0x122])
ev_spec = st.one_of(
    st.tuples(
        st.just("s"),
        st.integers(-3, 30),
        st.integers(1, 4),
        st.integers(0, 2**16),
        st.integers(0, 4),
        st.integers(0, 3),
    ),
    st.tuples(st.just("x"), st.integers(-2, 30), st.integers(-1, 4)),
    st.tuples(st.just("c")),
)
replica_i = st.integers(0, len(REPLICAS) - 1)
CHAIN_PICK = st.integers(0, 20)
CHAIN_SEED = st.integers(0, 7)
TIMES = st.sampled_from([0, 250, 500, 750, 1000, 2000])
op = st.one_of(
    st.tuples(st.just("ev"), replica_i, st.lists(ev_spec, min_size=1, max_size=5)),
    st.tuples(st.just("ev"), replica_i, st.lists(ev_spec, min_size=1, max_size=5)),
    st.tuples(
        st.just("raw"),
        replica_i,
        st.lists(st.tuples(st.integers(0, 60), RAW_VALUES), max_size=6),
        st.lists(
            st.tuples(
                st.integers(-(2**64), 2**64 - 1),
                st.one_of(st.none(), st.binary(min_size=4, max_size=20)),
            ),
            max_size=3,
        ),
        st.one_of(st.none(), st.integers(0, 100)),
    ),
    st.tuples(st.just("stale"), replica_i, st.sampled_from([-1, 1, 5])),
    st.tuples(
        st.just("rawchain"),
        replica_i,
        CHAIN_PICK,
        CHAIN_SEED,
        st.lists(st.sampled_from([1, 3, 3, 2, 9, 15, 0, 5, 0x101, 0x13]), min_size=1, max_size=10),
    ),
    # times on a coarse grid, so that now == expiry (the boundary) happens often
    st.tuples(st.just("pend"), replica_i, CHAIN_PICK, CHAIN_SEED, TIMES),
    st.tuples(st.just("adv"), TIMES),
    st.tuples(st.just("clr"), replica_i, st.integers(0, 3)),
    st.tuples(st.just("state"), replica_i, st.integers(0, 3)),
    st.tuples(st.just("look"), CHAIN_PICK, CHAIN_SEED, st.integers(1, 7)),
    st.tuples(st.just("look"), CHAIN_PICK, CHAIN_SEED, st.integers(1, 7)),
)


class Driver:
    def __init__(self, backends: Sequence[PrefixIndex]) -> None:
        self.backends = backends
        self.model = Model()
        self.now = 1_000_000
        self.engines = {r: EngineModel() for r in REPLICAS}
        self.mirrors = {r: ReplicaMirror(KEYER, MODEL) for r in REPLICAS}
        self.raw_dirty = dict.fromkeys(REPLICAS, False)
        self.lookups = 0
        self.hits = 0

    def chain(self, pick: int, seed: int) -> list[BlockKey]:
        """A key chain: a stored path of some replica (or a random one) plus a random tail."""
        paths = [p for e in self.engines.values() for p in e.paths.values() if p[0]]
        tail = _tokens(seed, 1 + seed % 3)
        if paths and pick < 15:
            salt, toks = paths[pick % len(paths)]
            assert salt is not None
            return KEYER.keys(toks + tail, salt, MODEL)
        # few seeds: pending and looked-up chains collide often
        return KEYER.keys(_tokens(seed * 5 + 1, 1 + seed % 4), "kvg1:s0", MODEL)

    def known_keys(self) -> list[BlockKey]:
        keys = sorted({k for s in self.model.stored.values() for k in s})
        return keys or KEYER.keys([0] * BS * 4, "kvg1:s0", MODEL)

    async def all_equal(self, coro_name: str, *args: Any) -> Any:
        results = [await getattr(b, coro_name)(*args) for b in self.backends]
        for r in results[1:]:
            assert r == results[0], (coro_name, args, results)
        return results[0]

    async def write(self, r: str, w: IndexWrite) -> None:
        for b in self.backends:
            await b.apply(r, self.model.epoch.get(r, 0), w, self.now)
        s = self.model.stored.setdefault(r, {})
        for k, bits in w.blocks.items():
            if bits:
                s[k] = bits
            else:
                s.pop(k, None)

    async def clear(self, r: str, state: ReplicaState) -> None:
        epoch = await self.all_equal("clear_replica", r, state, self.now, 1.5)
        assert epoch == self.model.epoch.get(r, 0) + 1
        self.model.epoch[r] = epoch
        self.model.state[r] = state
        self.model.stored[r] = {}
        self.model.pending[r] = {}
        self.raw_dirty[r] = False

    async def step(self, o: tuple[Any, ...]) -> None:
        kind = o[0]
        if kind == "ev":
            r = REPLICAS[o[1]]
            eng = self.engines[r]
            events: list[KVEvent] = []
            for spec in o[2]:
                if spec[0] == "s":
                    events.append(eng.stored(*spec[1:]))
                elif spec[0] == "x":
                    events.append(eng.removed(spec[1], spec[2]))
                else:
                    events.append(eng.cleared())
            w, cleared = self.mirrors[r].apply(events)
            if cleared:
                await self.clear(r, ReplicaState.LIVE)
            if w:
                await self.write(r, w)
            if not self.raw_dirty[r]:
                assert self.model.stored.get(r, {}) == self.mirrors[r].blocks()
            self.mirrors[r].check_invariants()
        elif kind == "raw":
            r = REPLICAS[o[1]]
            keys = self.known_keys()
            blocks = {keys[i % len(keys)]: bits for i, bits in o[2]}
            fresh = KEYER.keys(_tokens(o[1] * 31 + len(o[2]), 2), "kvg1:raw", MODEL)
            blocks.update(dict.fromkeys(fresh[: len(o[2]) % 3], 1))
            await self.write(r, IndexWrite(blocks, dict(o[3]), o[4]))
            self.raw_dirty[r] = True
        elif kind == "rawchain":
            r = REPLICAS[o[1]]
            keys = self.chain(o[2], o[3])
            await self.write(r, IndexWrite(dict(zip(keys, o[4], strict=False))))
            self.raw_dirty[r] = True
        elif kind == "stale":
            r = REPLICAS[o[1]]
            bad = self.model.epoch.get(r, 0) + o[2]
            for b in self.backends:
                with pytest.raises(StaleEpochError):
                    await b.apply(r, bad, IndexWrite({self.known_keys()[0]: 1}), self.now)
        elif kind == "pend":
            r = REPLICAS[o[1]]
            keys = self.chain(o[2], o[3])
            for b in self.backends:
                await b.add_pending(r, keys, o[4], self.now)
            p = self.model.pending.setdefault(r, {})
            for k in keys:
                p[k] = max(p.get(k, 0), self.now + o[4])
        elif kind == "adv":
            self.now += o[1]
        elif kind == "clr":
            # the agent clears on a replay gap or a lost engine: it forgets its mirror too
            # (the engine model keeps its blocks: later events about them are unknown)
            self.mirrors[REPLICAS[o[1]]].clear()
            await self.clear(REPLICAS[o[1]], STATES[o[2]])
        elif kind == "state":
            r = REPLICAS[o[1]]
            for b in self.backends:
                await b.set_state(r, STATES[o[2]], self.now)
            self.model.state[r] = STATES[o[2]]
        elif kind == "look":
            keys = self.chain(o[1], o[2])
            replicas = [r for i, r in enumerate(REPLICAS) if o[3] >> i & 1]
            got = await self.all_equal("lookup", keys, replicas, self.now)
            clean = [r for r in replicas if not self.raw_dirty[r]]
            assert got == self.model.lookup(keys, replicas, self.now, clean)
            self.lookups += 1
            self.hits += any(m.stored_blocks for m in got.values())

    async def finish(self) -> None:
        for r in REPLICAS:
            meta = await self.all_equal("meta", r)
            assert meta.epoch == self.model.epoch.get(r, 0)
            blocks = await self.all_equal("replica_blocks", r)
            assert blocks == self.model.stored.get(r, {})
            await self.all_equal("load_mirror", r)
            keys = sorted(blocks)
            got = await self.all_equal("lookup", keys, list(REPLICAS), self.now)
            assert got == self.model.lookup(keys, list(REPLICAS), self.now)


async def _run(redis_url: str, ops: list[tuple[Any, ...]]) -> Driver:
    admin = aioredis.Redis.from_url(redis_url)
    await admin.flushdb()
    await admin.aclose()
    red = RedisIndex.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    mem = MemoryIndex()
    try:
        d = Driver([mem, red])
        for o in [("state", i, 0) for i in range(len(REPLICAS))] + ops:  # start live
            await d.step(o)
        await d.finish()
        mem.check_invariants()
        return d
    finally:
        await red.close()


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(op, min_size=1, max_size=40))
def test_memory_and_redis_agree(redis_url: str, ops: list[tuple[Any, ...]]) -> None:
    asyncio.run(_run(redis_url, ops))


def fixed_program(iterations: int, clears: bool) -> list[tuple[Any, ...]]:
    """A deterministic program over the three replicas: stored chains from engine events,
    pending entries, lookups, time advancing, every ninth step removals (and, with
    ``clears``, a replica clear). Shared with the cluster test."""
    ops: list[tuple[Any, ...]] = []
    for i in range(iterations):
        ops.append(("ev", i % 3, [("s", i - 1 if i % 4 else -1, 3, i * 977, i, i)]))
        ops.append(("pend", (i + 1) % 3, i, i * 13, 1000))
        ops.append(("look", i, i * 5, 7))
        ops.append(("adv", 300))
        if i % 9 == 8:
            ops.append(("ev", i % 3, [("x", i, -1), ("x", i + 1, 1)]))
            if clears:
                ops.append(("clr", i % 3, 0))
    return ops


def test_a_long_fixed_program_has_hits(redis_url: str) -> None:
    """Guards the property test's power: a fixed program must produce real hits."""
    ops: list[tuple[Any, ...]] = [("state", i, 0) for i in range(3)]
    ops += fixed_program(40, clears=False)
    d = asyncio.run(_run(redis_url, ops))
    assert d.lookups == 40
    assert d.hits >= 10, d.hits
