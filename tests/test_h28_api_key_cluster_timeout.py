"""KVGATE_API_KEYS_REDIS_TIMEOUT_S on Redis Cluster: one key lookup waits about that long.
The Cluster client retries a command that timed out (10 times, with a topology refresh
before a retry and before the next command after an error), so with 1 s a lookup whose
shard stalled waited until the shard answered again (14 s of a 14 s pause), and with every
node stalled 4 s, the next one 7 s. The key store now gives each lookup one deadline; the
client's retries are kept, since they reconnect a connection Redis closed (with none, the
first lookup after a Redis restart or an idle-timeout kill failed).

A node is stalled with ``CLIENT PAUSE ms ALL`` (commands wait, the cluster bus runs on);
Redis lets no CLIENT UNPAUSE through such a pause, so each test waits its pause out."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable

import pytest
import redis

from cachecore.testing import RedisClusterServers
from gateway.auth import KeyStore, KeyStoreUnavailable, hash_key
from gateway.serve import build_gateway
from gateway.settings import GatewaySettings

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

HASH = "kvg:apikeys"
PEER = "127.0.0.1"
PAUSE_S = 6.0  # longer than every wait below; the old client waited it out


@contextlib.asynccontextmanager
async def key_store(url: str) -> AsyncIterator[KeyStore]:
    """The key store build_gateway makes for a Cluster (1 s timeout), with keys sk-a..sk-c
    in its hash and its client's view of the cluster taken (one lookup answered)."""
    with redis.RedisCluster.from_url(url) as seed:
        seed.hset(HASH, mapping={hash_key(f"sk-{t[0]}"): t for t in ("acme", "bob", "carl")})
    settings = GatewaySettings(
        redis_url=url, redis_cluster=True, api_keys_redis=True, api_keys_redis_timeout_s=1.0
    )
    keys = build_gateway(settings).key_store
    try:
        assert await keys.tenant_for("Bearer sk-a", PEER) == "acme"
        yield keys
    finally:
        await keys.close()


@contextlib.asynccontextmanager
async def paused(ports: Iterable[int]) -> AsyncIterator[None]:
    """The nodes on ``ports`` answer no command for PAUSE_S; waited out on leaving."""
    ends = time.monotonic() + PAUSE_S
    for port in ports:
        with redis.Redis("127.0.0.1", port, socket_timeout=5.0) as node:
            node.execute_command("CLIENT", "PAUSE", str(int(PAUSE_S * 1000)), "ALL")
    try:
        yield
    finally:  # the session's cluster answers the next test
        await asyncio.sleep(max(0.0, ends - time.monotonic()) + 0.2)


async def fails_after(keys: KeyStore, api_key: str) -> float:
    started = time.monotonic()
    with pytest.raises(KeyStoreUnavailable):
        await keys.tenant_for(f"Bearer {api_key}", PEER)
    return time.monotonic() - started


async def test_a_lookup_on_a_stalled_shard_gives_up_after_one_timeout(
    redis_cluster: RedisClusterServers, cluster_url: str
) -> None:
    """The other shards answer, so every refresh succeeds and the client retried the
    stalled one until it answered: 14 s at 1 s. Now 1 s, and Redis is asked again after."""
    async with key_store(cluster_url) as keys:
        with redis.RedisCluster.from_url(cluster_url) as probe:
            shard = probe.get_node_from_key(HASH).port
        async with paused([shard]):
            waited = await fails_after(keys, "sk-never-seen")
            assert 0.9 <= waited < 3.0, waited
        assert await keys.tenant_for("Bearer sk-b", PEER) == "bob"  # asked, answered


async def test_a_lookup_on_a_stalled_cluster_gives_up_after_one_timeout(
    redis_cluster: RedisClusterServers, cluster_url: str
) -> None:
    """Every node stalled: the client's refresh reaches none, one timeout a node. The
    first lookup waited 4 s at 1 s, the next one (after KeyStore's 1 s without lookups)
    7 s: it refreshes before it sends. Both 1 s now."""
    async with key_store(cluster_url) as keys:
        async with paused(redis_cluster.ports):
            first = await fails_after(keys, "sk-never-seen")
            await asyncio.sleep(1.1)  # past the second in which lookups are not tried
            second = await fails_after(keys, "sk-never-seen-2")
            assert 0.9 <= first < 3.0 and 0.9 <= second < 3.0, (first, second)
        assert await keys.tenant_for("Bearer sk-b", PEER) == "bob"


async def test_a_connection_redis_closed_is_reconnected_not_a_failed_lookup(
    redis_cluster: RedisClusterServers, cluster_url: str
) -> None:
    """Why the client's retries stay: its pooled connection closed by Redis (a restart,
    an idle timeout) is retried on a new one. With retries off a lookup failed here."""
    async with key_store(cluster_url) as keys:
        redis_cluster.on_every_node("CLIENT", "KILL", "TYPE", "normal")
        assert await keys.tenant_for("Bearer sk-b", PEER) == "bob"
        assert keys.redis_errors == 0
