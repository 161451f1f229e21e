"""The gateway's access to the prefix index, which must never fail a request.

Every lookup runs under the policy's timeout. When the shared index (Redis) is slow or
down, the lookup is answered by a local :class:`MemoryIndex` holding this gateway's own
pending writes (what it routed where, for the pending TTL): routing degrades to "own
decisions + load", the way approximate routers work all the time, and the request goes on.
Pending writes go to both, in the background, so the dispatch path never waits on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from cachecore.index.base import IndexError_, PrefixIndex, PrefixMatch, ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import not_a_cluster
from cachecore.keys import BlockKey
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LookupResult:
    matches: dict[str, PrefixMatch]
    source: str  # "primary" | "local" | "none"
    seconds: float


@dataclass(eq=False, slots=True)
class PendingWrite:
    """One dispatch's pending entries: its keys on ``replica`` until ``expiry_ms``, kept
    while the request is in flight so that a refusal can undo them
    (:meth:`GatewayIndex.withdraw`)."""

    replica: str
    keys: Sequence[BlockKey]
    expiry_ms: int
    start: int = 0  # the chain position of ``keys[0]`` (the blocks before were stored)
    task: asyncio.Task[None] | None = None  # its background write to the shared index


class GatewayIndex:
    def __init__(
        self,
        primary: PrefixIndex,
        metrics: GatewayMetrics,
        local: MemoryIndex | None = None,
        max_background: int = 1024,
    ) -> None:
        self.primary = primary
        self.local = local  # None when the primary is itself in-process
        self.metrics = metrics
        self._bg: set[asyncio.Task[None]] = set()
        self._max_bg = max_background
        self.fallbacks = 0
        self.dropped_writes = 0
        self._local_live: set[str] = set()
        # per replica, this gateway's in-flight writes (identity-hashed): what a refused
        # request's undo must give back to the requests it overlapped
        self._inflight: dict[str, set[PendingWrite]] = {}
        self._warned = 0.0

    async def lookup(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int, timeout_s: float
    ) -> LookupResult:
        t0 = time.perf_counter()
        if not keys:
            return LookupResult({}, "none", 0.0)
        reason = ""
        try:
            if self.local is None:
                matches = await self.primary.lookup(keys, replicas, now_ms)
            else:
                # not wait_for: on 3.11 it swallows a cancellation that arrives as the
                # lookup completes, and the request of a client that left went upstream
                async with asyncio.timeout(timeout_s):
                    matches = await self.primary.lookup(keys, replicas, now_ms)
            if self.local is not None and self._local_live:
                # read-your-writes: our own pending writes may not have reached the shared
                # index yet; the local copy holds them at once
                own = await self.local.lookup(keys, replicas, now_ms)
                matches = {r: _longer(m, own.get(r)) for r, m in matches.items()}
            dt = time.perf_counter() - t0
            self.metrics.lookup.labels("primary").observe(dt)
            return LookupResult(matches, "primary", dt)
        except TimeoutError:
            reason = "timeout"
        except (IndexError_, OSError, ConnectionError) as exc:
            reason = "error"
            self._warn(exc)
        except Exception as exc:  # redis client errors have no common base with ours
            reason = "error"
            self._warn(exc)
        self.fallbacks += 1
        self.metrics.index_fallbacks.labels(reason).inc()
        if self.local is None:
            return LookupResult({}, "none", time.perf_counter() - t0)
        self._ensure_live(replicas, now_ms)
        matches = await self.local.lookup(keys, replicas, now_ms)
        dt = time.perf_counter() - t0
        self.metrics.lookup.labels("local").observe(dt)
        return LookupResult(matches, "local", dt)

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned > 5.0:
            self._warned = now
            if not_a_cluster(exc):
                # no outage: the server answers, and no retry will change its answer
                log.error(
                    "index lookup failed: the gateway runs with --redis-cluster "
                    "(KVGATE_REDIS_CLUSTER) and its Redis refuses CLUSTER SLOTS: a standalone "
                    "Redis (drop the switch) or an ACL user without +cluster|slots; every "
                    "lookup falls back meanwhile",
                    extra={"error": repr(exc)},
                )
                return
            log.warning(
                "index lookup failed; routing from local decisions", extra={"error": repr(exc)}
            )

    def _ensure_live(self, replicas: Sequence[str], now_ms: int) -> None:
        # the local index has no agent: its replicas are "live" as far as pending goes
        assert self.local is not None
        for r in replicas:
            if r not in self._local_live:
                self._local_live.add(r)
                self.local.set_state_now(r, ReplicaState.LIVE, now_ms)

    def forget(self, replica: str) -> None:
        """``replica`` left the pool for good (discovery removed it after its grace):
        drop what this gateway holds for it, or autoscaled replicas with fresh ids grow
        the local index and the live marks by one entry per id ever seen. Its in-flight
        writes go as their requests end (:meth:`done`, :meth:`withdraw`: the local index
        has nothing left to undo). Back later, it starts as a new replica (marked live
        again at its first pending write). An in-process primary (embedded mode) drops
        it only while no agent wrote it: its entries and state are then this gateway's
        own decisions; an agent's are the agent's (a shared index's are never touched:
        ``kvgate index forget`` is the operator's)."""
        if self.local is not None:
            self._local_live.discard(replica)
            self.local.forget_replica_now(replica)
        elif isinstance(self.primary, MemoryIndex):
            self.primary.forget_replica_now(replica, unwritten_only=True)

    def add_pending(
        self, replica: str, keys: Sequence[BlockKey], ttl_ms: int, now_ms: int, start: int = 0
    ) -> PendingWrite | None:
        """Record a dispatch, synchronously in-process (the next lookup must see it, or two
        concurrent requests of one prefix would miss each other; no await, so it lands in
        the same loop tick as the upstream write), in the background for a shared index
        (the request never waits for Redis). ``keys``: the request's chain of block keys
        from position ``start``. Returns the write, in flight until :meth:`done` or
        :meth:`withdraw`."""
        if not keys:
            return None
        w = PendingWrite(replica, keys, now_ms + ttl_ms, start)
        live = self._inflight.get(replica)
        if live is None:
            live = self._inflight[replica] = set()
        live.add(w)
        if self.local is None:
            if isinstance(self.primary, MemoryIndex):
                self.primary.add_pending_now(replica, keys, ttl_ms, now_ms)
            else:  # a shared index without a local copy: nothing to write at once
                w.task = self._spawn(self._primary_pending(replica, keys, ttl_ms, now_ms))
            return w
        self._ensure_live([replica], now_ms)
        self.local.add_pending_now(replica, keys, ttl_ms, now_ms)
        w.task = self._spawn(self._primary_pending(replica, keys, ttl_ms, now_ms))
        return w

    def done(self, w: PendingWrite) -> None:
        """The engine took the request: its entries stay until their expiry."""
        live = self._inflight.get(w.replica)
        if live is not None:
            live.discard(w)
            if not live:  # replica ids come and go (discovery): no empty set kept per id
                del self._inflight[w.replica]

    def withdraw(self, w: PendingWrite, now_ms: int) -> None:
        """The engine did not take the request (it refused it before any prefill, or was
        never reached): undo its pending entries, which would steer its scope's next
        requests to a replica that never computed the prefix until ``pending_ttl_ms``.

        Only what this write still holds goes: a key goes only while its expiry is this
        write's (a later write, from any gateway, raised it otherwise), and a key that an
        in-flight request of this gateway also wrote is set back to that request's expiry
        (this write's ``ZADD GT`` had overwritten it). Not covered: another *gateway's*
        earlier in-flight write of the same key (its expiry is lost, so the key goes and
        that request's replica is not preferred until its agent reports the blocks stored,
        a miss for at most that prefill), and a same-millisecond write of the same keys by
        another gateway (one expiry, indistinguishable). Both cost a routing guess, never
        a wrong answer; the TTL alone cost one per request of the scope for the whole TTL.
        Same loop tick for the local index; the shared index in the background, after
        this write's own background add (Redis must not see the undo first)."""
        self.done(w)
        restore = self._restore(w, now_ms)
        if self.local is None:
            if isinstance(self.primary, MemoryIndex):
                self.primary.remove_pending_now(w.replica, w.keys, w.expiry_ms, now_ms, restore)
            else:
                self._spawn(self._primary_withdraw(w, now_ms, restore))
            return
        self.local.remove_pending_now(w.replica, w.keys, w.expiry_ms, now_ms, restore)
        self._spawn(self._primary_withdraw(w, now_ms, restore))

    def _restore(self, w: PendingWrite, now_ms: int) -> list[int] | None:
        """Per key of ``w``, the latest expiry of this gateway's other in-flight writes on
        its replica that cover it (0: none); None when there is none at all (the usual
        case: refusals are rare, overlaps rarer).

        Block keys are chained (each names its whole prefix): two writes share a key only
        at one chain position, and then every key before it, so what they share is one run
        from the later of their starts, found by comparing keys from there. O(1) per other
        write that shares nothing, instead of a look at each of its keys: with hundreds of
        long requests in flight that was milliseconds of the event loop per refusal."""
        keys = w.keys
        n = len(keys)
        restore: list[int] | None = None
        for o in self._inflight.get(w.replica, ()):
            if o.expiry_ms <= now_ms:
                continue
            theirs = o.keys
            i = max(0, o.start - w.start)  # the run's first position, in w and in o
            j = i + w.start - o.start
            m = len(theirs)
            while i < n and j < m and theirs[j] == keys[i]:
                if restore is None:
                    restore = [0] * n
                if o.expiry_ms > restore[i]:
                    restore[i] = o.expiry_ms
                i += 1
                j += 1
        return restore

    async def _primary_withdraw(
        self, w: PendingWrite, now_ms: int, restore: list[int] | None
    ) -> None:
        if w.task is not None and not w.task.done():
            await asyncio.wait([w.task])  # bounded: the add runs under its own timeout
        try:
            async with asyncio.timeout(1.0):
                await self.primary.remove_pending(w.replica, w.keys, w.expiry_ms, now_ms, restore)
        except Exception as exc:  # counted; a leftover pending entry expires with its TTL
            self.metrics.pending_write_errors.inc()
            self._warn(exc)

    async def _primary_pending(
        self, replica: str, keys: Sequence[BlockKey], ttl_ms: int, now_ms: int
    ) -> None:
        try:
            async with asyncio.timeout(1.0):  # not wait_for (see lookup)
                await self.primary.add_pending(replica, keys, ttl_ms, now_ms)
        except Exception as exc:  # counted; a lost pending entry only costs a guess
            self.metrics.pending_write_errors.inc()
            self._warn(exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        if len(self._bg) >= self._max_bg:
            self.dropped_writes += 1
            self.metrics.pending_write_errors.inc()
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    async def settle(self) -> None:
        """Wait for background writes (tests, shutdown)."""
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):  # not wait_for (see lookup)
                await self.settle()
        with contextlib.suppress(Exception):
            await self.primary.close()
        if self.local is not None:
            await self.local.close()


def _longer(a: PrefixMatch, b: PrefixMatch | None) -> PrefixMatch:
    """``a`` with its pending length raised to ``b``'s (stored state stays the primary's).
    Not for a replica whose agent reports its engine unreachable: the primary answers zeros
    for it, pending entries included, and so must we. One no agent has reported (``unknown``:
    the shared index lost its data, and the agent has not rewritten it yet) is routed by our
    own decisions meanwhile, as when the shared index is down."""
    if b is None or b.pending_blocks <= a.pending_blocks or a.state is ReplicaState.UNAVAILABLE:
        return a
    return PrefixMatch(a.tier_blocks, a.stored_blocks, b.pending_blocks, a.state)
