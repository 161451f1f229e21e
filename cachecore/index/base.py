"""The prefix index interface: block key -> replicas, with interchangeable backends.

Backends (:mod:`cachecore.index.memory`, :mod:`cachecore.index.redis`) store and answer; they
hold no lifecycle logic of their own. Stored entries change only through
:class:`~cachecore.lifecycle.IndexWrite` batches computed by the agent's
:class:`~cachecore.lifecycle.ReplicaMirror`; pending entries only through
:meth:`PrefixIndex.add_pending`, written by the gateway at dispatch.

Lookup semantics (identical in every backend; a property test holds them to it). An entry's
value carries its tier bits and run certificates (:func:`cachecore.lifecycle.entry_value`):
whether the block ends an unbroken run from the chain's root on each tier, and on any tier.
For each requested replica, over the request's chained keys ``k_0 .. k_{n-1}``:

* ``stored_blocks``: the end of the stored run: the first ``i`` whose entry is not in an
  unbroken stored run (:func:`~cachecore.lifecycle.in_stored_run`);
* ``tier_blocks[t]``: the end of tier ``t``'s run within it;
* ``pending_blocks``: the stored run extended by the pending (unexpired) keys after it;
* a replica whose state is not ``live`` or ``cold`` answers zeros, with its state.

Each end is found by the binary search :func:`run_end`, from O(log n) probes. The answers are
exact (equal to :func:`longest_prefix` over the tier bits) when the certificates are, which the
agent's mirror guarantees, and when pending keys are written as whole chains from the root (a
request's keys), which keeps expiries non-increasing along every chain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from cachecore.keys import BlockKey
from cachecore.lifecycle import ALL_TIERS, IndexWrite, Tier, in_stored_run, run_tiers


class ReplicaState(StrEnum):
    LIVE = "live"
    COLD = "cold"  # cleared after a gap older than the replay buffer: known empty
    UNAVAILABLE = "unavailable"  # engine unreachable: entries kept, not routable
    UNKNOWN = "unknown"  # no agent has ever reported this replica


ROUTABLE_STATES = frozenset({ReplicaState.LIVE, ReplicaState.COLD})


class IndexError_(RuntimeError):
    """The index backend failed (unreachable, script error). Callers degrade, never fail
    a client request because of it."""


class StaleEpochError(IndexError_):
    """A write carried an epoch older than the replica's current one (the replica was
    cleared in between); the writer must reload its epoch and resync."""


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    tier_blocks: Mapping[Tier, int]
    stored_blocks: int
    pending_blocks: int
    state: ReplicaState = ReplicaState.LIVE

    @property
    def gpu_blocks(self) -> int:
        return self.tier_blocks.get(Tier.GPU, 0)


EMPTY_TIERS: Mapping[Tier, int] = {t: 0 for t in ALL_TIERS}


def empty_match(state: ReplicaState = ReplicaState.LIVE) -> PrefixMatch:
    return PrefixMatch(EMPTY_TIERS, 0, 0, state)


NO_MATCH: PrefixMatch = empty_match()
"""The shared (immutable) answer for a live replica holding none of the prompt."""


DEFAULT_REMOVAL_LOG = 16_384
"""Removals remembered per replica for :meth:`PrefixIndex.removed_since` (both backends):
~1.6 MB per replica in Redis when full, ~2.5 MB in the memory backend; at vLLM's typical
eviction rates under pressure (hundreds of blocks a second per engine) tens of seconds."""


@dataclass(frozen=True, slots=True)
class ReplicaMeta:
    """Per replica (and DP rank) bookkeeping kept beside its entries."""

    epoch: int = 0
    state: ReplicaState = ReplicaState.UNKNOWN
    last_seq: int = -1
    engine_start: float = 0.0
    updated_ms: int = 0
    # fields that held what no agent writes (not a number), read as absent above: a reader
    # goes on (the gateway), the replica's own agent rebuilds it (cause corrupt_meta)
    unreadable: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RemovalFloor:
    """What one replica's removal log rests on, as its meta holds them (the agent's clock):
    removals at or before ``floor_ms`` were trimmed from the log (-1: none), ``updated_ms``
    is the agent's latest write. None: the meta holds there what no agent writes (not an
    integer). Agent-written, so the gateway judges it (:mod:`gateway.quarantine`)."""

    floor_ms: int | None = -1
    updated_ms: int | None = 0


@dataclass(frozen=True, slots=True)
class IndexStats:
    replicas: int
    stored_entries: int
    pending_entries: int
    distinct_keys: int
    extra: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class PrefixIndex(Protocol):
    """Block key -> replica index. All methods are coroutines: the Redis backend does I/O
    and the gateway calls them on its hot path."""

    async def lookup(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int
    ) -> dict[str, PrefixMatch]:
        """Longest-prefix match of ``keys`` on each replica, in one round trip."""
        ...

    async def add_pending(
        self, replica: str, keys: Sequence[BlockKey], ttl_ms: int, now_ms: int
    ) -> None:
        """Mark ``keys`` pending on ``replica`` until ``now_ms + ttl_ms`` (gateway-owned)."""
        ...

    async def remove_pending(
        self,
        replica: str,
        keys: Sequence[BlockKey],
        expiry_ms: int,
        now_ms: int,
        restore: Sequence[int] | None = None,
    ) -> None:
        """Undo an :meth:`add_pending` of ``keys`` whose expiry was ``expiry_ms`` (the engine
        refused that request, or never got it): each key whose pending expiry is still
        exactly ``expiry_ms`` goes, or is set back to ``restore[i]`` when that is later
        than ``now_ms``. A key whose expiry a later write raised (``ZADD GT``) is that
        write's and stays. ``restore``: per key, the expiry of another live write covering
        it that this one's overwrote (0: none); the caller knows its own (the gateway's
        in-flight requests), not other gateways'. Gateway-owned, like :meth:`add_pending`."""
        ...

    async def apply(self, replica: str, epoch: int, write: IndexWrite, now_ms: int) -> None:
        """Apply an agent's write. Raises :class:`StaleEpochError` if ``epoch`` is not the
        replica's current epoch."""
        ...

    async def clear_replica(
        self, replica: str, state: ReplicaState, now_ms: int, engine_start: float = 0.0
    ) -> int:
        """Drop every entry of ``replica`` in O(1) by moving to a new epoch; return it."""
        ...

    async def removed_since(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[bool] | None:
        """For each of ``keys``: whether a write of ``replica``'s current epoch deleted its
        stored entry at a ``now_ms`` >= ``since_ms`` (the removal log). None when the log
        no longer reaches back to ``since_ms``: it keeps the latest
        ``DEFAULT_REMOVAL_LOG`` removals per replica, so older ones are unknown.

        It tells "evicted and stored again since" from "never removed", which an entry's
        current value cannot: the gateway's claim check asks it about the first block an
        engine did not have (see :mod:`gateway.quarantine`)."""
        ...

    async def removal_times(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[float | None] | None:
        """:meth:`removed_since` with the times: per key the ``now_ms`` of the write that
        removed it, when at or after ``since_ms`` (else None); None when the log cannot
        tell. The time is the agent's to write (a rogue can log a removal "in the
        future", which excuses a miss forever), so the gateway judges it
        (:func:`gateway.quarantine.judge_removal`)."""
        ...

    async def removal_floor(self, replica: str) -> RemovalFloor:
        """The floor of ``replica``'s removal log and its meta's ``updated_ms``: what the
        gateway reads when :meth:`removed_since` cannot tell, since a floor no honest log
        can have (later than the agent's own latest write) is a rogue agent's."""
        ...

    async def set_state(self, replica: str, state: ReplicaState, now_ms: int) -> None: ...

    async def meta(self, replica: str) -> ReplicaMeta: ...

    async def set_engine_start(self, replica: str, engine_start: float) -> None: ...

    async def load_mirror(self, replica: str) -> dict[int, bytes]:
        """The persisted agent mirror of the replica's current epoch."""
        ...

    async def replica_blocks(self, replica: str) -> dict[BlockKey, int]:
        """Every stored entry of the current epoch (tests, debugging, resync checks)."""
        ...

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...


def removed_flags(times: list[float | None] | None) -> list[bool] | None:
    """:meth:`PrefixIndex.removed_since`'s answer from :meth:`PrefixIndex.removal_times`'."""
    return None if times is None else [t is not None for t in times]


def removals_at_or_after(times: Sequence[float | None], since_ms: int) -> list[float | None]:
    """Each removal time kept if at or after ``since_ms`` (both backends' one filter)."""
    return [t if t is not None and t >= since_ms else None for t in times]


def run_end(ok: Callable[[int], bool], lo: int, hi: int) -> int:
    """The first ``i`` in ``[lo, hi]`` with ``not ok(i)`` (``hi`` if none), for a predicate
    that holds below some point and fails from there on, ``ok`` assumed true below ``lo``.
    Probes ``lo``, then ``hi - 1``, then bisects: a run that is empty or complete costs one or
    two probes, any other O(log n). The Redis lookup script runs the same steps."""
    if lo >= hi or not ok(lo):
        return lo
    if ok(hi - 1):
        return hi
    lo, hi = lo + 1, hi - 1  # ok(lo - 1) holds, ok(hi) fails: the end is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo


def search_prefix(
    value_at: Callable[[int], int], expiry_at: Callable[[int], int], n: int, now_ms: int
) -> tuple[dict[Tier, int], int, int]:
    """The lookup of one replica over ``n`` keys: ``value_at(i)`` is key i's entry value
    (0: absent), ``expiry_at(i)`` its pending expiry (0: none). Returns (tier lengths,
    stored length, pending length)."""
    seen: dict[int, int] = {}

    def value(i: int) -> int:
        v = seen.get(i)
        if v is None:
            v = seen[i] = value_at(i)
        return v

    def on_tier_run(bit: int) -> Callable[[int], bool]:
        return lambda i: bool(run_tiers(value(i)) & bit)

    stored = run_end(lambda i: in_stored_run(value(i)), 0, n)
    tiers = {t: run_end(on_tier_run(int(t)), 0, stored) for t in ALL_TIERS}
    pending = run_end(lambda i: expiry_at(i) > now_ms, stored, n)
    return tiers, stored, pending


def longest_prefix(
    stored: Sequence[int], pending: Sequence[bool]
) -> tuple[dict[Tier, int], int, int]:
    """The exact definition the search answers when certificates are exact: ``stored[i]``
    is key i's tier bits (0 = not stored), ``pending[i]`` whether it is pending and
    unexpired. Tier and stored lengths are longest prefixes held; the pending length
    extends the stored one through the pending keys that follow it. Tests compare the
    backends with it."""
    n = len(stored)
    tier_len: dict[Tier, int] = {}
    for t in ALL_TIERS:
        end = 0
        while end < n and stored[end] & int(t):
            end += 1
        tier_len[t] = end
    stored_len = 0
    while stored_len < n and stored[stored_len]:
        stored_len += 1
    pending_len = stored_len
    while pending_len < n and pending[pending_len]:
        pending_len += 1
    return tier_len, stored_len, pending_len
