"""Review R6: the index requires ``maxmemory-policy`` noeviction or volatile-*
(docs/index.md), but nothing read it, and what an ``allkeys-*`` policy does went unseen:
Redis evicts a replica's ``b:`` and ``m:`` hashes while its meta stays (the agent's check
reads it, keeping it recently used), and the check compared only the meta's epoch and
last_seq: the entries were gone and the agent said ``ok`` for ever. Now the agent (at start
and each check) and the gateway (at start-up) read the policy, from ``INFO memory`` (the
ACLs allow it) or ``CONFIG GET``, per primary on Cluster, and log an ERROR and set a gauge
under allkeys-*; and the agent's check compares the hashes' ``HLEN`` with its mirror and
rewrites what was lost. Real redis-servers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import ReplicaState
from cachecore.index.layout import KeyLayout, agent_acl_rules, gateway_acl_rules
from cachecore.index.redis import EntryCounts, RedisIndex, evicts_any_key
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from tests.test_agent_helpers import BS, Rig
from tests.test_gateway_support import stack
from tests.test_rogue_removal_floor import _as, _index_as, _user, admin  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
L = KeyLayout("kvgt")


def _evicting_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and "evicts any key" in r.getMessage()
    ]


@pytest.fixture
def lru_server() -> Any:
    with RedisServer(extra_args=["--maxmemory", "16mb", "--maxmemory-policy", "allkeys-lru"]) as s:
        yield s


async def test_an_evicting_redis_is_warned_of_and_its_losses_rewritten(
    caplog: pytest.LogCaptureFixture, lru_server: RedisServer
) -> None:
    """The reviewer's repro: allkeys-lru, another client filling memory until the replica's
    b: hash is evicted (was: index holds 0 of 400 blocks; agent status 'ok'; no warning).
    Now an ERROR and the gauge at start, and the next index check rewrites the entries."""
    caplog.set_level(logging.INFO)
    rig = Rig(
        RedisIndex.from_url(
            lru_server.url,
            L,
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    )
    try:
        agent = await rig.start()
        assert _evicting_errors(caplog), "no start-up ERROR about allkeys-lru"
        assert agent.metrics.index_evicting._value.get() == 1
        for i in range(20):
            ev, _ = rig.engine.store(list(range(i * 1000, i * 1000 + 20 * BS)))
            await rig.publish(ev)
        await rig.settle()
        assert await rig.index_keys() == rig.engine.keys() and len(rig.engine.keys()) == 400
        other = aioredis.Redis.from_url(lru_server.url)
        try:
            (bkey,) = [k async for k in other.scan_iter(match="kvgt:{r:r0}:b:*")]
            gone = False
            for i in range(4000):  # bounded: until Redis evicted the replica's entries
                await other.set(f"app:{i}", b"x" * 100_000)
                if i % 20 == 0:
                    await asyncio.sleep(0.05)  # the agent's checks keep running meanwhile
                    if not await other.exists(bkey):
                        gone = True
                        break
            assert gone, "Redis never evicted the replica's entries"
            await other.delete(*[k async for k in other.scan_iter(match="app:*")])
        finally:
            await other.aclose()
        held: set[bytes] = set()
        for _ in range(100):  # index_check_interval_s 0.2: a few checks
            held = await rig.index_keys()
            if held == rig.engine.keys():
                break
            await asyncio.sleep(0.05)
        assert held == rig.engine.keys(), f"index holds {len(held)} of 400 blocks"
        causes = {
            cause: agent.metrics.resyncs.labels("r0", cause)._value.get()
            for cause in ("index_entries_lost", "index_lost", "index_diverged")
        }
        # the meta, read every check, usually stays (the reviewer's runs): the counts find
        # the loss; when Redis evicted it too the meta check does
        print("resyncs by cause:", causes)
        assert causes["index_entries_lost"] + causes["index_lost"] >= 1, causes
    finally:
        await rig.close()


@pytest.mark.parametrize("lost", ["blocks", "some blocks", "mirror records"])
async def test_entries_lost_under_a_kept_meta_are_rewritten(
    redis_url: str, lost: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What an allkeys-* eviction leaves, made by hand: the meta kept (epoch and last_seq
    right), the b: hash or part of it, or mirror records, gone. The meta-only check saw
    nothing; the counts do, and the next check rewrites the replica from the mirror."""
    caplog.set_level(logging.ERROR)
    rig = Rig(
        RedisIndex.from_url(
            redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
        )
    )
    raw = aioredis.Redis.from_url(redis_url)
    try:
        agent = await rig.start()
        for i in range(5):
            ev, _ = rig.engine.store(list(range(i * 1000, i * 1000 + 8 * BS)))
            await rig.publish(ev)
        await rig.settle()
        assert len(rig.engine.keys()) == 40 and await rig.index_keys() == rig.engine.keys()
        epoch = (await rig.index.meta("r0")).epoch
        bkey, mkey = L.blocks("r0", epoch), L.mirror("r0", epoch)
        if lost == "blocks":
            await raw.delete(bkey)
        elif lost == "some blocks":
            await raw.hdel(bkey, *list(await raw.hkeys(bkey))[:3])
        else:
            await raw.hdel(mkey, *list(await raw.hkeys(mkey))[:3])
        rewritten = agent.metrics.resyncs.labels("r0", "index_entries_lost")
        for _ in range(100):  # index_check_interval_s 0.2
            if rewritten._value.get():
                break
            await asyncio.sleep(0.05)
        assert rewritten._value.get() == 1
        await rig.settle()
        assert await rig.index_keys() == rig.engine.keys()
        assert await raw.hlen(L.mirror("r0", (await rig.index.meta("r0")).epoch)) == 40
        assert any("lost entries" in r.getMessage() for r in caplog.records)
        await asyncio.sleep(0.5)  # and then it agrees: no rewrite per check
        assert rewritten._value.get() == 1
    finally:
        await raw.aclose()
        await rig.close()


