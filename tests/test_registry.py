"""Replica registration: heartbeat TTL, deregistration, discovery, and the URL allowlist
that keeps a rogue agent from pointing gateways at an attacker's URL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from cachecore.index.layout import KeyLayout, acl_setuser_args, agent_acl_rules
from cachecore.registry import (
    InvalidURLError,
    MemoryRegistry,
    RedisRegistry,
    Registration,
    RegistryError,
    RegistryStore,
    ReplicaAllowlist,
    normalize_url,
)
from cachecore.testing import PATIENT_TIMEOUT_S


def reg(
    rid: str, url: str = "http://10.0.0.1:8000", dp: int | None = None, **kw: object
) -> Registration:
    fields: dict[str, object] = {
        "replica_id": rid,
        "url": url,
        "model": "llama",
        "block_size": 16,
        "capacity_blocks": 50_000,
        "dp_rank": dp,
        "agent_id": f"agent-{rid}",
        "registered_ms": 1,
    }
    fields.update(kw)
    return Registration.model_validate(fields)


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RegistryStore]:
    s: RegistryStore
    if request.param == "memory":
        s = MemoryRegistry()
    else:
        s = RedisRegistry.from_url(
            request.getfixturevalue("redis_url"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    yield s
    await s.close()


async def test_register_discover_deregister(store: RegistryStore) -> None:
    a, b = reg("a"), reg("b", "http://10.0.0.2:8000")
    await store.register(a, 10_000, 0)
    await store.register(b, 10_000, 0)
    assert await store.discover(5) == [a, b]
    assert await store.discover(5, ["b", "zzz"]) == [b]
    assert not await store.deregister("a", "someone-else")  # only its own agent
    assert await store.deregister("a", "agent-a")
    assert not await store.deregister("a", "agent-a")
    assert await store.discover(5) == [b]


async def test_memory_registration_expires_by_caller_clock() -> None:
    s = MemoryRegistry()
    await s.register(reg("a"), 1000, 0)
    assert len(await s.discover(999)) == 1
    assert await s.discover(1000) == []
    await s.register(reg("a"), 1000, 900)  # the heartbeat
    assert len(await s.discover(1500)) == 1


async def test_redis_registration_expires_by_redis_ttl(redis_url: str) -> None:
    s = RedisRegistry.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    try:
        await s.register(reg("a"), 150, 0)
        assert len(await s.discover(0)) == 1
        await asyncio.sleep(0.3)
        assert await s.discover(0) == []
    finally:
        await s.close()


async def test_malformed_registrations_are_skipped_and_counted(redis_url: str) -> None:
    s = RedisRegistry.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    admin = aioredis.Redis.from_url(redis_url)
    lay = KeyLayout()
    try:
        await s.register(reg("good"), 10_000, 0)
        await admin.set(lay.registration("junk"), b"\xff not json")
        await admin.set(lay.registration("big"), b"{" + b" " * 5000 + b"}")
        # a registration stored under another replica's key is refused
        await admin.set(lay.registration("liar"), reg("good", "http://10.9.9.9:1").to_json())
        await admin.set(
            lay.registration("neg"),
            reg("neg").to_json().replace(b'"block_size":16', b'"block_size":-1'),
        )
        found = await s.discover(0)
        assert [r.replica_id for r in found] == ["good"]
        assert s.malformed == 4
    finally:
        await s.close()
        await admin.aclose()
    m = MemoryRegistry()
    m.put_raw("x", b"[]", 10)
    assert await m.discover(0) == [] and m.malformed == 1


def test_registration_validation() -> None:
    with pytest.raises(ValidationError):
        reg("bad:id")
    with pytest.raises(ValidationError):
        reg("a", url="ftp://x")
    with pytest.raises(ValidationError):
        reg("a", block_size=0)
    with pytest.raises(ValidationError):
        reg("a", dp=-1)
    r = reg("a", dp=2)
    assert Registration.from_json(r.to_json()) == r


@pytest.mark.parametrize(
    ("url", "norm"),
    [
        ("http://Host.Example:8000/", "http://host.example:8000"),
        ("HTTP://10.0.0.1", "http://10.0.0.1:80"),
        ("https://h/v1/", "https://h:443/v1"),
        ("http://[::1]:9000", "http://[::1]:9000"),
    ],
)
def test_normalize_url(url: str, norm: str) -> None:
    assert normalize_url(url) == norm


@pytest.mark.parametrize(
    "url",
    [
        "http://evil@10.0.0.1:8000",  # looks like 10.0.0.1 to a human, is not to a parser
        "http://10.0.0.1:8000@evil.com",
        "http://10.0.0.1:8000/?x=1",
        "http://10.0.0.1:8000/#f",
        "file:///etc/passwd",
        "http://",
        "http://h:99999",
        "javascript:alert(1)",
    ],
)
def test_tricky_urls_are_refused(url: str) -> None:
    with pytest.raises(InvalidURLError):
        normalize_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://user:s3cret@10.0.0.1:8000",
        "http://user:s3cret@10.0.0.1:99999",  # a bad port too: refused for the user info
        "ftp://user:s3cret@h",
        "http://user:s3cret@",
        "http://us@er:s3cret@h:8000/v1?x=1",
    ],
)
def test_a_refused_url_never_echoes_its_password(url: str) -> None:
    """normalize_url's errors (logged, answered to a registration) quoted the URL whole:
    a port or scheme error came first and carried the password with it."""
    with pytest.raises(InvalidURLError) as info:
        normalize_url(url)
    assert "s3cret" not in str(info.value)
    assert "user info" in str(info.value)


def test_allowlist_accepts_only_declared_urls() -> None:
    allow = ReplicaAllowlist(["http://10.0.0.1:8000", "b=http://10.0.0.2:8000/", " "])
    assert len(allow) == 2
    good = reg("a", "http://10.0.0.1:8000/")
    rogue = reg("rogue", "http://203.0.113.66:8000")
    stolen = reg("x", "http://10.0.0.2:8000")  # claims b's pinned URL under another id
    pinned = reg("b", "HTTP://10.0.0.2:8000")
    accepted, rejected = allow.accept([good, rogue, stolen, pinned])
    assert accepted == [good, pinned]
    assert {(r.replica_id, r.reason) for r in rejected} == {
        ("rogue", "not_allowlisted"),
        ("x", "pinned_to_other_id"),
    }


def test_allowlist_conflicts_and_dp_ranks() -> None:
    allow = ReplicaAllowlist(["http://10.0.0.1:8000"])
    dp0, dp1 = reg("e@dp0", dp=0), reg("e@dp1", dp=1)
    accepted, rejected = allow.accept([dp0, dp1])
    assert accepted == [dp0, dp1] and not rejected  # one URL, two DP ranks: fine
    twin = reg("imposter", dp=0)
    accepted, rejected = allow.accept([dp0, twin])
    assert accepted == [] and {r.reason for r in rejected} == {"url_conflict"}


async def test_rogue_agent_can_only_register_itself(redis_url: str) -> None:
    """End to end with a real ACL user: the agent of replica a can write its own
    registration only; its attacker URL is still refused by the gateway's allowlist."""
    admin = aioredis.Redis.from_url(redis_url)
    args = acl_setuser_args("agent-a", "pw-agent-a-9", agent_acl_rules("a"))
    await admin.execute_command(*args)  # type: ignore[no-untyped-call]
    agent = RedisRegistry.from_url(
        redis_url.replace("redis://", "redis://agent-a:pw-agent-a-9@"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    gateway = RedisRegistry(admin)
    try:
        await agent.register(reg("a", "http://203.0.113.66:8000"), 10_000, 0)
        with pytest.raises(RegistryError, match=r"NOPERM|permission"):
            await agent.register(reg("b", "http://10.0.0.2:8000"), 10_000, 0)
        found = await gateway.discover(0)
        assert [r.replica_id for r in found] == ["a"]
        accepted, rejected = ReplicaAllowlist(["http://10.0.0.1:8000"]).accept(found)
        assert accepted == [] and rejected[0].reason == "not_allowlisted"
    finally:
        await agent.close()
        await admin.execute_command("ACL", "DELUSER", "agent-a")  # type: ignore[no-untyped-call]
        await admin.aclose()
