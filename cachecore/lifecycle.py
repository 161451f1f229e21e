"""The block lifecycle: one state machine per (replica, block key), and the agent-side
mirror that drives it from engine events.

States (per replica and key)::

    ABSENT      nothing known
    PENDING     the gateway routed a request there; unconfirmed, expires after a short TTL
    STORED      confirmed by BlockStored, on a non-empty set of tiers (GPU, CPU, DISK, REMOTE)
    EVICTED     BlockRemoved took the last tier away
    UNAVAILABLE the engine is unreachable: entries kept, not used for routing
    CLEARED     AllBlocksCleared, an engine restart, a replay gap, or the replica is gone

Replication is the per-key view of the same machine: a key STORED (or PENDING) on several
replicas at once. Recovery is the pair of transitions back to STORED: ENGINE_BACK (the same
engine process answers again) and RESYNC (the agent rewrites the index from its mirror after
the index lost it, e.g. a Redis restart).

:data:`TRANSITIONS` is the table; ``docs/lifecycle.md`` prints the same table and a test checks
that the two agree. :class:`ReplicaMirror` is the only code that turns engine events into
index writes, and both index backends apply exactly those writes, so the backends cannot
disagree on lifecycle semantics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntFlag, StrEnum
from itertools import repeat
from typing import cast

from cachecore.keys import BlockKey, BlockKeyer, is_ephemeral_salt
from cachecore.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    salt_from_extra_keys,
)


class Tier(IntFlag):
    """Where a block's KV lives. A block may be on several tiers at once."""

    GPU = 1
    CPU = 2
    DISK = 4
    REMOTE = 8


ALL_TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)

_MEDIUM_TO_TIER: Mapping[str, Tier] = {
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "HOST": Tier.CPU,
    "DISK": Tier.DISK,
    "LOCAL_DISK": Tier.DISK,
    "SSD": Tier.DISK,
    "REMOTE": Tier.REMOTE,
}


def tier_of_medium(medium: str | None) -> Tier:
    """vLLM's ``medium`` to a tier: None means GPU (vLLM's default medium); any medium we do
    not know is treated as REMOTE, the most conservative (slowest) tier."""
    if medium is None:
        return Tier.GPU
    return _MEDIUM_TO_TIER.get(medium.upper(), Tier.REMOTE)


class BlockState(StrEnum):
    ABSENT = "absent"
    PENDING = "pending"
    STORED = "stored"
    EVICTED = "evicted"
    UNAVAILABLE = "unavailable"
    CLEARED = "cleared"


class BlockEvent(StrEnum):
    ROUTE = "route"  # gateway dispatched a request whose prefix includes the block
    PENDING_EXPIRE = "pending_expire"  # TTL passed without a BlockStored
    STORE = "store"  # BlockStored on some tier
    REMOVE_TIER = "remove_tier"  # BlockRemoved on one tier, others remain
    REMOVE_LAST = "remove_last"  # BlockRemoved on its last tier
    CLEAR = "clear"  # AllBlocksCleared, engine restart, replay gap, replica gone
    ENGINE_LOST = "engine_lost"  # engine unreachable
    ENGINE_BACK = "engine_back"  # same engine process reachable again (recover)
    RESYNC = "resync"  # index rewritten from the agent's mirror (recover)


S, E = BlockState, BlockEvent
TRANSITIONS: Mapping[tuple[BlockState, BlockEvent], BlockState] = {
    (S.ABSENT, E.ROUTE): S.PENDING,
    (S.ABSENT, E.STORE): S.STORED,
    (S.ABSENT, E.RESYNC): S.STORED,
    (S.PENDING, E.ROUTE): S.PENDING,
    (S.PENDING, E.PENDING_EXPIRE): S.ABSENT,
    (S.PENDING, E.STORE): S.STORED,
    (S.PENDING, E.CLEAR): S.CLEARED,
    (S.STORED, E.ROUTE): S.STORED,
    (S.STORED, E.STORE): S.STORED,
    (S.STORED, E.REMOVE_TIER): S.STORED,
    (S.STORED, E.REMOVE_LAST): S.EVICTED,
    (S.STORED, E.CLEAR): S.CLEARED,
    (S.STORED, E.ENGINE_LOST): S.UNAVAILABLE,
    (S.STORED, E.RESYNC): S.STORED,
    (S.EVICTED, E.ROUTE): S.PENDING,
    (S.EVICTED, E.STORE): S.STORED,
    (S.EVICTED, E.CLEAR): S.CLEARED,
    (S.UNAVAILABLE, E.ENGINE_BACK): S.STORED,
    (S.UNAVAILABLE, E.CLEAR): S.CLEARED,
    (S.UNAVAILABLE, E.ENGINE_LOST): S.UNAVAILABLE,
    (S.CLEARED, E.ROUTE): S.PENDING,
    (S.CLEARED, E.STORE): S.STORED,
    (S.CLEARED, E.CLEAR): S.CLEARED,
}
del S, E


