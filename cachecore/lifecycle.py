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
from itertools import pairwise, repeat
from typing import Any, cast

from cachecore.keys import (
    KEY_BYTES,
    SALT_PREFIX,
    BlockKey,
    BlockKeyer,
    chain_key,
    is_ephemeral_salt,
    tokens_to_bytes,
)
from cachecore.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    root_salt,
)


class Tier(IntFlag):
    """Where a block's KV lives. A block may be on several tiers at once."""

    GPU = 1
    CPU = 2
    DISK = 4
    REMOTE = 8


ALL_TIERS: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)

# ------------------------------------------------------------------------ entry values
# An index entry (replica, key) holds one small int: the key's tier bits, plus run
# certificates that let a lookup verify a whole prefix from a few probes instead of reading
# every key of it (docs/index.md "Entry values"):
#
#   bits 0-3  tiers holding the block (Tier bits)
#   bits 4-7  "run broken" per tier: the block is on tier t but some ancestor is not
#   bit  8    "stored run broken": some ancestor is not stored on any tier
#
# A chain stored whole on one tier (the common case) has no broken bit set, so its values
# are plain tier bits. The agent's mirror knows every key's parent and keeps the bits exact
# as blocks come and go (a change cascades to the descendants whose run it changes), so
# "key i is in an unbroken run" is monotone along a request's chain and a binary search
# finds where each run ends.

TIER_MASK = 0xF
BROKEN_SHIFT = 4
STORED_BROKEN = 0x100
MAX_ENTRY_VALUE = 0x1FF


def run_tiers(value: int) -> int:
    """The tiers on which the entry's block ends an unbroken run from the chain's root."""
    return value & TIER_MASK & ~(value >> BROKEN_SHIFT)


def in_stored_run(value: int) -> bool:
    """Whether the block and every ancestor are stored (on some tier)."""
    return bool(value & TIER_MASK) and not value & STORED_BROKEN


def entry_value(tiers: int, parent: int | None) -> int:
    """The entry value of a block on ``tiers`` whose parent's entry value is ``parent``
    (None: the first block of a chain; 0: a parent that is not stored)."""
    if not tiers:
        return 0
    if parent is None:
        return tiers
    value = tiers | ((tiers & ~run_tiers(parent)) << BROKEN_SHIFT)
    if not in_stored_run(parent):
        value |= STORED_BROKEN
    return value


def chain_values(tiers: Sequence[int], parent: int | None = None) -> list[int]:
    """Entry values along one chain from the tier bits of each block (0 = not stored):
    what the mirror writes for such a chain. Benchmarks and tests build index contents
    with it."""
    out: list[int] = []
    for t in tiers:
        value = entry_value(t, parent)
        out.append(value)
        parent = value
    return out


def check_entry_values(values: Iterable[int]) -> None:
    """Raise ValueError unless every value is 0 (delete) or a valid entry value: tier bits
    set, broken bits only for tiers held."""
    vals = list(values)
    if not vals:
        return
    if min(vals) < 0 or max(vals) > MAX_ENTRY_VALUE:
        raise ValueError("entry value out of range")
    if max(vals) > TIER_MASK:
        for v in vals:
            if v and (not v & TIER_MASK or (v >> BROKEN_SHIFT) & TIER_MASK & ~v):
                raise ValueError(f"invalid entry value {v:#x}")


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


def tier_of_medium(medium: str | None, locality: str | None = None) -> Tier:
    """vLLM's ``medium`` to a tier: None means GPU (vLLM's default medium); vLLM 0.33's
    ``STORAGE`` is DISK when its ``locality`` says LOCAL, else REMOTE; any medium we do not
    know is treated as REMOTE, the most conservative (slowest) tier."""
    if medium is None:
        return Tier.GPU
    m = medium.upper()
    if m == "STORAGE":
        return Tier.DISK if (locality or "").upper() == "LOCAL" else Tier.REMOTE
    return _MEDIUM_TO_TIER.get(m, Tier.REMOTE)


_GPU = int(Tier.GPU)  # tier_of_medium of None and of "GPU", whatever the locality


