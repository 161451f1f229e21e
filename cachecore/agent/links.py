"""The agent's two outward links besides the index: the engine load record (read by every
gateway for queue-aware routing) and the replica registration (gateways discover replicas
through it and accept only operator-declared URLs, see :mod:`cachecore.registry`)."""

from __future__ import annotations

import logging
import os
import time
import uuid

from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.scrape import EngineSnapshot
from cachecore.agent.settings import AgentSettings
from cachecore.loadstate import EngineLoad, LoadStore
from cachecore.registry import Registration, RegistryStore

log = logging.getLogger(__name__)


def _now_ms() -> int:
    return int(time.time() * 1000)


def new_agent_id() -> str:
    """Unique per agent process (the registry deregisters only its own registration, so a
    restarted agent never removes its successor's)."""
    return f"agent-{os.getpid()}-{uuid.uuid4().hex[:12]}"


class LoadLink:
    def __init__(self, store: LoadStore, settings: AgentSettings) -> None:
        self.store = store
        self.ttl_ms = int(settings.load_ttl_s * 1000)
        self._failing = False

    async def publish(
        self, replica: str, snap: EngineSnapshot, metrics: AgentMetrics, stalled_s: float = 0.0
    ) -> None:
        """``stalled_s``: how long the engine has been busy without progress
        (:class:`~cachecore.agent.progress.ProgressTracker`), published as its start."""
        now = _now_ms()
        stalled_ms = min(now, int(stalled_s * 1000)) if stalled_s > 0 else 0
        load = EngineLoad(
            num_running=max(0, int(snap.running)),
            num_waiting=max(0, int(snap.waiting)),
            kv_usage=min(1.0, max(0.0, snap.kv_usage)),
            metrics_ts_ms=now,
            stalled_since_ms=now - stalled_ms if stalled_ms > 0 else 0,
        )
        try:
            await self.store.publish_engine(replica, load, self.ttl_ms, now)
        except Exception as exc:
            metrics.load_publishes.labels("error").inc()
            if not self._failing:
                log.warning(
                    "load record not published", extra={"replica": replica, "error": repr(exc)}
                )
            self._failing = True
            return
        self._failing = False
        metrics.load_publishes.labels("ok").inc()


class RegistryLink:
    def __init__(self, store: RegistryStore, settings: AgentSettings) -> None:
        self.store = store
        self.settings = settings
        self.agent_id = new_agent_id()
        self.ttl_ms = int(settings.registration_ttl_s * 1000)
        self._failing = False
        # another agent's registration found for our replica id (monotonic time; 0: never)
        self.conflict_at = 0.0
        self._registered = False  # ours written at least once (then a rival's is news)

    async def heartbeat(
        self,
        replica: str,
        *,
        model: str,
        block_size: int,
        capacity_blocks: int | None,
        metrics: AgentMetrics,
    ) -> None:
        now = _now_ms()
        try:
            await self._check_conflict(replica, now, metrics)
            reg = Registration(
                replica_id=replica,
                url=self.settings.engine_url,
                model=model,
                block_size=block_size,
                capacity_blocks=capacity_blocks or 0,
                dp_rank=self.settings.data_parallel_rank,
                agent_id=self.agent_id,
                registered_ms=now,
            )
            await self.store.register(reg, self.ttl_ms, now)
            self._registered = True
        except Exception as exc:
            metrics.heartbeats.labels("error").inc()
            if not self._failing:
                log.warning(
                    "registration heartbeat failed", extra={"replica": replica, "error": repr(exc)}
                )
            self._failing = True
            return
        self._failing = False
        metrics.heartbeats.labels("ok").inc()

    async def _check_conflict(self, replica: str, now: int, metrics: AgentMetrics) -> None:
        """Two agents for one replica id (an operator's slip: the same ``--replica-id`` on
        two engines) would take turns rewriting the index from two different engines'
        mirrors. Each heartbeat after our first registration reads the one it is about to
        renew: another agent's there (written since our last heartbeat) is logged as an
        error, counted and shown in /health."""
        if not self._registered:
            return  # a restarted agent finds its predecessor's registration: not a rival
        for reg in await self.store.discover(now, [replica]):
            if reg.agent_id != self.agent_id:
                metrics.conflicts.inc()
                if time.monotonic() - self.conflict_at > 60.0:
                    log.error(
                        "another agent registered this replica id: two agents are writing "
                        "one replica's index entries; give each engine its own --replica-id",
                        extra={"replica": replica, "other_agent": reg.agent_id,
                               "other_url": reg.url, "our_url": self.settings.engine_url},
                    )  # fmt: skip
                self.conflict_at = time.monotonic()

    def in_conflict(self, window_s: float) -> bool:
        return self.conflict_at > 0 and time.monotonic() - self.conflict_at < window_s

    @property
    def registered(self) -> bool:
        """Whether this agent wrote its registration at least once."""
        return self._registered

    async def deregister(self, replica: str) -> bool:
        """Remove our registration (a successor's is left alone); whether one was removed.
        The store's failure is raised: the stop logs it with its outcome."""
        return await self.store.deregister(replica, self.agent_id)

    async def hand_over(self, replica: str, window_s: float) -> bool:
        """Keep our registration ``window_s`` from now for the replica's next agent (a
        successor's is left alone); whether ours was there to keep. The store's failure is
        raised (the stop logs it): it leaves the registration to its heartbeat TTL, which
        bounds it too."""
        return await self.store.hand_over(
            replica, self.agent_id, max(1, int(window_s * 1000)), _now_ms()
        )