class InvalidTransitionError(ValueError):
    def __init__(self, state: BlockState, event: BlockEvent) -> None:
        super().__init__(f"no transition from {state.value} on {event.value}")
        self.state, self.event = state, event


def transition(state: BlockState, event: BlockEvent) -> BlockState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransitionError(state, event) from None


# ------------------------------------------------------------------------ index writes


@dataclass(slots=True)
class IndexWrite:
    """A batch of index changes for one replica, produced by :class:`ReplicaMirror`.

    ``blocks`` maps a key to its complete tier set after the batch (0 = delete the entry).
    ``mirror`` maps an engine hash to its serialised mirror record (None = delete); backends
    persist it so an agent restart or an index restart can be recovered. ``seq`` is the last
    engine batch the write covers.
    """

    blocks: dict[BlockKey, int] = field(default_factory=dict)
    mirror: dict[int, bytes | None] = field(default_factory=dict)
    seq: int | None = None

    def __bool__(self) -> bool:
        return bool(self.blocks or self.mirror or self.seq is not None)

    def merge(self, later: IndexWrite) -> None:
        self.blocks.update(later.blocks)
        self.mirror.update(later.mirror)
        if later.seq is not None:
            self.seq = later.seq


# A mirror record, the value the index persists per engine hash: our key (empty for blocks
# we never index) then the hash's copy count per tier (GPU, CPU, DISK, REMOTE), one byte
# each, clipped at 255.
_COUNT_BYTES = len(ALL_TIERS)
_TIER_POS: Mapping[int, int] = {int(t): i for i, t in enumerate(ALL_TIERS)}
_ONE_COPY: Mapping[int, bytes] = {
    int(t): bytes(1 if j == i else 0 for j in range(_COUNT_BYTES)) for i, t in enumerate(ALL_TIERS)
}
"""Per tier bit: the count bytes of a hash held once, on that tier only."""
_KEY_PART = slice(None, -_COUNT_BYTES)


def _record_tiers(rec: bytes) -> int:
    """The tier bits of a mirror record (a clipped count is still non-zero)."""
    out = 0
    base = len(rec) - _COUNT_BYTES
    for i in range(_COUNT_BYTES):
        if rec[base + i]:
            out |= 1 << i
    return out


@dataclass(slots=True)
class MirrorCounters:
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    dropped_unscoped: int = 0  # no kvgate salt: traffic that did not come through a gateway
    dropped_ephemeral: int = 0  # sensitive scope: never indexed
    dropped_unknown_parent: int = 0
    dropped_other_group: int = 0  # hybrid models: only the full-attention group is indexed
    unknown_removed: int = 0


