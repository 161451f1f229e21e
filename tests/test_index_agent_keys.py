"""What an agent writes into its own keys cannot break reads of other replicas (W1, W2).

An agent's ACL lets it DEL and SET its own keys (meta, b:, m:, rm:, load), so it can turn
its block hash into a string. The gateway's lookup reads every replica in one script
call: a WRONGTYPE there failed the call for every replica, and every gateway routed from
its local index with every claim check skipped. The load snapshot, one call for every
replica too, failed alike on a wrong-typed load record or an ``expires_ms`` that is no
number; discovery, one pipeline of GETs, on a registration made a hash. Real
redis-server, real ACL users (the agent's and the gateway's)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import RemovalFloor, ReplicaMeta, ReplicaState
from cachecore.index.layout import agent_acl_rules, gateway_acl_rules
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.loadstate import EngineLoad, RedisLoadStore
from cachecore.registry import RedisRegistry
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway.quarantine import LogAnswer, judge_floor
from tests.test_gateway_support import stack
from tests.test_registry import reg
from tests.test_rogue_removal_floor import LAYOUT, _as, _index_as, _user, admin  # noqa: F401

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
G = int(Tier.GPU)
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


async def test_a_wrong_typed_key_costs_its_own_replica_only(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    await _user(admin, "agent-wt", agent_acl_rules("rogue"))
    await _user(admin, "gw-wt", gateway_acl_rules())
    honest = _index_as(redis_url)
    gateway = _index_as(redis_url, "gw-wt")
    raw = aioredis.Redis.from_url(_as(redis_url, "agent-wt"))
    seen: list[str] = []
    gateway.on_unreadable = seen.append
    try:
        good = await honest.clear_replica("good", ReplicaState.LIVE, 1)
        await honest.apply("good", good, IndexWrite(dict.fromkeys(KEYS, G)), 2)
        rogue = await honest.clear_replica("rogue", ReplicaState.LIVE, 1)
        await honest.apply("rogue", rogue, IndexWrite(dict.fromkeys(KEYS, G)), 2)
        before = await gateway.lookup(KEYS, ["good", "rogue"], 3)
        assert before["good"].stored_blocks == before["rogue"].stored_blocks == 4
        assert seen == []
        # the rogue, as its own ACL user: its block hash becomes a string
        await raw.delete(LAYOUT.blocks("rogue", rogue))
        await raw.set(LAYOUT.blocks("rogue", rogue), "x")
        got = await gateway.lookup(KEYS, ["good", "rogue"], 3)
        assert got["good"].stored_blocks == 4  # was: WRONGTYPE for both
        assert got["rogue"].stored_blocks == 0 and got["rogue"].state is ReplicaState.LIVE
        assert seen == ["rogue"]
        # its meta too: unknown state, nothing held, the other replica's match stands
        await raw.delete(LAYOUT.meta("rogue"))
        await raw.set(LAYOUT.meta("rogue"), "x")
        got = await gateway.lookup(KEYS, ["rogue", "good"], 3)
        assert got["good"].stored_blocks == 4
        assert got["rogue"].state is ReplicaState.UNKNOWN and got["rogue"].stored_blocks == 0
        assert seen == ["rogue", "rogue"]
        # the claim check's reads judge it (a meta no agent writes: tampered), not skip it
        assert await gateway.removed_since("rogue", KEYS[:1], 1) is None
        assert judge_floor(await gateway.removal_floor("rogue"), 3, 0) is LogAnswer.TAMPERED
    finally:
        await raw.aclose()
        await honest.close()
        await gateway.close()


async def test_meta_reads_a_field_that_is_no_number_as_absent(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    """W2: meta() raised ValueError on such a field (the quarantine watcher and the agents
    read it); it reads as absent now, as removal_floor reads a non-integer as none, and
    names it (the replica's own agent still rebuilds: test_agent_redis's corrupt meta)."""
    await _user(admin, "agent-wt", agent_acl_rules("odd"))
    await _user(admin, "gw-wt", gateway_acl_rules())
    gateway = _index_as(redis_url, "gw-wt")
    raw = aioredis.Redis.from_url(_as(redis_url, "agent-wt"))
    try:
        await raw.hset(
            LAYOUT.meta("odd"),
            mapping={
                "epoch": "1.5",
                "state": "live",
                "last_seq": "x",
                "engine_start": "nan",
                "updated_ms": "soon",
                "rm_floor": "abc",
            },
        )
        assert await gateway.meta("odd") == ReplicaMeta(
            state=ReplicaState.LIVE,
            unreadable=("epoch", "last_seq", "updated_ms", "engine_start"),
        )
        assert await gateway.removal_floor("odd") == RemovalFloor(None, None)
        await raw.hset(LAYOUT.meta("odd"), mapping={"engine_start": "12.5", "epoch": "7"})
        got = await gateway.meta("odd")
        assert got.engine_start == 12.5 and got.epoch == 7 and got.last_seq == -1
        assert got.unreadable == ("last_seq", "updated_ms")
    finally:
        await raw.aclose()
        await gateway.close()


async def test_a_broken_load_record_costs_its_own_replica_only(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    """The shared load snapshot, one script call for every replica, read as the gateway."""
    await _user(admin, "agent-wt", agent_acl_rules("rogue"))
    await _user(admin, "gw-wt", gateway_acl_rules())
    agents = RedisLoadStore.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    gateway = RedisLoadStore.from_url(
        _as(redis_url, "gw-wt"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    raw = aioredis.Redis.from_url(_as(redis_url, "agent-wt"))
    try:
        for rid in ("good", "rogue"):
            await agents.publish_engine(rid, EngineLoad(3, 1, 0.5, 10), 60_000, 10)
        snap = await gateway.snapshot(["good", "rogue"], 20)
        assert snap["good"].num_running == snap["rogue"].num_running == 3
        load = LAYOUT.load("rogue")
        broken_records: list[dict[str | bytes, str | bytes]] = [
            {"expires_ms": "never"},
            {"expires_ms": "99999999", "kv_usage": "0x1"},
            {"expires_ms": "99999999", "kv_usage": "nan"},
        ]
        for broken in broken_records:
            await raw.hset(load, mapping=broken)  # type: ignore[arg-type]
            snap = await gateway.snapshot(["good", "rogue"], 20)
            assert snap["good"].num_running == 3 and snap["good"].kv_usage == 0.5, broken
            assert 0.0 <= snap["rogue"].kv_usage <= 1.0, broken
        await raw.delete(load)
        await raw.set(load, "x")
        snap = await gateway.snapshot(["good", "rogue"], 20)
        assert snap["good"].num_running == 3
        assert snap["rogue"].num_running == 0
    finally:
        await raw.aclose()
        await agents.close()
        await gateway.close()


async def test_the_gateway_counts_a_replica_it_could_not_read(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    """kvgate_index_unreadable{replica}: the operator sees which agent broke its keys, while
    the gateway keeps routing from the shared index (no fallback)."""
    await _user(admin, "gw-wt", gateway_acl_rules())
    gw_index = _index_as(redis_url, "gw-wt")
    honest = _index_as(redis_url)
    async with stack(count=2, build={"index": gw_index}) as st:
        rogue, good = st.replica_id(0), st.replica_id(1)
        try:
            epoch = await honest.clear_replica(rogue, ReplicaState.LIVE, 1)
            await honest.clear_replica(good, ReplicaState.LIVE, 1)
            await admin.set(LAYOUT.blocks(rogue, epoch), "x")
            assert st.gw.index is not None
            res = await st.gw.index.lookup(KEYS, [rogue, good], 3, 1.0)
            assert res.source == "primary"
            assert st.gw.metrics.index_unreadable.labels(rogue)._value.get() == 1
            assert st.gw.metrics.index_unreadable.labels(good)._value.get() == 0
        finally:
            await honest.close()


async def test_a_wrong_typed_registration_costs_its_own_replica_only(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    """Discovery GETs every replica's registration in one pipeline: one agent's reg key
    made a hash (its ACL allows DEL and HSET there) failed it for every replica."""
    await _user(admin, "agent-wt", agent_acl_rules("rogue"))
    await _user(admin, "gw-wt", gateway_acl_rules())
    agents = RedisRegistry.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    gateway = RedisRegistry.from_url(
        _as(redis_url, "gw-wt"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    raw = aioredis.Redis.from_url(_as(redis_url, "agent-wt"))
    try:
        good, rogue = reg("good"), reg("rogue", "http://10.0.0.2:8000")
        await agents.register(good, 60_000, 0)
        await agents.register(rogue, 60_000, 0)
        assert await gateway.discover(5) == [good, rogue]
        await raw.delete(LAYOUT.registration("rogue"))
        await raw.hset(LAYOUT.registration("rogue"), "x", "1")
        assert await gateway.discover(5) == [good]  # was: WRONGTYPE for both
        assert await gateway.discover(5, ["rogue", "good"]) == [good]
        assert gateway.malformed == 2  # counted by each discovery
    finally:
        await raw.aclose()
        await agents.close()
        await gateway.close()
