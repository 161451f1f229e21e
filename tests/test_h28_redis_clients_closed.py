"""A stopped gateway leaves no connection open on its Redis. build_gateway makes four Redis
clients (the index's, the load store's, the registry's with --discover and the key store's
with --api-keys-redis); Gateway.stop closed the index alone, so every stop left the other
three connected (Redis's CLIENT LIST, and unclosed-client warnings). The gateway owns the
stores it is given, as it owns its index; the key store closes only the client
build_gateway made for it, not one a caller passed in and goes on using."""

from __future__ import annotations

import time

import pytest
import redis
import redis.asyncio

from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from gateway.auth import KeyStore, hash_key
from tests.test_gateway_support import stack

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

KEY = "sk-closed-test"


def others(url: str) -> list[str]:
    """CLIENT LIST's connections but the asking one, as "address cmd=last command"."""
    with redis.Redis.from_url(url, socket_timeout=5.0) as r:
        own = str(r.client_id())
        return [f"{c['addr']} cmd={c['cmd']}" for c in r.client_list() if c["id"] != own]


def wait_for_clients(url: str, ok: int, at_least: bool, timeout_s: float = 10.0) -> list[str]:
    """The other connections once their count is ``ok`` (or more, with ``at_least``), or
    what they are at the deadline (Redis sees a closed socket at its next event loop turn,
    a client connects at its first command: polled, bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = others(url)
        n = len(lines)
        if (n >= ok if at_least else n == ok) or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


async def test_a_stopped_gateway_leaves_no_redis_connection(redis_own: RedisServer) -> None:
    url = redis_own.url
    with redis.Redis.from_url(url) as r:
        r.hset("kvg:apikeys", hash_key(KEY), "acme")
    async with (
        stack(
            count=1,
            redis_url=url,
            api_keys_redis=True,
            open_access=False,
            discover=True,
            api_keys_redis_timeout_s=PATIENT_TIMEOUT_S,
        ) as st,
        st.http() as h,
    ):
        gw = st.gw  # held past the stop: its clients are not garbage collected
        body = {"model": st.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1}  # fmt: skip
        r = await h.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )
        assert r.status_code == 200, r.text  # the key store's client asked Redis
        # index, load store (its refresher), registry (discovery's first round), key store
        during = wait_for_clients(url, 4, at_least=True)
        assert len(during) >= 4, during
    after = wait_for_clients(url, 0, at_least=False)
    assert after == [], f"{len(after)} connections left by the stopped gateway: {after}"
    assert gw.draining


async def test_a_key_store_client_the_caller_passed_stays_open(redis_own: RedisServer) -> None:
    """A client handed to KeyStore (without owns_redis) is the caller's: the gateway's stop
    leaves its connection open."""
    url = redis_own.url
    client = redis.asyncio.Redis.from_url(url)
    try:
        await client.hset("kvg:apikeys", hash_key(KEY), "acme")  # connected
        keys = KeyStore(redis=client)
        async with stack(count=1, open_access=False, build={"key_store": keys}) as st:
            assert st.gw.key_store is keys
        assert len(wait_for_clients(url, 1, at_least=False)) == 1
        assert await client.hget("kvg:apikeys", hash_key(KEY)) == b"acme"
    finally:
        await client.aclose()
    assert wait_for_clients(url, 0, at_least=False) == []
