"""The embedded prefix index: one process, bounded memory, no network.

Structure (per replica, one :class:`_Replica`)::

    blocks   OrderedDict  block key -> entry value     (current epoch; LRU order, oldest first)
    mirror   dict         engine hash -> mirror record (current epoch; the agent's persistence)
    pending  _Pending     block key -> expiry ms       (current epoch; gateway-owned)
    removed  dict + heap  block key -> ms of its latest removal (current epoch; the latest
                          ``removal_log`` by (time, key), as Redis's sorted set orders
                          them, so both trim the same entries when the agent's clock steps
                          back; ``removed_floor`` is the newest time trimmed from it, so
                          the log is complete after it; a key's time never goes back, as
                          Redis's ``ZADD GT``)

Lookup runs the shared binary search (:func:`cachecore.index.base.search_prefix`) per
routable replica over the entry values' run certificates: O(log n) dict probes per replica,
and a replica that holds nothing of the prompt costs one.

Invariants (checked by :meth:`MemoryIndex.check_invariants` in tests):

* ``_n_blocks == sum(len(r.blocks)) + graveyard entries``, and after every public call
  ``_n_blocks <= max_entries``;
* every stored value is a valid non-zero entry value (0 means "delete", never stored);
* ``pending._expiry`` holds exactly the unexpired-or-not-yet-trimmed entries, and every one of
  them is in a heap item ``(expiry, seq, keys)`` of its own expiry (one item per add; keys
  whose expiry moved on are skipped lazily when their old item pops).

Clearing a replica is O(1): it bumps the epoch and moves the old epoch's containers to a
graveyard that later calls free in bounded steps (freeing a million-entry dict at once would
stall the event loop for tens of milliseconds). Memory bound: at most ``max_entries`` stored
(replica, key) entries; when exceeded, the replica holding the most entries loses its least
recently used ones (LRU within a replica, so one busy replica cannot flush the others). Such
an eviction does not rewrite the certificates of the evicted entries' descendants (the index
does not know the chain), so a lookup may then count a prefix through a key evicted here;
recency order makes that rare, because a chain loses its tail first.
Recency is what the engine's own LRU sees: an entry is touched when the engine stores it
(apply) and when the gateway routes a request over it (add_pending), parents after children
so a chain is evicted from its tail, as vLLM does.

Time is the caller's ``now_ms`` everywhere: there is no clock inside, so tests are
deterministic and the Redis backend can be held to identical answers.
"""

from __future__ import annotations

import heapq
import uuid
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import eq
from typing import Any, cast

from cachecore.index.base import (
    DEFAULT_REMOVAL_LOG,
    NO_MATCH,
    ROUTABLE_STATES,
    IndexStats,
    PrefixMatch,
    RemovalFloor,
    ReplicaMeta,
    ReplicaState,
    StaleEpochError,
    empty_match,
    removals_at_or_after,
    removed_flags,
    search_prefix,
)
from cachecore.index.layout import validate_replica_id
from cachecore.keys import BlockKey
from cachecore.lifecycle import TIER_MASK, IndexWrite, check_entry_values

DEFAULT_MAX_ENTRIES = 2_000_000
DEFAULT_MAX_PENDING_PER_REPLICA = 262_144
_GRAVEYARD_STEP = 4096  # entries freed per mutating call


