"""The prefix index interface: block key -> replicas, with interchangeable backends.

Backends (:mod:`cachecore.index.memory`, :mod:`cachecore.index.redis`) store and answer; they
hold no lifecycle logic of their own. Stored entries change only through
:class:`~cachecore.lifecycle.IndexWrite` batches computed by the agent's
:class:`~cachecore.lifecycle.ReplicaMirror`; pending entries only through
:meth:`PrefixIndex.add_pending`, written by the gateway at dispatch.

Lookup semantics (identical in every backend; a property test holds them to it). For each
requested replica, over the request's chained keys ``k_0 .. k_{n-1}``:

* ``tier_blocks[t]``: length of the longest prefix whose every key is stored on tier ``t``;
* ``stored_blocks``: longest prefix whose every key is stored on at least one tier;
* ``pending_blocks``: longest prefix whose every key is stored or pending (expiry > now);
* a replica whose state is not ``live`` or ``cold`` answers zeros, with its state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from cachecore.keys import BlockKey
from cachecore.lifecycle import ALL_TIERS, IndexWrite, Tier


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


@dataclass(frozen=True, slots=True)
class ReplicaMeta:
    """Per replica (and DP rank) bookkeeping kept beside its entries."""

    epoch: int = 0
    state: ReplicaState = ReplicaState.UNKNOWN
    last_seq: int = -1
    engine_start: float = 0.0
    updated_ms: int = 0


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

    async def apply(self, replica: str, epoch: int, write: IndexWrite, now_ms: int) -> None:
        """Apply an agent's write. Raises :class:`StaleEpochError` if ``epoch`` is not the
        replica's current epoch."""
        ...

    async def clear_replica(
        self, replica: str, state: ReplicaState, now_ms: int, engine_start: float = 0.0
    ) -> int:
        """Drop every entry of ``replica`` in O(1) by moving to a new epoch; return it."""
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


def longest_prefix(
    stored: Sequence[int], pending: Sequence[bool]
) -> tuple[dict[Tier, int], int, int]:
    """Shared scan: ``stored[i]`` is key i's tier bits (0 = not stored), ``pending[i]``
    whether it is pending and unexpired. Used by every backend that scans on the client."""
    tier_len = dict.fromkeys(ALL_TIERS, 0)
    open_tiers = set(ALL_TIERS)
    stored_len = pending_len = 0
    stored_open = True
    for i, bits in enumerate(stored):
        if bits == 0 and not pending[i]:
            break
        pending_len = i + 1
        if stored_open:
            if bits:
                stored_len = i + 1
            else:
                stored_open = False
        for t in list(open_tiers):
            if bits & int(t):
                tier_len[t] = i + 1
            else:
                open_tiers.discard(t)
    return tier_len, stored_len, pending_len
