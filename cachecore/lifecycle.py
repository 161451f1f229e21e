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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntFlag, StrEnum

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


@dataclass(slots=True)
class _EngineBlock:
    """One engine hash: our key (None for blocks we never index) and copies per tier.

    vLLM does not de-duplicate blocks: two requests computing the same prefix at once each
    cache a copy and each copy's eviction emits its own BlockRemoved, so the tier holds the
    hash while any copy remains.
    """

    key: BlockKey | None
    copies: dict[Tier, int]

    def tiers(self) -> int:
        out = 0
        for t, n in self.copies.items():
            if n > 0:
                out |= int(t)
        return out

    def encode(self) -> bytes:
        c = self.copies.get  # written out, not a generator: this runs once per stored block
        counts = bytes(
            (
                min(c(Tier.GPU, 0), 255),
                min(c(Tier.CPU, 0), 255),
                min(c(Tier.DISK, 0), 255),
                min(c(Tier.REMOTE, 0), 255),
            )
        )
        return (self.key or b"") + counts

    @classmethod
    def decode(cls, raw: bytes) -> _EngineBlock:
        key, counts = raw[:-4], raw[-4:]
        return cls(key or None, {t: c for t, c in zip(ALL_TIERS, counts, strict=True) if c})


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

    Invariants:

    * ``_by_key[k]`` is exactly the set of engine hashes ``h`` with ``_engine[h].key == k``;
    * a key's tier set is the union of its engine hashes' tiers, and it is in the index iff
      that set is non-empty;
    * every IndexWrite returned describes the complete new state of each key it touches.
    """

    def __init__(self, keyer: BlockKeyer, model: str, group_idx: int | None = None) -> None:
        self.keyer = keyer
        self.model = model
        self.group_idx = group_idx  # the full-attention group to index (None: any/only one)
        self._engine: dict[int, _EngineBlock] = {}
        self._by_key: dict[BlockKey, set[int]] = {}
        self.counters = MirrorCounters()

    # ---- queries
    def __len__(self) -> int:
        return len(self._by_key)

    def key_tiers(self, key: BlockKey) -> int:
        out = 0
        for h in self._by_key.get(key, ()):
            out |= self._engine[h].tiers()
        return out

    def state_of(self, key: BlockKey) -> BlockState:
        return BlockState.STORED if self.key_tiers(key) else BlockState.ABSENT

    def blocks(self) -> dict[BlockKey, int]:
        """Every indexed key and its tiers: what the index must hold for this replica."""
        return {k: t for k in self._by_key if (t := self.key_tiers(k))}

    def engine_hashes(self) -> set[int]:
        return {h for h, b in self._engine.items() if b.tiers()}

    def snapshot(self) -> dict[int, bytes]:
        return {h: b.encode() for h, b in self._engine.items()}

    # ---- restore
    def restore(self, records: Mapping[int, bytes]) -> None:
        self._engine.clear()
        self._by_key.clear()
        for h, raw in records.items():
            blk = _EngineBlock.decode(raw)
            self._engine[h] = blk
            if blk.key is not None:
                self._by_key.setdefault(blk.key, set()).add(h)

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
        self._by_key.clear()
        self.counters.cleared += 1

    def _wanted_group(self, group_idx: int | None) -> bool:
        return self.group_idx is None or group_idx is None or group_idx == self.group_idx

    def _stored(self, ev: BlockStored, write: IndexWrite) -> None:
        if not self._wanted_group(ev.group_idx):
            self.counters.dropped_other_group += len(ev.block_hashes)
            return
        tier = tier_of_medium(ev.medium)
        parent_key: BlockKey | None = None
        salt: str | None = None
        index_it = True
        if ev.parent_block_hash is None:
            salt = salt_from_extra_keys(ev.extra_keys[0] if ev.extra_keys else None)
            if salt is None:
                self.counters.dropped_unscoped += len(ev.block_hashes)
                index_it = False
            elif is_ephemeral_salt(salt):
                self.counters.dropped_ephemeral += len(ev.block_hashes)
                index_it = False
        else:
            parent = self._engine.get(ev.parent_block_hash)
            if parent is None:
                self.counters.dropped_unknown_parent += len(ev.block_hashes)
                return
            if parent.key is None:
                # child of an unscoped or ephemeral block: inherit its fate
                index_it = False
            parent_key = parent.key
        keys: list[BlockKey | None]
        if index_it:
            keys = list(self.keyer.chain(parent_key, ev.token_ids, salt, self.model, ev.lora_name))
        else:
            keys = [None] * len(ev.block_hashes)
        if len(keys) != len(ev.block_hashes):
            self.counters.dropped_unknown_parent += len(ev.block_hashes)
            return
        for h, k in zip(ev.block_hashes, keys, strict=True):
            blk = self._engine.get(h)
            if blk is None:
                blk = self._engine[h] = _EngineBlock(k, {})
            elif blk.key != k:
                # the engine reused a hash for different content: the newer claim wins
                self._forget(h, write)
                blk = self._engine[h] = _EngineBlock(k, {})
            blk.copies[tier] = blk.copies.get(tier, 0) + 1
            write.mirror[h] = blk.encode()
            if k is not None:
                self._by_key.setdefault(k, set()).add(h)
                write.blocks[k] = self.key_tiers(k)
                self.counters.stored_blocks += 1

    def _removed(self, ev: BlockRemoved, write: IndexWrite) -> None:
        if not self._wanted_group(ev.group_idx):
            return
        tier = tier_of_medium(ev.medium)
        for h in ev.block_hashes:
            blk = self._engine.get(h)
            if blk is None or blk.copies.get(tier, 0) == 0:
                self.counters.unknown_removed += 1
                continue
            blk.copies[tier] -= 1
            if blk.copies[tier] == 0:
                del blk.copies[tier]
            if blk.tiers():
                write.mirror[h] = blk.encode()
                if blk.key is not None:
                    write.blocks[blk.key] = self.key_tiers(blk.key)
            else:
                self._forget(h, write)
            self.counters.removed_blocks += 1

    def _forget(self, h: int, write: IndexWrite) -> None:
        blk = self._engine.pop(h)
        write.mirror[h] = None
        if blk.key is not None:
            holders = self._by_key.get(blk.key)
            if holders is not None:
                holders.discard(h)
                if not holders:
                    del self._by_key[blk.key]
            write.blocks[blk.key] = self.key_tiers(blk.key)