class _Pending:
    """Pending block keys of one replica and epoch, with the Redis backend's sorted-set
    semantics: adding keeps the later expiry (``ZADD GT``), expired entries are trimmed on
    write, and when over ``cap`` the entries with the lowest expiries go, every entry of the
    cut-off expiry with them (``ZREMRANGEBYSCORE`` up to it): trimming never splits a
    request's keys, which share one expiry, so expiries stay non-increasing along a chain."""

    __slots__ = ("_expiry", "_heap", "_heap_keys", "_max_expiry", "_seq")

    def __init__(self) -> None:
        self._expiry: dict[BlockKey, int] = {}
        # one heap item per add() call: its keys share one expiry, so a request costs one
        # push and one pop instead of one per block (the gateway's hottest write)
        self._heap: list[tuple[int, int, Sequence[BlockKey]]] = []
        self._heap_keys = 0  # keys held by heap items, stale ones included
        self._max_expiry = 0
        self._seq = 0  # tie-breaker: heap items never compare their key lists

    def __len__(self) -> int:
        return len(self._expiry)

    def get(self, key: BlockKey) -> int:
        return self._expiry.get(key, 0)

    def add(self, keys: Sequence[BlockKey], expiry: int, now_ms: int, cap: int) -> None:
        exp = self._expiry
        if expiry >= self._max_expiry:  # no key can hold a later expiry: a C-speed update
            self._max_expiry = expiry
            exp.update(dict.fromkeys(keys, expiry))
        else:
            for k in keys:
                old = exp.get(k)
                if old is None or expiry > old:
                    exp[k] = expiry
        if keys:
            self._seq += 1
            heapq.heappush(self._heap, (expiry, self._seq, tuple(keys)))
            self._heap_keys += len(keys)
        # Trim in expiry order: expired entries, then the lowest expiries while over the
        # cap, and with the last one trimmed every entry sharing its expiry. A key is
        # dropped only by the item of its current expiry (older items of it are stale).
        heap = self._heap
        cut = now_ms
        while heap and (heap[0][0] <= cut or len(exp) > cap):
            e, _, group = heapq.heappop(heap)
            self._heap_keys -= len(group)
            # delete the keys whose expiry is still this item's, in C loops (a request's
            # 100+ keys expire together on every add)
            current = compress(group, map(eq, map(exp.get, group), repeat(e)))
            deque(map(exp.__delitem__, current), maxlen=0)
            cut = max(cut, e)
        if self._heap_keys > 2 * len(exp) + 1024:  # too many stale keys held: rebuild
            by_expiry: dict[int, list[BlockKey]] = {}
            for k, e in exp.items():
                by_expiry.setdefault(e, []).append(k)
            self._heap = [(e, i, ks) for i, (e, ks) in enumerate(by_expiry.items())]
            heapq.heapify(self._heap)
            self._seq = len(self._heap)
            self._heap_keys = len(exp)

    def withdraw(
        self,
        keys: Sequence[BlockKey],
        expiry: int,
        now_ms: int,
        restore: Sequence[int] | None,
    ) -> None:
        """Undo an :meth:`add` of ``keys`` at ``expiry`` (see
        :meth:`~cachecore.index.base.PrefixIndex.remove_pending`): only keys still at that
        expiry change. A key set back gets a heap item of its new expiry (the invariant);
        a removed one leaves only stale heap items, skipped when they pop."""
        exp = self._expiry
        back: dict[int, list[BlockKey]] = {}
        for i, k in enumerate(keys):
            if exp.get(k) != expiry:
                continue  # gone, or a later write's now
            to = restore[i] if restore else 0
            if to > now_ms:
                exp[k] = to
                back.setdefault(to, []).append(k)
            else:
                del exp[k]
        for to, ks in back.items():
            # a restored expiry may be later than any add gave: add()'s fast path must
            # not take a later, lower one for "later than every expiry held"
            self._max_expiry = max(self._max_expiry, to)
            self._seq += 1
            heapq.heappush(self._heap, (to, self._seq, tuple(ks)))
            self._heap_keys += len(ks)

    def unexpired(self, now_ms: int) -> int:
        return sum(1 for e in self._expiry.values() if e > now_ms)


