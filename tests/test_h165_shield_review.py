"""Review H165 of the shielded connects (ac4a306, :func:`cachecore.index.redis.shielded_connects`).

Two ways the shield changed what a command sees, each through the loopback proxy of
test_h161 that holds a connection's handshake until the test lets it through (no timing):
a command waiting for another's connect attempt was raised CancelledError, though nothing
cancelled it, when a disconnect (the client's close) ended that attempt; and the pool handed
the lookups the connection whose attempt was stuck, before the connected one beside it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics
from tests.test_h161_shielded_connect import (
    CUT_S,
    KEYS,
    NOW,
    HoldingProxy,
    redis_with_password,  # noqa: F401  # a fixture
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


class HoldingSecond(HoldingProxy):
    """Holds only the second connection's handshake: one slow connect among fast ones."""

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super()._accept(reader, writer)
        if self.accepted != 2:
            self._gates[-1].set()


async def _index(proxy: HoldingProxy) -> GatewayIndex:
    primary = RedisIndex.from_url(
        proxy.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    return GatewayIndex(primary, GatewayMetrics(), MemoryIndex())


@pytest.fixture
async def held(redis_with_password: RedisServer) -> AsyncIterator[HoldingProxy]:  # noqa: F811
    proxy = await HoldingProxy(redis_with_password.port).start()
    try:
        yield proxy
    finally:
        proxy.release()
        await proxy.close()


async def test_a_lookup_waiting_for_a_connect_that_a_disconnect_ends_falls_back(
    held: HoldingProxy,
) -> None:
    """The second lookup waits for the first's connect (held); the pool is disconnected
    meanwhile (as the client's close does), which ends that attempt. The waiting lookup was
    not cancelled: it must fail as a lost connection (and fall back), not raise
    CancelledError out of the index, which no ``except Exception`` catches."""
    index = await _index(held)
    try:
        first = await index.lookup(KEYS, ["r0"], NOW, CUT_S)
        assert (first.source, held.accepted) == ("local", 1)
        waiting = asyncio.ensure_future(index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S))
        for _ in range(100):  # bounded: it takes the pooled connection, no I/O
            await asyncio.sleep(0)
        assert not waiting.done() and held.accepted == 1  # waiting for the same attempt
        primary = index.primary
        assert isinstance(primary, RedisIndex) and isinstance(primary.client, Redis)
        await primary.client.connection_pool.disconnect()
        got = await asyncio.wait_for(waiting, PATIENT_TIMEOUT_S)
        assert (got.source, index.fallbacks) == ("local", 2)
    finally:
        await index.close()


async def test_a_stuck_connect_does_not_keep_the_lookups_from_a_connected_connection(
    redis_with_password: RedisServer,  # noqa: F811
) -> None:
    """Two lookups at once open two connections; the second's handshake is stuck (held
    for good), the first's is served. The lookups after them must take the connected one:
    the pool handing out the most recently released connection first gave every later
    lookup the stuck attempt to wait on, so each fell back until that attempt timed out
    (up to the client's connect + read timeouts), beside an idle connected connection."""
    proxy = await HoldingSecond(redis_with_password.port).start()
    index = await _index(proxy)
    try:
        cut = PATIENT_TIMEOUT_S / 4  # the first lookup's connect must get through it
        got = await asyncio.gather(*(index.lookup(KEYS, ["r0"], NOW, cut) for _ in range(2)))
        assert sorted(g.source for g in got) == ["local", "primary"]
        assert proxy.accepted == 2
        after = [(await index.lookup(KEYS, ["r0"], NOW, cut)).source for _ in range(3)]
        assert after == ["primary"] * 3
        assert proxy.accepted == 2  # no new connection: the connected one served them
    finally:
        proxy.release()
        await index.close()
        await proxy.close()
