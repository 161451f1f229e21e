"""Shared fixtures: real redis-server processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from cachecore.testing import ClusterUnsupportedError, RedisClusterServers, RedisServer


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    """One real redis-server for the whole session (tests flush it via ``redis_url``)."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_url(redis_session: RedisServer) -> Iterator[str]:
    """URL of a flushed database on the session's redis-server."""
    if not redis_session.running:
        redis_session.start()
    client = redis.Redis.from_url(redis_session.url)
    client.flushall()
    client.close()
    yield redis_session.url


@pytest.fixture
def redis_own() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that stop or restart it."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A real 3-primary Redis Cluster for the session (tests flush it via ``cluster_url``).
    Skipped only when redis-server cannot run a cluster; any other failure to start errors."""
    try:
        cluster = RedisClusterServers(primaries=3).start()
    except ClusterUnsupportedError as exc:
        pytest.skip(f"redis-server lacks Redis Cluster support: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterServers) -> str:
    """A seed node's URL of the session's cluster, every node flushed."""
    redis_cluster.on_every_node("FLUSHALL")
    return redis_cluster.url