async def test_the_policy_is_read_and_judged(redis_url: str) -> None:
    """noeviction and volatile-* keep the index's keys (no TTL); allkeys-* do not. Read
    from INFO memory; where INFO lacks it, CONFIG GET (as an admin may)."""
    index = _index_as(redis_url)
    admin_client = aioredis.Redis.from_url(redis_url)
    try:
        for policy, bad in [
            ("noeviction", False),
            ("volatile-lru", False),
            ("volatile-ttl", False),
            ("allkeys-lru", True),
            ("allkeys-random", True),
            ("allkeys-lfu", True),
        ]:
            await admin_client.config_set("maxmemory-policy", policy)
            assert await index.eviction_policies() == {"": policy}
            assert evicts_any_key(policy) is bad
        await admin_client.config_set("maxmemory-policy", "allkeys-lru")

        async def no_policy(*args: Any, **kw: Any) -> dict[str, Any]:
            return {"used_memory": 1}  # a managed Redis that hides the field

        real_info = index.client.info
        index.client.info = no_policy  # type: ignore[method-assign]
        try:
            assert await index.eviction_policies() == {"": "allkeys-lru"}  # CONFIG GET
        finally:
            index.client.info = real_info  # type: ignore[method-assign]
    finally:
        await admin_client.config_set("maxmemory-policy", "noeviction")
        await admin_client.aclose()
        await index.close()
    assert not evicts_any_key(None)


async def test_kvgates_acl_users_read_the_policy_and_the_counts(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    """The agent's and gateway's ACL rules allow what the check sends: INFO (the policy)
    and the counts script on the agent's own keys; CONFIG GET stays refused (it reads
    passwords too), so an ACL user whose INFO lacks the policy reads it as unknown."""
    await _user(admin, "agent-ev", agent_acl_rules("ev"))
    await _user(admin, "gw-ev", gateway_acl_rules())
    agent = _index_as(redis_url, "agent-ev")
    gateway = _index_as(redis_url, "gw-ev")
    try:
        await admin.config_set("maxmemory-policy", "allkeys-lru")
        assert await agent.eviction_policies() == {"": "allkeys-lru"}
        assert await gateway.eviction_policies() == {"": "allkeys-lru"}
        epoch = await agent.clear_replica("ev", ReplicaState.LIVE, 1_000)
        keys = [bytes([i]) * 16 for i in range(1, 6)]
        await agent.apply(
            "ev", epoch, IndexWrite({k: int(Tier.GPU) for k in keys}, {7: b"r" * 20}), 1_001
        )
        assert await agent.entry_counts("ev") == EntryCounts(epoch, 5, 1)
        await admin.delete(KeyLayout().blocks("ev", epoch))  # what an eviction does
        assert await agent.entry_counts("ev") == EntryCounts(epoch, 0, 1)

        async def no_policy(*args: Any, **kw: Any) -> dict[str, Any]:
            return {}

        agent.client.info = no_policy  # type: ignore[method-assign]
        assert await agent.eviction_policies() == {"": None}  # CONFIG GET: NOPERM
    finally:
        await admin.config_set("maxmemory-policy", "noeviction")
        await agent.close()
        await gateway.close()


async def test_the_gateway_warns_at_start_up(
    caplog: pytest.LogCaptureFixture, lru_server: RedisServer
) -> None:
    caplog.set_level(logging.WARNING)
    async with stack(count=1, redis_url=lru_server.url) as st:
        assert _evicting_errors(caplog), "no start-up ERROR about allkeys-lru"
        assert st.gw.metrics.index_evicting._value.get() == 1


async def test_a_noeviction_redis_warns_of_nothing(
    caplog: pytest.LogCaptureFixture, redis_url: str
) -> None:
    caplog.set_level(logging.WARNING)
    async with stack(count=1, redis_url=redis_url) as st:
        assert st.gw.metrics.index_evicting._value.get() == 0
    rig = Rig(
        RedisIndex.from_url(
            redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
        )
    )
    try:
        agent = await rig.start()
        for i in range(3):
            ev, _ = rig.engine.store(list(range(i * 1000, i * 1000 + 4 * BS)))
            await rig.publish(ev)
        await rig.settle()
        await asyncio.sleep(0.5)  # a few index checks: the counts agree, no rewrite
        assert agent.metrics.index_evicting._value.get() == 0
        assert agent.metrics.resyncs.labels("r0", "index_entries_lost")._value.get() == 0
    finally:
        await rig.close()
    assert not _evicting_errors(caplog)


@pytest.fixture
async def cluster_index(cluster_url: str) -> AsyncIterator[RedisIndex]:
    idx = RedisIndex.from_url(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    yield idx
    await idx.close()


async def test_every_cluster_primary_is_read(cluster_index: RedisIndex, redis_cluster: Any) -> None:
    """On Cluster the policy is per node: each primary's is read, one allkeys-* is enough."""
    first = aioredis.Redis.from_url(redis_cluster.urls[0])
    try:
        got = await cluster_index.eviction_policies()
        assert len(got) == 3 and set(got.values()) == {"noeviction"}, got
        await first.config_set("maxmemory-policy", "allkeys-lfu")
        got = await cluster_index.eviction_policies()
        assert sorted(got.values(), key=str) == ["allkeys-lfu", "noeviction", "noeviction"], got
    finally:
        await first.config_set("maxmemory-policy", "noeviction")
        await first.aclose()