def _event_tier(medium: str | None, locality: str | None) -> int:
    """:func:`tier_of_medium` as an int, an engine's GPU store (every simulated one, most
    real ones) answered without the lookup."""
    if medium is None or medium == "GPU":
        return _GPU
    return int(tier_of_medium(medium, locality))


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


class MirrorRecordError(ValueError):
    """Persisted mirror records that no :class:`ReplicaMirror` wrote (a corrupt or foreign
    index): restoring them would invent keys or link a key under two parents."""


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
    engine batch the write covers. ``removed`` holds the keys whose entry the batch deleted
    at some point, even when it stored them again later in the batch (``blocks`` then shows
    only the final value): the index's removal log needs them
    (:meth:`cachecore.index.base.PrefixIndex.removed_since`).
    """

    blocks: dict[BlockKey, int] = field(default_factory=dict)
    mirror: dict[int, bytes | None] = field(default_factory=dict)
    seq: int | None = None
    removed: set[BlockKey] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.blocks or self.mirror or self.seq is not None or self.removed)

    def merge(self, later: IndexWrite) -> None:
        self.blocks.update(later.blocks)
        self.mirror.update(later.mirror)
        self.removed |= later.removed
        if later.seq is not None:
            self.seq = later.seq


# A mirror record, the value the index persists per engine hash: our key and its parent's
# key (both empty for blocks we never index; no parent for the first block of a chain),
# then the hash's copy count per tier (GPU, CPU, DISK, REMOTE), one byte each, clipped at
# 255. Lengths: 4 (not indexed), 20 (key), 36 (key + parent).
_COUNT_BYTES = len(ALL_TIERS)
_ROOT_REC = KEY_BYTES + _COUNT_BYTES
_CHILD_REC = 2 * KEY_BYTES + _COUNT_BYTES
_RECORD_LENGTHS = frozenset((_COUNT_BYTES, _ROOT_REC, _CHILD_REC))
_TIER_POS: Mapping[int, int] = {int(t): i for i, t in enumerate(ALL_TIERS)}
_ONE_COPY: Mapping[int, bytes] = {
    int(t): bytes(1 if j == i else 0 for j in range(_COUNT_BYTES)) for i, t in enumerate(ALL_TIERS)
}
"""Per tier bit: the count bytes of a hash held once, on that tier only."""
_GPU_COPY = _ONE_COPY[_GPU]  # the steady state's record tail


def _rec_key(rec: bytes) -> BlockKey:
    """The record's key (b"" for a block we never index)."""
    return rec[:KEY_BYTES] if len(rec) == _CHILD_REC else rec[:-_COUNT_BYTES]


def _rec_parent(rec: bytes) -> BlockKey | None:
    return rec[KEY_BYTES : 2 * KEY_BYTES] if len(rec) == _CHILD_REC else None


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
    # content kvgate cannot key (multimodal items in a block's extra keys), and the blocks
    # chained after it: never indexed
    dropped_unkeyable: int = 0
    dropped_unknown_parent: int = 0
    dropped_other_group: int = 0  # hybrid models: only the full-attention group is indexed
    unknown_removed: int = 0
    run_updates: int = 0  # descendants rewritten because an ancestor's run changed


def _first_unkeyable(extra_keys: Sequence[Any] | None, lora: str | None, n: int) -> int:
    """Index of the first of ``n`` blocks whose extra keys hold more than the LoRA name and
    a kvgate salt (vLLM puts multimodal item hashes there), else ``n``."""
    if not extra_keys:
        return n
    for i, extra in enumerate(extra_keys[:n]):
        if not extra:
            continue
        for item in extra:
            if item == lora or (isinstance(item, str) and item.startswith(SALT_PREFIX)):
                continue
            return i
    return n


