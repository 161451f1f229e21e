"""docs/security.md (quarantine): a skipped claim check is no bound against a rogue agent.
The removal log's floor, rm_floor, sits in the agent's own meta, which its ACL lets it
write: raised, every removal-log read of its replica answers "cannot tell" (the gateway
skips the check). Real redis-server, real ACL users."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import ReplicaState
from cachecore.index.layout import (
    KeyLayout,
    acl_setuser_args,
    agent_acl_rules,
    gateway_acl_rules,
)
from cachecore.index.redis import RedisIndex
from cachecore.lifecycle import IndexWrite

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
USERS = ("agent-rf", "gw-rf")


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    left = [k async for k in client.scan_iter("kvg:{r:rf}:*")]
    if left:
        await client.delete(*left)
    for user in USERS:
        await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
    await client.aclose()


def _as(redis_url: str, user: str) -> str:
    return redis_url.replace("redis://", f"redis://{user}:pw-{user}-1@")


async def test_a_rogue_agent_can_make_every_removal_check_unanswerable(
    admin: aioredis.Redis, redis_url: str
) -> None:
    for user, rules in zip(USERS, (agent_acl_rules("rf"), gateway_acl_rules()), strict=True):
        await admin.execute_command(  # type: ignore[no-untyped-call]
            *acl_setuser_args(user, f"pw-{user}-1", rules)
        )
    agent = RedisIndex.from_url(_as(redis_url, "agent-rf"))
    gateway = RedisIndex.from_url(_as(redis_url, "gw-rf"))
    raw_agent = aioredis.Redis.from_url(_as(redis_url, "agent-rf"))
    key = b"r" * 16
    try:
        epoch = await agent.clear_replica("rf", ReplicaState.LIVE, 1_000)
        await agent.apply("rf", epoch, IndexWrite({key: 1}, seq=1), 2_000)
        await agent.apply("rf", epoch, IndexWrite({key: 0}, seq=2, removed={key}), 3_000)
        # an honest log answers: removed at 3000, after 2500
        assert await gateway.removed_since("rf", [key], 2_500) == [True]
        # the agent raises its own floor (its ACL allows it): "cannot tell", every time
        await raw_agent.hset(KeyLayout().meta("rf"), "rm_floor", 10**15)
        assert await gateway.removed_since("rf", [key], 2_500) is None
        assert await gateway.removed_since("rf", [key], 10**14) is None
    finally:
        await raw_agent.aclose()
        await agent.close()
        await gateway.close()
