"""H29 recovery: a Redis outage longer than discovery's removal grace, then a restart that
lost every registration (no persistence). Found with the production shape on one host (two
``kvgate replica`` engines, one ``kvgate agent`` each, ``kvgate serve --redis --discover``):
Redis stopped for 15 s and started empty; at the gateway's first registry read after the
restart both discovered replicas were removed ("replica registration expired: removed"),
and every request answered 404 model_not_found until the agents' next heartbeat (about
2 s), although the runbook says discovered replicas stay in service while their
registrations are missing after a Redis restart. The grace was counted from the last read
that had a registration, and the outage's failed reads had none."""

from __future__ import annotations

import httpx
import pytest

from cachecore.registry import RedisRegistry, Registration, ReplicaAllowlist
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from gateway.discovery import Discovery
from gateway.replicas import ReplicaPool
from policies.schema import HealthPolicy

REGS = (("a", "http://10.0.0.2:8000"), ("b", "http://10.0.0.3:8000"))


def _reg(rid: str, url: str) -> Registration:
    return Registration(
        replica_id=rid, url=url, model="m", block_size=16, capacity_blocks=100,
        agent_id=f"agent-{rid}", registered_ms=0,
    )  # fmt: skip


@pytest.mark.redis
async def test_an_outage_longer_than_the_grace_then_an_empty_redis_empties_no_pool(
    redis_own: RedisServer,
) -> None:
    registry = RedisRegistry.from_url(
        redis_own.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    try:
        async with httpx.AsyncClient() as client:
            changes: list[tuple[str, bool]] = []
            pool = ReplicaPool(
                client, HealthPolicy(), on_change=lambda r, ok: changes.append((r, ok))
            )
            removed: list[str] = []
            disc = Discovery(
                registry,
                ReplicaAllowlist([url for _, url in REGS]),
                pool,
                set(),
                removal_grace_s=5.0,
                on_removed=removed.append,
            )
            for rid, url in REGS:
                await registry.register(_reg(rid, url), 60_000, now_ms=0)
            await disc.refresh_once(now_ms=1_000)
            assert sorted(r.id for r in pool.candidates("m")) == ["a", "b"]
            before = list(changes)

            redis_own.stop()  # 16 s down: every read fails
            for now in range(3_000, 19_000, 2_000):
                await disc.refresh_once(now_ms=now)
            assert disc.errors == 8
            assert sorted(r.id for r in pool.candidates("m")) == ["a", "b"]

            redis_own.start()  # back, empty: no registration until the agents' heartbeats
            await disc.refresh_once(now_ms=19_500)
            assert sorted(r.id for r in pool.candidates("m")) == ["a", "b"]
            assert removed == []
            for rid, url in REGS:  # the heartbeats re-register
                await registry.register(_reg(rid, url), 60_000, now_ms=20_000)
            await disc.refresh_once(now_ms=21_500)
            assert sorted(r.id for r in pool.candidates("m")) == ["a", "b"]
            assert changes == before  # never out of service
            assert removed == []
    finally:
        await registry.close()


@pytest.mark.redis
async def test_a_replica_gone_before_the_outage_is_still_removed_on_time(
    redis_own: RedisServer,
) -> None:
    """Failed reads renew only what the last successful read had: a replica whose agent
    left before the outage keeps its clock, so a Redis that fails every other read cannot
    keep a departed replica for ever."""
    registry = RedisRegistry.from_url(
        redis_own.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    try:
        async with httpx.AsyncClient() as client:
            pool = ReplicaPool(client, HealthPolicy())
            disc = Discovery(
                registry,
                ReplicaAllowlist([url for _, url in REGS]),
                pool,
                set(),
                removal_grace_s=5.0,
            )
            for rid, url in REGS:
                await registry.register(_reg(rid, url), 60_000, now_ms=0)
            await disc.refresh_once(now_ms=1_000)
            assert await registry.deregister("b", "agent-b")  # b's agent stops for good
            await disc.refresh_once(now_ms=3_000)  # b missing, last seen at 1,000
            assert sorted(pool.ids()) == ["a", "b"]
            redis_own.stop()
            await disc.refresh_once(now_ms=5_000)  # fails
            redis_own.start()  # empty
            await registry.register(_reg("a", REGS[0][1]), 60_000, now_ms=5_500)
            await disc.refresh_once(now_ms=6_500)  # b: 5.5 s since the last read that had it
            assert pool.ids() == ["a"]
    finally:
        await registry.close()