class ReplicaMirror:
    """The agent's mirror of one engine's prefix cache (one replica and DP rank).

    State per engine hash: its mirror record (``_engine[h]``: our key and its parent's key,
    empty for blocks we never index, then the copy count per tier, exactly what the index
    persists), and the exact counts in ``_wide[h]`` for the rare hash of which some tier
    holds more than 255 copies (the record's bytes are clipped). vLLM does not de-duplicate
    blocks: two requests computing the same prefix at once each cache a copy and each copy's
    eviction emits its own BlockRemoved, so the tier holds the hash while any copy remains.

    Per held key (a key some engine hash holds): ``_by_key[k]`` is the engine hash holding
    it (an int: the usual case) or the set of two or more hashes; its parent's key is in
    their records (:meth:`_parent_of`: a key is the hash of its parent's, so every record
    of a key names the same parent, and none a chain's first block); ``_value[k]`` its
    index entry value (tier bits and run certificates, :func:`entry_value`).
    ``_children[p]`` is the held key, or set of held keys, whose parent is ``p`` (``p``
    itself may not be held: an evicted parent's children wait there for it to come back).

    Invariants (``check_invariants``):

    * ``_by_key[k]`` is exactly the engine hashes ``h`` whose record's key is ``k``;
    * a key's tier set is the union of its engine hashes' tiers, and it is in the index iff
      that set is non-empty;
    * ``_value[k] == entry_value(tiers(k), _value.get(parent) or 0 / None for a root)``
      for every held key: the run certificates are exact;
    * ``_children`` is the inverse of the held keys' parents;
    * every IndexWrite returned describes the complete new state of each key it touches.

    Events whose blocks are all new (BlockStored) or all held once, on the event's tier
    only, by a hash that alone holds the key (BlockRemoved), the steady state of an engine,
    are applied with dict operations over the whole event (C loops); anything else goes
    block by block. Both paths produce the same state and the same writes. A block whose
    run certificate changes while it has children (a parent evicted before its child, a
    tier copy arriving after the child's) rewrites the descendants whose runs change: rare
    on vLLM, whose free queue evicts a request's blocks tail first and never frees a parent
    before its children.
    """

    def __init__(self, keyer: BlockKeyer, model: str, group_idx: int | None = None) -> None:
        self.keyer = keyer
        self.model = model
        self.group_idx = group_idx  # the full-attention group to index (None: any/only one)
        self._engine: dict[int, bytes] = {}
        self._wide: dict[int, list[int]] = {}
        self._by_key: dict[BlockKey, int | set[int]] = {}
        self._children: dict[BlockKey, BlockKey | set[BlockKey]] = {}
        self._value: dict[BlockKey, int] = {}
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

    def key_value(self, key: BlockKey) -> int:
        """The key's index entry value (0: not held)."""
        return self._value.get(key, 0)

    def state_of(self, key: BlockKey) -> BlockState:
        return BlockState.STORED if self.key_tiers(key) else BlockState.ABSENT

    def blocks(self) -> dict[BlockKey, int]:
        """Every indexed key and its entry value: what the index must hold for this replica."""
        return dict(self._value)

    def engine_hashes(self) -> set[int]:
        return {h for h, rec in self._engine.items() if _record_tiers(rec)}

    def snapshot(self) -> dict[int, bytes]:
        return dict(self._engine)

    def sizes(self) -> tuple[int, int]:
        """``len(blocks())`` and ``len(snapshot())`` without copying them: the entries the
        index must hold for this replica and its mirror records."""
        return len(self._value), len(self._engine)

    def check_invariants(self) -> None:
        """Assert the documented invariants (tests)."""
        holders: dict[BlockKey, set[int]] = {}
        for h, rec in self._engine.items():
            k = _rec_key(rec)
            if k:
                holders.setdefault(k, set()).add(h)
        got = {k: ({v} if isinstance(v, int) else set(v)) for k, v in self._by_key.items()}
        assert got == holders, "by_key"
        assert set(self._value) == set(self._by_key), "value keys"
        for k in self._by_key:
            want = self._fresh_value(k)
            assert self._value[k] == want, (k.hex(), self._value[k], want)
        inverse: dict[BlockKey, set[BlockKey]] = {}
        for rec in self._engine.values():
            k, p = _rec_key(rec), _rec_parent(rec)
            if not k:
                continue
            assert p == self._parent_of(k), f"records of {k.hex()} name two parents"
            if p is not None:
                inverse.setdefault(p, set()).add(k)
        kids = {p: ({v} if isinstance(v, bytes) else set(v)) for p, v in self._children.items()}
        assert kids == inverse, "children"

    # ---- restore
    def restore(self, records: Mapping[int, bytes]) -> None:
        """Adopt the records the index persisted (an agent restart). Raises
        :class:`MirrorRecordError`, leaving the mirror empty, for records no mirror writes:
        a length other than 4, 20 or 36 bytes, or one key's records naming two parents
        (every record of a key names the same parent: the key hashes it)."""
        self._reset()
        try:
            self._restore(records)
        except MirrorRecordError:
            self._reset()
            raise

    def _restore(self, records: Mapping[int, bytes]) -> None:
        parents: dict[BlockKey, BlockKey | None] = {}
        for h, raw in records.items():
            if len(raw) not in _RECORD_LENGTHS:
                raise MirrorRecordError(f"mirror record of {len(raw)} bytes (engine hash {h})")
            rec = bytes(raw)
            self._engine[h] = rec
            key = _rec_key(rec)
            if key:
                parent = _rec_parent(rec)
                if parents.get(key, parent) != parent or parent == key:
                    raise MirrorRecordError(
                        f"mirror records of key {key.hex()} name two parents, or the key "
                        f"itself (engine hash {h})"
                    )
                parents[key] = parent
                self._hold(key, h)
        for key, parent in parents.items():
            if parent is not None:
                self._link(key, parent)
        self._recompute_values()

    def _recompute_values(self) -> None:
        """Every held key's entry value, parents before children (restore)."""
        value, held = self._value, self._by_key
        value.clear()
        for k in held:
            if k in value:
                continue
            path: list[BlockKey] = []
            x: BlockKey | None = k
            while x is not None and x not in value and x in held and len(path) <= len(held):
                path.append(x)
                x = self._parent_of(x)
            for y in reversed(path):
                value[y] = self._fresh_value(y)

    # ---- events
    def apply(self, events: Iterable[KVEvent]) -> tuple[IndexWrite, bool]:
        """Apply one batch in order. Returns the index write and whether the batch cleared
        the replica (the caller then bumps the index epoch before writing)."""
        write = IndexWrite()
        cleared = False
        for ev in events:
            if isinstance(ev, BlockStored):
                # a decode step's one-block store the short way, as the removal below
                if len(ev.block_hashes) != 1 or not self._stored_one(ev, write):
                    self._stored(ev, write)
            elif isinstance(ev, BlockRemoved):
                # an engine sends one event per evicted block: the common one goes the short way
                if len(ev.block_hashes) != 1 or not self._removed_one(ev, write):
                    self._removed(ev, write)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()
                write = IndexWrite()
                cleared = True
        return write, cleared

    def clear(self) -> None:
        self._reset()
        self.counters.cleared += 1

    def _reset(self) -> None:
        self._engine.clear()
        self._wide.clear()
        self._by_key.clear()
        self._children.clear()
        self._value.clear()

    def _wanted_group(self, group_idx: int | None) -> bool:
        return self.group_idx is None or group_idx is None or group_idx == self.group_idx

    # ---- records and holders
    def _counts(self, h: int, rec: bytes) -> list[int]:
        wide = self._wide.get(h)
        return list(wide) if wide is not None else list(rec[-_COUNT_BYTES:])

    def _put(
        self, h: int, key: BlockKey | None, parent: BlockKey | None, counts: list[int]
    ) -> bytes:
        if max(counts) > 255:
            self._wide[h] = counts
            tail = bytes(min(c, 255) for c in counts)
        else:
            self._wide.pop(h, None)
            tail = bytes(counts)
        head = b"" if key is None else key + (parent or b"")
        rec = self._engine[h] = head + tail
        return rec

    def _hold(self, key: BlockKey, h: int) -> bool:
        """Add ``h`` to the holders of ``key``; True if ``key`` was not held before."""
        holders = self._by_key.get(key)
        if holders is None:
            self._by_key[key] = h
            return True
        if isinstance(holders, int):
            if holders != h:
                self._by_key[key] = {holders, h}
        else:
            holders.add(h)
        return False

    def _release(self, key: BlockKey, h: int) -> bool:
        """Remove ``h`` from the holders of ``key``; True if ``key`` is no longer held."""
        holders = self._by_key.get(key)
        if holders is None:
            return False
        if isinstance(holders, int):
            if holders == h:
                del self._by_key[key]
                return True
            return False
        holders.discard(h)
        if len(holders) == 1:
            self._by_key[key] = next(iter(holders))
        return False

    # ---- the key tree (parents, children) and entry values
    def _parent_of(self, key: BlockKey) -> BlockKey | None:
        """A held key's parent key, from one of its records (None: a chain's first block,
        or a key not held)."""
        holders = self._by_key.get(key)
        if holders is None:
            return None
        rec = self._engine[holders if isinstance(holders, int) else next(iter(holders))]
        return _rec_parent(rec)

    def _link(self, key: BlockKey, parent: BlockKey) -> None:
        """``key`` (held, with ``parent`` in its records) is one of ``parent``'s children."""
        kids = self._children.get(parent)
        if kids is None:
            self._children[parent] = key
        elif isinstance(kids, bytes):
            if kids != key:
                self._children[parent] = {kids, key}
        else:
            kids.add(key)

    def _unlink(self, key: BlockKey, parent: BlockKey | None) -> None:
        """``key`` is no longer held: forget its link to ``parent``, the parent its records
        named (its own children keep waiting under it). Its value goes in :meth:`_settle`,
        which needs the old one."""
        if parent is None:
            return
        kids = self._children.get(parent)
        if kids is None:
            return
        if isinstance(kids, bytes):
            if kids == key:
                del self._children[parent]
            return
        kids.discard(key)
        if len(kids) == 1:
            self._children[parent] = next(iter(kids))

    def _kids(self, key: BlockKey) -> tuple[BlockKey, ...] | set[BlockKey]:
        kids = self._children.get(key)
        if kids is None:
            return ()
        return (kids,) if isinstance(kids, bytes) else set(kids)

    def _settle(self, touched: Iterable[BlockKey], write: IndexWrite) -> None:
        """Recompute the entry value of every touched key (each goes into ``write``), then
        of the descendants of any key whose run certificate changed."""
        value = self._value
        work: list[BlockKey] = []
        for k in touched:
            old = value.get(k, 0)
            new = self._fresh_value(k)
            write.blocks[k] = new
            if new:
                value[k] = new
            else:
                value.pop(k, None)
                if old:
                    write.removed.add(k)
            if (run_tiers(old), in_stored_run(old)) != (run_tiers(new), in_stored_run(new)):
                work.extend(self._kids(k))
        i = 0
        while i < len(work):
            k = work[i]
            i += 1
            if k not in self._by_key:
                continue
            old = value[k]
            new = self._fresh_value(k)
            if new == old:
                continue
            value[k] = new
            write.blocks[k] = new
            self.counters.run_updates += 1
            if (run_tiers(old), in_stored_run(old)) != (run_tiers(new), in_stored_run(new)):
                work.extend(self._kids(k))

    def _fresh_value(self, key: BlockKey) -> int:
        tiers = self.key_tiers(key)
        if not tiers:
            return 0
        p = self._parent_of(key)
        return entry_value(tiers, None if p is None else self._value.get(p, 0))

    # ---- events, per kind
    def _stored(self, ev: BlockStored, write: IndexWrite) -> None:
        hashes = ev.block_hashes
        n = len(hashes)
        if ev.group_idx is not None and not self._wanted_group(ev.group_idx):
            self.counters.dropped_other_group += n
            return
        tier = _event_tier(ev.medium, ev.locality)
        parent_key: BlockKey | None = None
        salt: str | None = None
        index_it = True
        if ev.parent_block_hash is None:
            salt = root_salt(ev)
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
            parent_key = _rec_key(parent) or None
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
            self._stored_blocks(hashes, [None] * n, None, tier, write)
            return
        keys = self.keyer.chain(parent_key, ev.token_ids, salt, self.model, ev.lora_name)
        if len(keys) != n:
            self.counters.dropped_unknown_parent += n
            return
        cut = _first_unkeyable(ev.extra_keys, ev.lora_name, n) if ev.extra_keys else n
        if cut < n:
            # a block holding an image (audio, ...) is keyed by vLLM with the item's hash,
            # which our token-only key cannot reproduce: two prompts with different images
            # would share our key. It and every block after it stay out of the index.
            self.counters.dropped_unkeyable += n - cut
            unkeyed: list[BlockKey | None] = [None] * (n - cut)
            self._stored_blocks(hashes, [*keys[:cut], *unkeyed], parent_key, tier, write)
            return
        by_key = self._by_key
        if (
            engine.keys().isdisjoint(hashes)
            and by_key.keys().isdisjoint(keys)
            and self._children.keys().isdisjoint(keys)
            and len(set(hashes)) == n
            and len(set(keys)) == n
        ):
            # a new branch: every block on this tier only, no child waiting under any of
            # them, so each block's entry value is the first one's (see entry_value)
            parents = [parent_key or b"", *keys[:-1]]
            heads = list(map(bytes.__add__, keys, parents))
            recs = list(map(bytes.__add__, heads, repeat(tail)))
            engine.update(zip(hashes, recs, strict=True))
            write.mirror.update(zip(hashes, recs, strict=True))
            by_key.update(zip(keys, hashes, strict=True))
            if parent_key is None:
                value = tier
            else:
                value = entry_value(tier, self._value.get(parent_key, 0))
                self._link(keys[0], parent_key)
            self._children.update(pairwise(keys))
            values = dict.fromkeys(keys, value)
            self._value.update(values)
            write.blocks.update(values)
            self.counters.stored_blocks += n
            return
        self._stored_blocks(hashes, keys, parent_key, tier, write)

    def _stored_one(self, ev: BlockStored, write: IndexWrite) -> bool:
        """:meth:`_stored` of a one-block event in the steady state (a decode step filling a
        block): on the GPU tier, with no group or extra keys, after an indexed parent, a
        new hash whose key is neither held nor waited for by a child. The same state and
        writes without the general path's checks and lists; False, with nothing changed,
        for anything else, which :meth:`_stored` then handles."""
        medium = ev.medium
        if ev.group_idx is not None or ev.extra_keys or not (medium is None or medium == "GPU"):
            return False
        parent_hash = ev.parent_block_hash
        if parent_hash is None:
            return False
        engine = self._engine
        parent = engine.get(parent_hash)
        h = ev.block_hashes[0]
        tokens = ev.token_ids
        if parent is None or h in engine or len(tokens) != self.keyer.block_size:
            return False
        parent_key = _rec_key(parent)
        if not parent_key:  # after an unscoped or ephemeral block: the general path
            return False
        k = chain_key(parent_key, tokens_to_bytes(tokens))  # BlockKeyer.chain of one block
        by_key = self._by_key
        if k in by_key or k in self._children:
            return False
        rec = engine[h] = k + parent_key + _GPU_COPY
        write.mirror[h] = rec
        by_key[k] = h
        self._link(k, parent_key)
        pv = self._value.get(parent_key, 0)
        # a parent stored on this tier alone with no broken run: the same plain value
        self._value[k] = write.blocks[k] = _GPU if pv == _GPU else entry_value(_GPU, pv)
        self.counters.stored_blocks += 1
        return True

    def _stored_blocks(
        self,
        hashes: list[int],
        keys: Sequence[BlockKey | None],
        parent_key: BlockKey | None,
        tier: int,
        write: IndexWrite,
    ) -> None:
        pos = _TIER_POS[tier]
        engine = self._engine
        touched: list[BlockKey] = []
        parent = parent_key
        for h, k in zip(hashes, keys, strict=True):
            rec = engine.get(h)
            if rec is None:
                counts = [0] * _COUNT_BYTES
            elif (_rec_key(rec) or None) != k:
                # the engine reused a hash for different content: the newer claim wins
                old_key = self._forget(h, write)
                if old_key is not None:
                    touched.append(old_key)
                counts = [0] * _COUNT_BYTES
            else:
                counts = self._counts(h, rec)
            counts[pos] += 1
            write.mirror[h] = self._put(h, k, parent, counts)
            if k is not None:
                if self._hold(k, h) and parent is not None:
                    self._link(k, parent)
                touched.append(k)
                self.counters.stored_blocks += 1
            parent = k
        self._settle(touched, write)

    def _removed_one(self, ev: BlockRemoved, write: IndexWrite) -> bool:
        """:meth:`_removed` of a one-block event in the steady state (its hash held once, on
        the event's tier only, and alone holding its key, or holding none): the same state
        and writes without the batch's lists. False, with nothing changed, for anything
        else, which :meth:`_removed` then handles."""
        h = ev.block_hashes[0]
        engine = self._engine
        rec = engine.get(h)
        if rec is None or (ev.group_idx is not None and not self._wanted_group(ev.group_idx)):
            return False
        medium = ev.medium
        gpu = medium is None or medium == "GPU"  # _event_tier's shortcut, without the call
        tail = _GPU_COPY if gpu else _ONE_COPY[_event_tier(medium, ev.locality)]
        if not rec.endswith(tail):
            return False
        key = rec[:KEY_BYTES] if len(rec) == _CHILD_REC else rec[:-_COUNT_BYTES]  # _rec_key
        if rec != tail and self._by_key.get(key) != h:
            return False
        del engine[h]
        write.mirror[h] = None
        self.counters.removed_blocks += 1
        if not key:
            return True
        del self._by_key[key]
        self._value.pop(key, None)
        self._unlink(key, _rec_parent(rec))
        write.blocks[key] = 0
        write.removed.add(key)
        if key in self._children:  # a parent before its children: rare on vLLM
            self._settle_descendants(list(self._kids(key)), write)
        return True

    def _removed(self, ev: BlockRemoved, write: IndexWrite) -> None:
        if not self._wanted_group(ev.group_idx):
            return
        tier = int(tier_of_medium(ev.medium, ev.locality))
        hashes = ev.block_hashes
        n = len(hashes)
        engine = self._engine
        tail = _ONE_COPY[tier]
        found = list(map(engine.get, hashes))
        ok = None not in found and len(set(hashes)) == n
        recs = cast("list[bytes]", found) if ok else []
        if recs and all(map(bytes.endswith, recs, repeat(tail))):
            # every hash held once, on this tier only: each removal forgets its hash
            keys = list(map(_rec_key, recs))
            if recs.count(tail) == n or list(map(self._by_key.get, keys)) == hashes:
                # ... and each key is empty (never indexed) or held by that hash alone
                for h in hashes:
                    del engine[h]
                by_key = self._by_key
                orphaned: list[BlockKey] = []
                children = self._children
                for k, held in zip(keys, recs, strict=True):
                    if k:
                        del by_key[k]
                        self._value.pop(k, None)
                        self._unlink(k, _rec_parent(held))
                        if k in children:  # a parent before its children: rare on vLLM
                            orphaned.extend(self._kids(k))
                write.mirror.update(dict.fromkeys(hashes))
                indexed = list(filter(None, keys))
                write.blocks.update(dict.fromkeys(indexed, 0))
                write.removed.update(indexed)
                self.counters.removed_blocks += n
                if orphaned:
                    self._settle_descendants(orphaned, write)
                return
        pos = _TIER_POS[tier]
        touched: list[BlockKey] = []
        for h in hashes:
            rec = engine.get(h)
            if rec is None or rec[len(rec) - _COUNT_BYTES + pos] == 0:
                self.counters.unknown_removed += 1
                continue
            counts = self._counts(h, rec)
            counts[pos] -= 1
            if any(counts):
                key = _rec_key(rec) or None
                write.mirror[h] = self._put(h, key, _rec_parent(rec), counts)
                if key is not None:
                    touched.append(key)
            else:
                old_key = self._forget(h, write)
                if old_key is not None:
                    touched.append(old_key)
            self.counters.removed_blocks += 1
        self._settle(touched, write)

    def _settle_descendants(self, keys: list[BlockKey], write: IndexWrite) -> None:
        """Recompute held ``keys`` whose parent changed (they are not in ``write`` yet)."""
        self._settle([k for k in dict.fromkeys(keys) if k in self._by_key], write)

    def _forget(self, h: int, write: IndexWrite) -> BlockKey | None:
        """Drop engine hash ``h``; returns its key (to settle) if it had one."""
        rec = self._engine.pop(h)
        self._wide.pop(h, None)
        write.mirror[h] = None
        key = _rec_key(rec)
        if not key:
            return None
        if self._release(key, h):
            self._unlink(key, _rec_parent(rec))
        return key
