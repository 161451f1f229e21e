"""Key layout, replica ids, cluster slot grouping, and real Redis ACLs for agents/gateways."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot
from redis.exceptions import NoPermissionError, ResponseError

from cachecore.index.base import IndexError_, ReplicaState
from cachecore.index.layout import (
    CLUSTER_SLOTS,
    InvalidReplicaIdError,
    KeyLayout,
    acl_setuser_args,
    agent_acl_rules,
    dp_replica_id,
    engine_hash_field,
    engine_hash_from_field,
    gateway_acl_rules,
    group_by_shard,
    validate_replica_id,
)
from cachecore.index.redis import RedisIndex
from cachecore.lifecycle import IndexWrite
from cachecore.loadstate import EngineLoad, RedisLoadStore
from cachecore.registry import RedisRegistry, Registration
from cachecore.testing import PATIENT_TIMEOUT_S

pytestmark = pytest.mark.redis
L = KeyLayout()


@pytest.mark.parametrize("rid", ["a", "engine-1", "gpu0.node3", "m@dp7", "A_b-c.d@e", "x" * 64])
def test_valid_replica_ids(rid: str) -> None:
    assert validate_replica_id(rid) == rid


@pytest.mark.parametrize(
    "rid", ["", "x" * 65, "a:b", "a}b", "a{b", "a*", "a?", "a[1]", "a b", "a\\b", "é", "a\n"]
)
def test_invalid_replica_ids(rid: str) -> None:
    with pytest.raises(InvalidReplicaIdError):
        validate_replica_id(rid)
    with pytest.raises(InvalidReplicaIdError):
        L.meta(rid)


def test_dp_replica_id() -> None:
    assert dp_replica_id("eng", None) == "eng"
    assert dp_replica_id("eng", 3) == "eng@dp3"


def test_key_names_share_one_tag_and_parse_back() -> None:
    rid = "eng@dp1"
    names = {
        L.meta(rid): ("meta", None),
        L.blocks(rid, 7): ("b", 7),
        L.mirror(rid, 7): ("m", 7),
        L.removals(rid, 7): ("rm", 7),
        L.registration(rid): ("reg", None),
        L.load(rid): ("load", None),
        L.pending(rid, 7): ("gw:p", 7),
        L.inflight(rid): ("gw:inflight", None),
    }
    for name, (kind, epoch) in names.items():
        assert name.startswith("kvg:{r:eng@dp1}:")
        assert L.parse(name) == (rid, kind, epoch)
        assert key_slot(name.encode()) == L.slot(rid)  # one slot per replica
    assert L.parse("other:{r:a}:meta") is None
    assert L.parse("kvg:{r:a}:b:notanint") is None
    assert L.parse("kvg:{r:a}:unknown") is None
    assert KeyLayout("test1").meta("a") == "test1:{r:a}:meta"
    with pytest.raises(ValueError):
        KeyLayout("bad prefix")


def test_slot_is_crc16_of_the_tag() -> None:
    # Redis Cluster spec reference values: CRC16("123456789") = 0x31C3; "foo" -> 12182
    assert key_slot(b"123456789") == 0x31C3 % CLUSTER_SLOTS
    assert key_slot(b"foo") == 12182
    assert L.slot("a") == key_slot(b"r:a")
    assert key_slot(b"kvg:{r:a}:b:9") == key_slot(b"r:a")


def test_group_by_shard_three_shards() -> None:
    # the slot ranges redis-cli --cluster create assigns to three primaries
    ranges = [(0, 5460, "n1:7000"), (5461, 10922, "n2:7001"), (10923, 16383, "n3:7002")]

    def owner(slot: int) -> str:
        for lo, hi, name in ranges:
            if lo <= slot <= hi:
                return name
        raise AssertionError(slot)

    replicas = [f"r{i}" for i in range(64)]
    groups = group_by_shard(replicas, L, owner)
    assert sorted(r for g in groups.values() for r in g) == sorted(replicas)
    assert set(groups) <= {"n1:7000", "n2:7001", "n3:7002"} and len(groups) == 3
    for name, members in groups.items():
        assert all(owner(L.slot(r)) == name for r in members)
        assert members == [r for r in replicas if r in members]  # request order kept
    assert group_by_shard(replicas, L, lambda s: "only") == {"only": replicas}


@given(st.integers(-(2**100), 2**100))
def test_engine_hash_field_roundtrip(h: int) -> None:
    raw = engine_hash_field(h)
    assert engine_hash_from_field(raw) == h
    if 0 <= h < 2**64:
        assert len(raw) == 8 and raw == h.to_bytes(8, "big")


def test_engine_hash_field_limits() -> None:
    with pytest.raises(ValueError):
        engine_hash_field(2**200)
    with pytest.raises(ValueError):
        engine_hash_from_field(b"abc")


# ------------------------------------------------------------------ real Redis ACL users


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    for user in ("agent-a", "agent-b", "gw"):
        await _command(client, "ACL", "DELUSER", user)
    await client.aclose()


async def _command(client: aioredis.Redis, *args: str) -> object:
    return await client.execute_command(*args)  # type: ignore[no-untyped-call]


def _user_url(redis_url: str, user: str, password: str) -> str:
    return redis_url.replace("redis://", f"redis://{user}:{password}@")


async def test_agent_acl_own_replica_only(admin: aioredis.Redis, redis_url: str) -> None:
    await _command(admin, *acl_setuser_args("agent-a", "pw-agent-a-1", agent_acl_rules("a")))
    await _command(admin, *acl_setuser_args("gw", "pw-gateway-1", gateway_acl_rules()))
    agent = RedisIndex.from_url(
        _user_url(redis_url, "agent-a", "pw-agent-a-1"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    gateway = RedisIndex.from_url(
        _user_url(redis_url, "gw", "pw-gateway-1"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    raw_agent = aioredis.Redis.from_url(_user_url(redis_url, "agent-a", "pw-agent-a-1"))
    key = b"k" * 16
    try:
        # its own replica: the whole agent API works
        epoch = await agent.clear_replica("a", ReplicaState.LIVE, 1)
        await agent.apply("a", epoch, IndexWrite({key: 1}, {7: b"x" * 20}, 3), 2)
        assert await agent.replica_blocks("a") == {key: 1}
        assert await agent.load_mirror("a") == {7: b"x" * 20}
        assert (await agent.meta("a")).last_seq == 3
        await agent.set_state("a", ReplicaState.UNAVAILABLE, 3)
        await agent.set_state("a", ReplicaState.LIVE, 4)
        assert len(await agent.instance_id()) > 0
        reg = RedisRegistry(raw_agent)
        await reg.register(_registration("a"), 10_000, 0)
        await RedisLoadStore(raw_agent).publish_engine("a", EngineLoad(1, 2, 0.5, 9), 5000, 9)

        # another replica: denied, through the index API and through raw commands and EVAL
        with pytest.raises(IndexError_, match=r"NOPERM|permission"):
            await agent.apply("b", 0, IndexWrite({key: 1}), 2)
        with pytest.raises(IndexError_, match=r"NOPERM|permission"):
            await agent.clear_replica("b", ReplicaState.LIVE, 1)
        with pytest.raises(IndexError_):
            await agent.lookup([key], ["b"], 5)
        with pytest.raises(NoPermissionError):
            await raw_agent.hset("kvg:{r:b}:b:0", key, 1)
        with pytest.raises(NoPermissionError):
            await raw_agent.set("kvg:{r:b}:reg", b"{}")
        with pytest.raises(ResponseError, match=r"NOPERM|permission"):
            await raw_agent.eval(
                "return redis.call('HSET', KEYS[1], 'x', '1')", 1, "kvg:{r:b}:meta"
            )
        # gateway-owned keys of its own replica: denied too (no pending/in-flight forgery)
        with pytest.raises(IndexError_):
            await agent.add_pending("a", [key], 1000, 5)
        with pytest.raises(NoPermissionError):
            await raw_agent.zadd("kvg:{r:a}:gw:p:1", {key: 10**12})
        with pytest.raises(NoPermissionError):
            await raw_agent.hincrby("kvg:{r:a}:gw:inflight", "x:r", 5)
        # no admin commands
        with pytest.raises(NoPermissionError):
            await raw_agent.flushall()

        # the gateway reads everything and writes only gw:* keys
        await gateway.add_pending("a", [key + b"", b"p" * 16], 1000, 5)
        m = (await gateway.lookup([key, b"p" * 16], ["a", "b"], 6))["a"]
        assert (m.stored_blocks, m.pending_blocks) == (1, 2)
        with pytest.raises(IndexError_):
            await gateway.apply("a", epoch, IndexWrite({key: 3}), 7)
        with pytest.raises(IndexError_):
            await gateway.clear_replica("a", ReplicaState.COLD, 7)
        assert await agent.replica_blocks("a") == {key: 1}
        # removals: the agent logs them (rm:<epoch>, trimmed), the gateway reads the log
        small = RedisIndex.from_url(
            _user_url(redis_url, "agent-a", "pw-agent-a-1"),
            removal_log=1,
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
        try:
            other = b"o" * 16
            await small.apply("a", epoch, IndexWrite({other: 1}), 8)
            await small.apply("a", epoch, IndexWrite({key: 0}), 9)
            await small.apply("a", epoch, IndexWrite({other: 0}), 10)  # trims key's removal
        finally:
            await small.close()
        assert await gateway.removed_since("a", [key, other], 10) == [False, True]
        assert await gateway.removed_since("a", [key, other], 9) is None
        with pytest.raises(NoPermissionError):
            await raw_agent.zadd("kvg:{r:b}:rm:0", {key: 1})
    finally:
        await agent.close()
        await gateway.close()
        await raw_agent.aclose()


def _registration(rid: str) -> Registration:
    return Registration(
        replica_id=rid,
        url="http://127.0.0.1:9000",
        model="m",
        block_size=16,
        capacity_blocks=100,
        dp_rank=None,
        agent_id="agent-" + rid,
        registered_ms=0,
    )