@dataclass(slots=True)
class _Replica:
    epoch: int = 0
    state: ReplicaState = ReplicaState.UNKNOWN
    last_seq: int = -1
    engine_start: float = 0.0
    updated_ms: int = 0
    blocks: OrderedDict[BlockKey, int] = field(default_factory=OrderedDict)
    mirror: dict[int, bytes] = field(default_factory=dict)
    pending: _Pending = field(default_factory=_Pending)
    removed: dict[BlockKey, int] = field(default_factory=dict)
    # one (time, key) item per time set in ``removed``, lowest first: the trim order (items
    # whose key's time has moved on are stale, skipped when they pop)
    removed_heap: list[tuple[int, BlockKey]] = field(default_factory=list)
    removed_floor: int = -1

    def meta(self) -> ReplicaMeta:
        return ReplicaMeta(
            self.epoch, self.state, self.last_seq, self.engine_start, self.updated_ms
        )


def check_write_values(write: IndexWrite) -> None:
    """Every value of ``write.blocks`` must be an entry value (0 deletes;
    :func:`cachecore.lifecycle.check_entry_values`); checked before any change so a bad
    write changes nothing. Values within 0..TIER_MASK (deletes and plain tier bits, every
    value of a steady engine) are valid as they are: the full check only for the others."""
    values = write.blocks.values()
    if values and (min(values) < 0 or max(values) > TIER_MASK):
        check_entry_values(values)


def _search(rep: _Replica, keys: Sequence[BlockKey], now_ms: int) -> PrefixMatch:
    blocks, pending = rep.blocks, rep.pending

    def value_at(i: int) -> int:
        return blocks.get(keys[i], 0)

    def expiry_at(i: int) -> int:
        return pending.get(keys[i])

    tiers, stored, pend = search_prefix(value_at, expiry_at, len(keys), now_ms)
    return PrefixMatch(tiers, stored, pend, rep.state)


