"""A command cut while its connection WATCHes must not leave the WATCH on a pooled
connection (H184 review of the cut-reply read, 4036859).

A cut command's connection is kept while its reply is read on, and reads as not
connected meanwhile; redis-py's pipeline sends no UNWATCH to a connection that reads as
not connected, so a pipeline cut while watching returned its connection with the WATCH
still on, and another caller's MULTI/EXEC there failed once the key changed. A connection
that sent WATCH owes replies "not known": a cut disconnects it, as redis-py does."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from cachecore.index.redis import redis_client
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from tests.test_h176_cut_reply import CUT_S, REPLY_DELAY_S, DelayingProxy

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


async def test_a_pipeline_cut_while_watching_leaves_no_watch_on_the_pool(
    server: RedisServer,
) -> None:
    proxy = await DelayingProxy(server.port, lambda: REPLY_DELAY_S).start()
    client = redis_client(
        proxy.url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        c_pack=True,
        shield_connects=True,
    )
    assert isinstance(client, Redis)
    try:
        await client.set("w", "1")
        pipe = client.pipeline()
        await pipe.watch("w")
        proxy.slow = True  # the watched read's reply comes after its cut
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(CUT_S):
                await pipe.get("w")
        await pipe.reset()  # type: ignore[no-untyped-call]  # redis-py untyped
        await asyncio.sleep(2 * REPLY_DELAY_S)  # any reply read on has been read
        proxy.slow = False
        await client.set("w", "2")  # what a WATCH left on would see
        other = client.pipeline(transaction=True)
        other.set("x", "1")
        assert await other.execute() == [True]  # WatchError with the WATCH kept
        assert await client.get("w") == b"2"
    finally:
        await client.aclose()
        await proxy.close()
