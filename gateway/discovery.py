"""Replica discovery from agent registrations, restricted to the operator's allowlist.

Agents register their replica (URL, model, block size, capacity) with a TTL. A gateway
started with discovery adds every registration whose URL the operator declared (static
``--replica`` URLs and ``KVGATE_REPLICA_ALLOWLIST`` entries, ``[id=]URL``) and removes a
discovered replica when its registration expires. A rogue agent cannot point the gateway
at an undeclared URL: such registrations are rejected and counted.

A discovered replica whose registration is missing from a read is removed once the last
read that had it is ``removal_grace_s`` old: a Redis restart loses every registration until
the agents' next heartbeat (2 s), and a fleet of discovered replicas emptied at every
restart would answer 503 meanwhile. A read that fails (Redis down) says nothing of a
replica, so it counts as a read that had every replica the last successful read had: a
Redis outage longer than the grace, then a restart that lost the registrations, emptied the
whole pool at the first read after it (every client a 404 model_not_found until the
agents' next heartbeat). One already missing before the failure keeps its clock. While it
waits, the replica's health checks keep a dead engine out of routing as they always do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cachecore.registry import (
    InvalidURLError,
    Registration,
    RegistryStore,
    Rejection,
    ReplicaAllowlist,
    normalize_url,
)
from cachecore.tasks import cancel_and_wait
from gateway.replicas import ReplicaPool, ReplicaSpec

log = logging.getLogger(__name__)


class Discovery:
    def __init__(
        self,
        registry: RegistryStore,
        allowlist: ReplicaAllowlist,
        pool: ReplicaPool,
        static_ids: set[str],
        on_added: Callable[[ReplicaSpec], None] | None = None,
        interval_s: float = 2.0,
        on_count: Callable[[str, int], None] | None = None,
        removal_grace_s: float = 5.0,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.registry = registry
        self.allowlist = allowlist
        self.pool = pool
        self.static_ids = static_ids  # never removed by discovery
        self.on_added = on_added
        self.interval_s = interval_s
        self.discovered: dict[str, Registration] = {}
        self.rejected = 0  # every rejection of every refresh (the metric counts the same)
        # the rejections of the last refresh read: one persisting is logged once, not at
        # every refresh while its agent keeps re-registering
        self._rejections: set[Rejection] = set()
        self.errors = 0
        self.on_count = on_count  # (outcome, n): "rejected" registrations, read "error"s
        # a replica removed for good (after its grace): what is kept per replica id goes
        # with it, or autoscaled replicas with fresh ids grow it for the gateway's life
        self.on_removed = on_removed
        self._task: asyncio.Task[None] | None = None
        self.removal_grace_ms = int(removal_grace_s * 1000)
        self._last_seen: dict[str, int] = {}  # discovered id -> the last read that had it
        # discovered ids the last successful read lacked (in their grace): a failed read
        # since does not renew them
        self._missing: set[str] = set()
        # static id -> the other URL its registration was warned of: one entry per static
        # replica, gone when its registration is (a set of every URL grew with churn)
        self._static_elsewhere: dict[str, str] = {}

    async def refresh_once(self, now_ms: int | None = None) -> None:
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        try:
            regs = await self.registry.discover(now_ms)
        except Exception as exc:  # keep the replicas we have
            self.errors += 1
            if self.on_count is not None:
                self.on_count("error", 1)
            log.warning("replica discovery failed", extra={"error": repr(exc)})
            # no answer is no absence: the replicas the last read had count as seen now, so
            # an outage longer than the grace followed by a restarted (empty) Redis does not
            # remove them all before their agents' next heartbeat
            for rid in self.discovered:
                if rid not in self._missing:
                    self._last_seen[rid] = now_ms
            return
        accepted, rejected = self.allowlist.accept(regs)
        self.rejected += len(rejected)
        if rejected and self.on_count is not None:
            self.on_count("rejected", len(rejected))
        current = set(rejected)
        for rej in sorted(current - self._rejections, key=lambda r: (r.replica_id, r.url)):
            log.warning(
                "replica registration rejected (logged once while it persists; "
                "kvgate_discovery_events_total counts every refresh)",
                extra={"replica": rej.replica_id, "url": rej.url, "reason": rej.reason},
            )
        self._rejections = current
        seen = set()
        for reg in accepted:
            seen.add(reg.replica_id)
            rep = self.pool.get(reg.replica_id)
            if rep is None:
                spec = ReplicaSpec(reg.replica_id, reg.url.rstrip("/"))
                rep = self.pool.add(spec)
                log.info("replica discovered", extra={"replica": reg.replica_id, "url": reg.url})
                if self.on_added is not None:
                    self.on_added(spec)
                self.pool.report(reg.replica_id)  # back cordoned: its metric says so
            elif reg.replica_id not in self.static_ids and self._moved(rep.url, reg):
                # its engine answers elsewhere now (restarted on another host): the old URL
                # would be routed to and health-checked until the gateway restarted, since
                # the registration, kept alive by its agent, never expires. The new URL
                # passed the allowlist like any registration's (pins included)
                log.warning(
                    "replica URL changed: following its registration",
                    extra={"replica": reg.replica_id, "url": reg.url, "old_url": rep.url},
                )
                rep = self.pool.move(reg.replica_id, reg.url.rstrip("/"))
            elif not self._moved(rep.url, reg):
                self._static_elsewhere.pop(reg.replica_id, None)
            elif self._static_elsewhere.get(reg.replica_id) != reg.url:
                # a static replica keeps its declared URL; its agent says the engine is
                # elsewhere: the operator's to reconcile (once per URL, not every refresh)
                self._static_elsewhere[reg.replica_id] = reg.url
                log.warning(
                    "static replica registered at another URL: its declared URL is kept",
                    extra={"replica": reg.replica_id, "url": reg.url, "declared_url": rep.url},
                )
            rep.block_size = reg.block_size
            self.discovered[reg.replica_id] = reg
            self._last_seen[reg.replica_id] = now_ms
        for rid in [r for r in self.discovered if r not in seen]:
            if now_ms - self._last_seen.get(rid, now_ms) < self.removal_grace_ms:
                continue  # gone for less than the grace: a registry that lost it, maybe
            del self.discovered[rid]
            self._last_seen.pop(rid, None)
            self._static_elsewhere.pop(rid, None)
            if rid not in self.static_ids:
                self.pool.remove(rid)
                log.info("replica registration expired: removed", extra={"replica": rid})
                if self.on_removed is not None:
                    self.on_removed(rid)
        self._missing = set(self.discovered) - seen

    @staticmethod
    def _moved(current: str, reg: Registration) -> bool:
        """Whether ``reg`` names another URL than ``current`` (compared normalised: a
        registration that only spells its URL differently is no move)."""
        try:
            return normalize_url(current) != reg.normalized_url
        except InvalidURLError:
            return current.rstrip("/") != reg.url.rstrip("/")

    async def run(self) -> None:
        while True:
            await self.refresh_once()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