class MemoryIndex:
    """In-process :class:`~cachecore.index.base.PrefixIndex` (the embedded default)."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_pending_per_replica: int = DEFAULT_MAX_PENDING_PER_REPLICA,
        removal_log: int = DEFAULT_REMOVAL_LOG,
        keep_mirror: bool = True,
    ) -> None:
        if max_entries <= 0 or max_pending_per_replica <= 0 or removal_log < 0:
            raise ValueError("bounds must be positive")
        self.max_entries = max_entries
        self.max_pending_per_replica = max_pending_per_replica
        # 0 keeps no log (the simulator: nothing checks claims there); removed_since then
        # answers None, "unknown"
        self.removal_log = removal_log
        # False keeps no mirror records (the simulator: no agent restarts in virtual time,
        # and a write per stored and evicted block into a fleet-sized dict is not free);
        # load_mirror then answers {}, as for a replica never written
        self.keep_mirror = keep_mirror
        self._replicas: dict[str, _Replica] = {}
        self._n_blocks = 0  # live entries + entries waiting in the graveyard
        # old-epoch containers waiting to be freed; the bool says whether they hold stored
        # entries (counted in _n_blocks) or mirror/pending data (bounded by other means)
        self._graveyard: deque[tuple[dict[Any, Any] | list[Any], bool]] = deque()
        self._instance = uuid.uuid4().hex
        self.evicted_entries = 0

    # ------------------------------------------------------------------ helpers
    def _rep(self, replica: str) -> _Replica:
        rep = self._replicas.get(replica)
        if rep is None:
            validate_replica_id(replica)
            rep = self._replicas[replica] = _Replica()
        return rep

    def _drain(self, budget: int = _GRAVEYARD_STEP) -> None:
        """Free up to ``budget`` graveyard items (the O(n) part of a clear, spread out)."""
        while budget > 0 and self._graveyard:
            box, counted = self._graveyard[0]
            n = min(budget, len(box))
            if isinstance(box, list):
                del box[len(box) - n :]
            elif n == len(box):
                box.clear()
            else:
                for _ in range(n):
                    box.popitem()
            if counted:
                self._n_blocks -= n
            budget -= n
            if not box:
                self._graveyard.popleft()

    def _bury(self, rep: _Replica) -> None:
        """Hand ``rep``'s containers to the graveyard (freed a step at a time by
        :meth:`_drain`); the caller replaces or drops them."""
        for box, counted in (
            (rep.blocks, True),  # still counted in _n_blocks until freed
            (rep.mirror, False),
            (rep.pending._expiry, False),
            (rep.pending._heap, False),
            (rep.removed, False),
            (rep.removed_heap, False),
        ):
            if box:
                self._graveyard.append((box, counted))

    def _enforce_bound(self) -> None:
        excess = self._n_blocks - self.max_entries
        if excess <= 0:
            return
        self._drain(excess)
        excess = self._n_blocks - self.max_entries
        if excess <= 0:
            return
        # evict a little more than needed so the bound is not re-hit on every write
        target = excess + max(1, self.max_entries // 256)
        while target > 0 and self._n_blocks > 0:
            victim = max(self._replicas.values(), key=lambda r: len(r.blocks))
            n = min(target, len(victim.blocks))
            if n == 0:
                break
            for _ in range(n):
                victim.blocks.popitem(last=False)
            self._n_blocks -= n
            self.evicted_entries += n
            target -= n

    def _log_removals(self, rep: _Replica, keys: list[BlockKey], now_ms: int) -> None:
        """Log ``keys`` removed at ``now_ms`` and trim the log to ``removal_log`` entries,
        as the Redis script does: a key's time never goes back (``ZADD GT``: an agent clock
        that stepped back must not hide a removal's later stamp), and the lowest
        (time, key) go first (``ZREMRANGEBYRANK``), ``removed_floor`` the newest time
        trimmed."""
        removed, heap = rep.removed, rep.removed_heap
        for k in keys:
            old = removed.get(k)
            if old is None or now_ms > old:
                removed[k] = now_ms
                heapq.heappush(heap, (now_ms, k))
        while len(removed) > self.removal_log:
            t, k = heapq.heappop(heap)
            if removed.get(k) == t:
                del removed[k]
                if t > rep.removed_floor:
                    rep.removed_floor = t
        if len(heap) > 2 * len(removed) + 1024:  # too many stale items held: rebuild
            rep.removed_heap = [(t, k) for k, t in removed.items()]
            heapq.heapify(rep.removed_heap)

    # ------------------------------------------------------------------ PrefixIndex
    async def lookup(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int
    ) -> dict[str, PrefixMatch]:
        return self.lookup_now(keys, replicas, now_ms)

    def lookup_now(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int
    ) -> dict[str, PrefixMatch]:
        """:meth:`lookup` without the coroutine (the simulator calls it per request)."""
        out: dict[str, PrefixMatch] = {}
        for rid in replicas:
            rep = self._replicas.get(rid)
            if rep is None:
                validate_replica_id(rid)
                out[rid] = empty_match(ReplicaState.UNKNOWN)
                continue
            if rep.state not in ROUTABLE_STATES:
                out[rid] = empty_match(rep.state)
                continue
            if not keys or (keys[0] not in rep.blocks and rep.pending.get(keys[0]) <= now_ms):
                # the common case on a big fleet: the first block is neither stored nor
                # pending here, so nothing matches (shared immutable empty answer)
                out[rid] = NO_MATCH if rep.state is ReplicaState.LIVE else empty_match(rep.state)
                continue
            out[rid] = _search(rep, keys, now_ms)
        return out

    async def add_pending(
        self, replica: str, keys: Sequence[BlockKey], ttl_ms: int, now_ms: int
    ) -> None:
        self.add_pending_now(replica, keys, ttl_ms, now_ms)

    def add_pending_now(
        self, replica: str, keys: Sequence[BlockKey], ttl_ms: int, now_ms: int
    ) -> None:
        """:meth:`add_pending` without the coroutine: the gateway records a dispatch in
        the same loop tick as its upstream write, with no await in between."""
        rep = self._rep(replica)
        rep.pending.add(keys, now_ms + ttl_ms, now_ms, self.max_pending_per_replica)
        blocks = rep.blocks
        # routed over: recently used, parents last (most recent); C loops over the keys,
        # most of which this replica does not store (they are the ones pending)
        deque(map(blocks.move_to_end, filter(blocks.__contains__, reversed(keys))), maxlen=0)
        if self._graveyard:
            self._drain()

    async def remove_pending(
        self,
        replica: str,
        keys: Sequence[BlockKey],
        expiry_ms: int,
        now_ms: int,
        restore: Sequence[int] | None = None,
    ) -> None:
        self.remove_pending_now(replica, keys, expiry_ms, now_ms, restore)

    def remove_pending_now(
        self,
        replica: str,
        keys: Sequence[BlockKey],
        expiry_ms: int,
        now_ms: int,
        restore: Sequence[int] | None = None,
    ) -> None:
        """:meth:`remove_pending` without the coroutine (the gateway's local index)."""
        rep = self._replicas.get(replica)
        if rep is not None:
            rep.pending.withdraw(keys, expiry_ms, now_ms, restore)

    async def apply(self, replica: str, epoch: int, write: IndexWrite, now_ms: int) -> None:
        self.apply_now(replica, epoch, write, now_ms)

    def apply_now(self, replica: str, epoch: int, write: IndexWrite, now_ms: int) -> None:
        """:meth:`apply` without the coroutine (the simulator calls it per engine step)."""
        rep = self._replicas.get(replica) or self._rep(replica)
        if epoch != rep.epoch:
            raise StaleEpochError(f"replica {replica}: epoch {epoch} != current {rep.epoch}")
        check_write_values(write)
        blocks = rep.blocks
        added = 0
        logged: list[BlockKey] | None = [] if self.removal_log else None
        for k, bits in reversed(write.blocks.items()):
            if bits:
                if k in blocks:
                    blocks[k] = bits
                    blocks.move_to_end(k)
                else:  # a new key is inserted last already: no move
                    added += 1
                    blocks[k] = bits
            elif blocks.pop(k, None) is not None:
                added -= 1
                if logged is not None:
                    logged.append(k)
        self._n_blocks += added
        if logged is not None:
            wblocks = write.blocks
            # deleted and stored again within the write (as Redis: by the write's value)
            logged.extend(k for k in write.removed if wblocks.get(k))
            if logged:
                self._log_removals(rep, logged, now_ms)
        wmirror = write.mirror
        if wmirror and self.keep_mirror:
            # every record in one C call, then the deleted ones (None) out again: the same
            # contents and order as setting and popping them one by one
            mirror = rep.mirror
            mirror.update(cast("dict[int, bytes]", wmirror))  # its Nones go next
            for h in [h for h, rec in wmirror.items() if rec is None]:
                del mirror[h]
        if write.seq is not None:
            rep.last_seq = write.seq
        rep.updated_ms = now_ms
        if self._graveyard:
            self._drain()
        if self._n_blocks > self.max_entries:
            self._enforce_bound()

    async def clear_replica(
        self, replica: str, state: ReplicaState, now_ms: int, engine_start: float = 0.0
    ) -> int:
        rep = self._rep(replica)
        self._bury(rep)
        rep.blocks = OrderedDict()
        rep.mirror = {}
        rep.pending = _Pending()
        rep.removed = {}
        rep.removed_heap = []
        # the old log went with the old epoch: "cannot tell" of anything before the clear
        # (as CLEAR_LUA), never "not removed"
        rep.removed_floor = now_ms
        rep.epoch += 1
        rep.state = state
        rep.last_seq = -1
        rep.engine_start = engine_start
        rep.updated_ms = now_ms
        self._drain()
        return rep.epoch

    def forget_replica_now(self, replica: str, *, unwritten_only: bool = False) -> bool:
        """Drop everything held for ``replica`` (a departed one: replica ids come and go
        with discovery, and an entry kept per id ever seen grows without bound): its
        entries, pending entries, removal log and meta. Its containers are freed through
        the graveyard, as a clear's are. A replica of that id written later starts from
        scratch (epoch 0, state unknown). With ``unwritten_only``, only a replica no agent
        has written (no clear, no batch, no engine start: its pending entries and state
        are a gateway's own). Returns whether it was dropped."""
        rep = self._replicas.get(replica)
        if rep is None:
            return False
        if unwritten_only and (
            rep.epoch or rep.last_seq >= 0 or rep.engine_start or rep.blocks or rep.mirror
        ):
            return False
        del self._replicas[replica]
        self._bury(rep)
        self._drain()
        return True

    async def removed_since(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[bool] | None:
        return removed_flags(await self.removal_times(replica, keys, since_ms))

    async def removal_times(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[float | None] | None:
        rep = self._replicas.get(replica)
        if rep is None:
            validate_replica_id(replica)
            return [None] * len(keys)
        if not self.removal_log or rep.removed_floor >= since_ms:
            return None
        get = rep.removed.get
        return removals_at_or_after([get(k) for k in keys], since_ms)

    async def removal_floor(self, replica: str) -> RemovalFloor:
        rep = self._replicas.get(replica)
        if rep is None:
            validate_replica_id(replica)
            return RemovalFloor()
        return RemovalFloor(rep.removed_floor, rep.updated_ms)

    async def set_state(self, replica: str, state: ReplicaState, now_ms: int) -> None:
        self.set_state_now(replica, state, now_ms)

    def set_state_now(self, replica: str, state: ReplicaState, now_ms: int) -> None:
        rep = self._rep(replica)
        rep.state = state
        rep.updated_ms = now_ms

    async def meta(self, replica: str) -> ReplicaMeta:
        rep = self._replicas.get(replica)
        if rep is None:
            validate_replica_id(replica)
            return ReplicaMeta()
        return rep.meta()

    async def set_engine_start(self, replica: str, engine_start: float) -> None:
        self._rep(replica).engine_start = engine_start

    async def load_mirror(self, replica: str) -> dict[int, bytes]:
        rep = self._replicas.get(replica)
        return dict(rep.mirror) if rep is not None else {}

    async def replica_blocks(self, replica: str) -> dict[BlockKey, int]:
        rep = self._replicas.get(replica)
        return dict(rep.blocks) if rep is not None else {}

    async def instance_id(self) -> str:
        """Changes when the index loses its contents (a new process): agents compare it to
        decide whether to rewrite their mirror."""
        return self._instance

    async def stats(self) -> IndexStats:
        distinct: set[BlockKey] = set()
        stored = pending = 0
        for rep in self._replicas.values():
            stored += len(rep.blocks)
            pending += len(rep.pending)
            distinct.update(rep.blocks)
        return IndexStats(
            replicas=len(self._replicas),
            stored_entries=stored,
            pending_entries=pending,
            distinct_keys=len(distinct),
            extra={
                "evicted_entries": float(self.evicted_entries),
                "graveyard_entries": float(self._n_blocks - stored),
                "mirror_entries": float(sum(len(r.mirror) for r in self._replicas.values())),
            },
        )

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------ tests
    def check_invariants(self) -> None:
        live = sum(len(r.blocks) for r in self._replicas.values())
        dead = sum(len(d) for d, counted in self._graveyard if counted)
        assert self._n_blocks == live + dead, (self._n_blocks, live, dead)
        assert self._n_blocks <= self.max_entries
        for r in self._replicas.values():
            assert all(b != 0 for b in r.blocks.values())
            held = {(e, k) for e, _, keys in r.pending._heap for k in keys}
            assert all((e, k) in held for k, e in r.pending._expiry.items())
            assert r.pending._heap_keys == sum(len(keys) for _, _, keys in r.pending._heap)
            logged = set(r.removed_heap)
            assert all((t, k) in logged for k, t in r.removed.items())
            assert len(r.removed) <= self.removal_log
            # no time-vs-floor bound: a removal stamped before a clear's floor (an agent
            # clock stepped back) stays in the log below it, as in Redis (never read:
            # since_ms > floor > its time)