class ReplicaMirror:
    """The agent's mirror of one engine's prefix cache (one replica and DP rank).

    State per engine hash: its mirror record (``_engine[h]``: our key, empty for blocks we
    never index, then the copy count per tier, exactly what the index persists), and the
    exact counts in ``_wide[h]`` for the rare hash of which some tier holds more than 255
    copies (the record's bytes are clipped). vLLM does not de-duplicate blocks: two requests
    computing the same prefix at once each cache a copy and each copy's eviction emits its
    own BlockRemoved, so the tier holds the hash while any copy remains.

    ``_by_key[k]`` is the engine hash holding key ``k`` (an int: the usual case) or the set
    of two or more hashes holding it.

    Invariants:

    * ``_by_key[k]`` is exactly the engine hashes ``h`` whose record's key is ``k``;
    * a key's tier set is the union of its engine hashes' tiers, and it is in the index iff
      that set is non-empty;
    * every IndexWrite returned describes the complete new state of each key it touches.

    Events whose blocks are all new (BlockStored) or all held once, on the event's tier
    only, by a hash that alone holds the key (BlockRemoved), the steady state of an engine,
    are applied with dict operations over the whole event (C loops); anything else goes
    block by block. Both paths produce the same state and the same writes.
    """

    def __init__(self, keyer: BlockKeyer, model: str, group_idx: int | None = None) -> None:
        self.keyer = keyer
        self.model = model
        self.group_idx = group_idx  # the full-attention group to index (None: any/only one)
        self._engine: dict[int, bytes] = {}
        self._wide: dict[int, list[int]] = {}
        self._by_key: dict[BlockKey, int | set[int]] = {}
        self.counters = MirrorCounters()

    # ---- queries
    def __len__(self) -> int:
        return len(self._by_key)

    def key_tiers(self, key: BlockKey) -> int:
        holders = self._by_key.get(key)
        if holders is None:
            return 0
        if isinstance(holders, int):
            return _record_tiers(self._engine[holders])
        out = 0
        for h in holders:
            out |= _record_tiers(self._engine[h])
        return out

    def state_of(self, key: BlockKey) -> BlockState:
        return BlockState.STORED if self.key_tiers(key) else BlockState.ABSENT

    def blocks(self) -> dict[BlockKey, int]:
        """Every indexed key and its tiers: what the index must hold for this replica."""
        return {k: t for k in self._by_key if (t := self.key_tiers(k))}

    def engine_hashes(self) -> set[int]:
        return {h for h, rec in self._engine.items() if _record_tiers(rec)}

    def snapshot(self) -> dict[int, bytes]:
        return dict(self._engine)

    # ---- restore
    def restore(self, records: Mapping[int, bytes]) -> None:
        self._engine.clear()
        self._wide.clear()
        self._by_key.clear()
        for h, raw in records.items():
            if len(raw) < _COUNT_BYTES:
                raise ValueError(f"mirror record of {len(raw)} bytes")
            rec = bytes(raw)
            self._engine[h] = rec
            key = rec[_KEY_PART]
            if key:
                self._hold(key, h)

    # ---- events
    def apply(self, events: Iterable[KVEvent]) -> tuple[IndexWrite, bool]:
        """Apply one batch in order. Returns the index write and whether the batch cleared
        the replica (the caller then bumps the index epoch before writing)."""
        write = IndexWrite()
        cleared = False
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev, write)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev, write)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()
                write = IndexWrite()
                cleared = True
        return write, cleared

    def clear(self) -> None:
        self._engine.clear()
        self._wide.clear()
        self._by_key.clear()
        self.counters.cleared += 1

    def _wanted_group(self, group_idx: int | None) -> bool:
        return self.group_idx is None or group_idx is None or group_idx == self.group_idx

    # ---- records and holders
    def _counts(self, h: int, rec: bytes) -> list[int]:
        wide = self._wide.get(h)
        return list(wide) if wide is not None else list(rec[-_COUNT_BYTES:])

    def _put(self, h: int, key: BlockKey | None, counts: list[int]) -> bytes:
        if max(counts) > 255:
            self._wide[h] = counts
            tail = bytes(min(c, 255) for c in counts)
        else:
            self._wide.pop(h, None)
            tail = bytes(counts)
        rec = self._engine[h] = (key or b"") + tail
        return rec

    def _hold(self, key: BlockKey, h: int) -> None:
        holders = self._by_key.get(key)
        if holders is None:
            self._by_key[key] = h
        elif isinstance(holders, int):
            if holders != h:
                self._by_key[key] = {holders, h}
        else:
            holders.add(h)

    def _release(self, key: BlockKey, h: int) -> None:
        holders = self._by_key.get(key)
        if holders is None:
            return
        if isinstance(holders, int):
            if holders == h:
                del self._by_key[key]
            return
        holders.discard(h)
        if len(holders) == 1:
            self._by_key[key] = next(iter(holders))

    # ---- events, per kind
    def _stored(self, ev: BlockStored, write: IndexWrite) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if not self._wanted_group(ev.group_idx):
            self.counters.dropped_other_group += n
            return
        tier = int(tier_of_medium(ev.medium))
        parent_key: BlockKey | None = None
        salt: str | None = None
        index_it = True
        if ev.parent_block_hash is None:
            salt = salt_from_extra_keys(ev.extra_keys[0] if ev.extra_keys else None)
            if salt is None:
                self.counters.dropped_unscoped += n
                index_it = False
            elif is_ephemeral_salt(salt):
                self.counters.dropped_ephemeral += n
                index_it = False
        else:
            parent = self._engine.get(ev.parent_block_hash)
            if parent is None:
                self.counters.dropped_unknown_parent += n
                return
            parent_key = parent[_KEY_PART] or None
            if parent_key is None:
                # child of an unscoped or ephemeral block: inherit its fate
                index_it = False
        engine = self._engine
        tail = _ONE_COPY[tier]
        if not index_it:
            if engine.keys().isdisjoint(hashes) and len(set(hashes)) == n:
                new = dict.fromkeys(hashes, tail)
                engine.update(new)
                write.mirror.update(new)
                return
            self._stored_blocks(hashes, [None] * n, tier, write)
            return
        keys = self.keyer.chain(parent_key, ev.token_ids, salt, self.model, ev.lora_name)
        if len(keys) != n:
            self.counters.dropped_unknown_parent += n
            return
        by_key = self._by_key
        if (
            engine.keys().isdisjoint(hashes)
            and by_key.keys().isdisjoint(keys)
            and len(set(hashes)) == n
            and len(set(keys)) == n
        ):
            recs = list(map(bytes.__add__, keys, repeat(tail)))
            engine.update(zip(hashes, recs, strict=True))
            write.mirror.update(zip(hashes, recs, strict=True))
            by_key.update(zip(keys, hashes, strict=True))
            write.blocks.update(dict.fromkeys(keys, tier))
            self.counters.stored_blocks += n
            return
        self._stored_blocks(hashes, keys, tier, write)

    def _stored_blocks(
        self, hashes: list[int], keys: Sequence[BlockKey | None], tier: int, write: IndexWrite
    ) -> None:
        pos = _TIER_POS[tier]
        engine = self._engine
        for h, k in zip(hashes, keys, strict=True):
            rec = engine.get(h)
            if rec is None:
                counts = [0] * _COUNT_BYTES
            elif (rec[_KEY_PART] or None) != k:
                # the engine reused a hash for different content: the newer claim wins
                self._forget(h, write)
                counts = [0] * _COUNT_BYTES
            else:
                counts = self._counts(h, rec)
            counts[pos] += 1
            write.mirror[h] = self._put(h, k, counts)
            if k is not None:
                self._hold(k, h)
                write.blocks[k] = self.key_tiers(k)
                self.counters.stored_blocks += 1

    def _removed(self, ev: BlockRemoved, write: IndexWrite) -> None:
        if not self._wanted_group(ev.group_idx):
            return
        tier = int(tier_of_medium(ev.medium))
        hashes = ev.block_hashes
        n = len(hashes)
        engine = self._engine
        tail = _ONE_COPY[tier]
        found = list(map(engine.get, hashes))
        ok = None not in found and len(set(hashes)) == n
        recs = cast("list[bytes]", found) if ok else []
        if recs and all(map(bytes.endswith, recs, repeat(tail))):
            # every hash held once, on this tier only: each removal forgets its hash
            keys = [rec[:-_COUNT_BYTES] for rec in recs]
            if recs.count(tail) == n or list(map(self._by_key.get, keys)) == hashes:
                # ... and each key is empty (never indexed) or held by that hash alone
                for h in hashes:
                    del engine[h]
                by_key = self._by_key
                for k in keys:
                    if k:
                        del by_key[k]
                write.mirror.update(dict.fromkeys(hashes))
                write.blocks.update(dict.fromkeys(filter(None, keys), 0))
                self.counters.removed_blocks += n
                return
        pos = _TIER_POS[tier]
        for h in hashes:
            rec = engine.get(h)
            if rec is None or rec[len(rec) - _COUNT_BYTES + pos] == 0:
                self.counters.unknown_removed += 1
                continue
            counts = self._counts(h, rec)
            counts[pos] -= 1
            if any(counts):
                key = rec[_KEY_PART] or None
                write.mirror[h] = self._put(h, key, counts)
                if key is not None:
                    write.blocks[key] = self.key_tiers(key)
            else:
                self._forget(h, write)
            self.counters.removed_blocks += 1

    def _forget(self, h: int, write: IndexWrite) -> None:
        rec = self._engine.pop(h)
        self._wide.pop(h, None)
        write.mirror[h] = None
        key = rec[_KEY_PART]
        if key:
            self._release(key, h)
            write.blocks[key] = self.key_tiers(key)
