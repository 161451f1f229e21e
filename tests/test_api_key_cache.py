"""The Redis API key cache when it fills up: made-up keys must not push the valid keys'
recent answers out (they stand in while Redis cannot be asked), however many clients use
their keys. A real redis-server, stopped mid-test."""

from __future__ import annotations

import pytest

from cachecore.index.redis import redis_client
from cachecore.testing import RedisServer
from gateway.auth import KeyStore, hash_key

pytestmark = pytest.mark.timeout(120)


async def test_a_full_cache_keeps_the_newest_valid_answers_when_clients_are_many(
    redis_own: RedisServer,
) -> None:
    """6,000 clients' keys answered within the stale bound, then made-up keys fill the cache
    past its 10,000 entries. The prune kept the valid answers only when they were at most
    5,000 and emptied the cache whole otherwise: with Redis then unreachable every client's
    key got a 503, the failure the prune exists to prevent. It keeps the newest 5,000."""
    # generous: 10,000 lookups on a busy CI host, one 0.25 s stall failed closed (rightly)
    client = redis_client(redis_own.url, socket_timeout_s=5.0, connect_timeout_s=5.0)
    try:
        valid = [f"sk-client-{i}" for i in range(6_000)]
        await client.hset("kvg:apikeys", mapping={hash_key(k): "acme" for k in valid})
        store = KeyStore(redis=client, cache_ttl_s=0.0, stale_s=60.0)
        for k in valid:
            assert await store.tenant_for(f"Bearer {k}") == "acme"
        for i in range(4_002):  # the cache passes 10,000 entries: it is pruned
            assert await store.tenant_for(f"Bearer made-up-{i}") is None
        redis_own.stop()
        # the most recently answered clients' keys stand in for Redis
        for k in valid[-1_000:]:
            assert await store.tenant_for(f"Bearer {k}") == "acme", k
    finally:
        await client.aclose()
