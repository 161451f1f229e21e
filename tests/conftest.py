"""Shared fixtures: real redis-server processes on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from cachecore.testing import RedisServer


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
