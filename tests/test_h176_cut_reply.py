"""A lookup cut while waiting for its reply must not throw its connection away.

redis-py disconnects a connection whose command was cancelled mid-reply (the reply left on
the wire would be read as the next command's). Under a Redis whose replies take a little
longer than the gateway's cut (a loaded host, a slow link), every lookup then opened a new
connection (TCP and handshake) on the Redis that was already slow: measured, 50 lookups
with 8 ms replies and a 5 ms cut opened 34-37. The shielded connection reads the last reply
it owes to its end in a task of its own (:func:`cachecore.index.redis.shielded_connects`):
the connection stays, and no command is ever handed a reply that is not its own."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisClient, RedisIndex, redis_client
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics
from tests.test_gateway_support import LoopbackProxy
from tests.test_h161_shielded_connect import KEYS, NOW

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

REPLY_DELAY_S = 0.05  # each reply's floor: longer than any cut below
CUT_S = 0.02
LOOKUPS = 50


class DelayingProxy(LoopbackProxy):
    """A loopback TCP proxy to ``upstream_port`` holding each chunk of Redis's replies
    ``delay()`` seconds once :attr:`slow` (the command ran, its answer is late)."""

    def __init__(self, upstream_port: int, delay: Callable[[], float]) -> None:
        super().__init__(upstream_port)
        self.delay = delay
        self.slow = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def pass_on(self, conn: int, from_client: bool, src: asyncio.StreamReader) -> bool:
        if self.slow and not from_client:
            await asyncio.sleep(self.delay())
        return True


class SplittingProxy(DelayingProxy):
    """A :class:`DelayingProxy` that also passes each chunk of replies on in up to three
    pieces, ``delay()`` apart: a cut lands inside a reply, or between the replies of one
    pipeline, as often as after one."""

    def __init__(self, upstream_port: int, delay: Callable[[], float], seed: int) -> None:
        super().__init__(upstream_port, delay)
        self.rng = random.Random(seed)

    async def write(
        self, conn: int, from_client: bool, data: bytes, dst: asyncio.StreamWriter
    ) -> None:
        if from_client or not self.slow or len(data) < 2:
            await super().write(conn, from_client, data, dst)
            return
        cuts = sorted(self.rng.sample(range(1, len(data)), min(2, len(data) - 1)))
        for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
            await super().write(conn, from_client, data[start:end], dst)
            await asyncio.sleep(self.delay())


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@contextlib.asynccontextmanager
async def delayed_index(
    srv: RedisServer, delay: float
) -> AsyncIterator[tuple[DelayingProxy, GatewayIndex]]:
    proxy = await DelayingProxy(srv.port, lambda: delay).start()
    # the gateway's own client, patient timeouts: only the cut cuts
    primary = RedisIndex.from_url(
        proxy.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    index = GatewayIndex(primary, GatewayMetrics(), MemoryIndex())
    try:
        yield proxy, index
    finally:
        await index.close()
        await proxy.close()


def _reading(client: RedisClient) -> list[Any]:
    """The connections of ``client`` whose cut command's reply is still being read."""
    conns: list[Any]
    if isinstance(client, RedisCluster):
        conns = [c for node in client.get_nodes() for c in node._connections]
    else:
        pool = client.connection_pool
        conns = [*pool._available_connections, *pool._in_use_connections]
    return [c for c in conns if c._kvgate_drain is not None and not c._kvgate_drain.done()]


async def test_lookups_cut_waiting_for_their_replies_keep_their_connection(
    server: RedisServer,
) -> None:
    async with delayed_index(server, REPLY_DELAY_S) as (proxy, index):
        warm = await index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S)  # connects
        assert (warm.source, proxy.accepted) == ("primary", 1)
        proxy.slow = True
        # each reply comes after its lookup's cut
        got = [(await index.lookup(KEYS, ["r0"], NOW, CUT_S)).source for _ in range(LOOKUPS)]
        # each lookup took the one connection, waited for the last one's reply to be read
        # and sent its own; without the fix each cut closed it and the next opened one
        assert (got.count("local"), index.fallbacks, proxy.accepted) == (LOOKUPS, LOOKUPS, 1)
        after = await index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S)
        assert (after.source, proxy.accepted) == ("primary", 1)  # its own reply, not a late one


async def test_closing_the_index_ends_a_reply_read_its_lookup_gave_up_on(
    server: RedisServer,
) -> None:
    """The read that goes on after a lookup's cut is the client's to end: closed while the
    reply is late, the read ends and its socket with it (no task outlives the gateway)."""
    async with delayed_index(server, PATIENT_TIMEOUT_S / 2) as (proxy, index):
        assert (await index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S)).source == "primary"
        proxy.slow = True
        assert (await index.lookup(KEYS, ["r0"], NOW, CUT_S)).source == "local"
        primary = index.primary
        assert isinstance(primary, RedisIndex) and isinstance(primary.client, Redis)
        [conn] = _reading(primary.client)
        drain = conn._kvgate_drain
        await primary.close()
        assert drain.done() and _reading(primary.client) == []
        assert conn._writer is None  # its socket closed
        assert proxy.accepted == 1


# GET, once Redis has spun ARGV[1] microseconds: a late reply with no proxy (Cluster's
# nodes announce their own ports)
SLOW_GET_LUA = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
return redis.call('GET', KEYS[1])
"""


async def _mixed_commands(
    client: RedisClient, values: dict[str, bytes], seed: int, longest_cut_s: float
) -> tuple[int, int]:
    """Commands (GET, a pipeline of GETs, on standalone a MULTI/EXEC, on Cluster a GET
    that Redis answers up to 1.5 ms late) cut at random points (up to ``longest_cut_s``),
    from 4 tasks at once: every answer that arrives must be its command's own. Returns the
    answers checked and the cut commands' replies read on."""
    rng = random.Random(seed)
    keys = sorted(values)
    checked = reads = 0
    standalone = isinstance(client, Redis)
    cls: Any = (
        client.connection_pool.connection_class
        if isinstance(client, Redis)
        else client.connection_kwargs["connection_class"]
    )
    read_on = cls._kvgate_read_on

    async def counted(self: Any, disable_decoding: bool) -> None:
        nonlocal reads
        reads += 1
        await read_on(self, disable_decoding)

    async def one(i: int) -> None:
        nonlocal checked
        picked = rng.sample(keys, 3)
        kind = rng.choice(("get", "pipeline", "multi") if standalone else ("get", "pipeline"))
        try:
            async with asyncio.timeout(rng.uniform(0.0, longest_cut_s)):
                if kind == "get" and standalone:
                    got: list[Any] = [await client.get(picked[0])]
                    picked = picked[:1]
                elif kind == "get":
                    late_us = rng.choice((0, 500, 1500))
                    got = [
                        await client.execute_command("EVAL", SLOW_GET_LUA, 1, picked[0], late_us)
                    ]
                    picked = picked[:1]
                else:
                    pipe = client.pipeline(transaction=kind == "multi")
                    for key in picked:
                        pipe.get(key)
                    got = await pipe.execute()
        except TimeoutError:  # the cut; any other error is a reply read out of turn
            return
        assert got == [values[k] for k in picked], (i, kind)
        checked += 1

    async def worker(w: int) -> None:
        for i in range(120):  # 480 commands in all
            await one(w * 1000 + i)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "_kvgate_read_on", counted)
        await asyncio.gather(*(worker(w) for w in range(4)))
    return checked, reads


async def test_randomly_cut_commands_never_read_another_commands_reply(
    server: RedisServer,
) -> None:
    rng = random.Random(176)
    delays = (0.0, 0.0, 0.0, 0.0005, 0.001, 0.002)
    proxy = await SplittingProxy(server.port, lambda: rng.choice(delays), 176).start()
    client = redis_client(
        proxy.url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        c_pack=True,
        shield_connects=True,
    )
    assert isinstance(client, Redis)
    values = {f"k{i}": f"v{i}".encode() for i in range(32)}
    try:
        await client.mset(values)
        proxy.slow = True
        checked, reads = await _mixed_commands(client, values, 176, 0.02)
        assert checked > 50 and reads > 20  # both exercised: answers, cut replies read on
        assert await client.get("k1") == b"v1"
    finally:
        await client.aclose()
        await proxy.close()
    assert _reading(client) == []


async def test_randomly_cut_cluster_commands_never_read_another_commands_reply(
    cluster_url: str,
) -> None:
    """The same on a real 3-node Cluster (its nodes take and release connections without
    the standalone pool), cut at random points of loopback round trips."""
    client = redis_client(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        c_pack=True,
        shield_connects=True,
    )
    assert isinstance(client, RedisCluster)
    values = {f"k{i}": f"v{i}".encode() for i in range(32)}
    try:
        for key, value in values.items():
            await client.set(key, value)
        checked, reads = await _mixed_commands(client, values, 1176, 0.004)
        assert checked > 50 and reads > 20
        assert await client.get("k1") == b"v1"
    finally:
        await client.aclose()
    assert _reading(client) == []


async def test_a_cut_landing_as_its_command_is_written_is_not_lost(server: RedisServer) -> None:
    """redis-py writes under ``asyncio.wait_for``, which on Python 3.11 drops a cancellation
    that arrives as the write completes: the cut command waited for its reply anyway (a
    lookup cut at its 5 ms answered 70 ms later, seen once the cut commands began to wait
    for the replies before theirs to be read). The cut is delivered, and the reply read on."""
    primary = RedisIndex.from_url(
        server.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    index = GatewayIndex(primary, GatewayMetrics(), MemoryIndex())
    try:
        assert (await index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S)).source == "primary"
        assert isinstance(primary.client, Redis)
        pool = primary.client.connection_pool
        write = pool.connection_class._send_packed_command
        lookups: list[asyncio.Task[Any]] = []

        async def written_then_cut(self: Any, command: Any) -> None:
            await write(self, command)
            lookups[0].cancel()  # as the write ends (wait_for's task ends with it)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pool.connection_class, "_send_packed_command", written_then_cut)
            lookups.append(asyncio.ensure_future(index.lookup(KEYS, ["r0"], NOW, 1.0)))
            with pytest.raises(asyncio.CancelledError):
                await lookups[0]
        after = await index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S)
        assert after.source == "primary"  # its own reply: the cut one's was read on
        assert len(pool._available_connections) + len(pool._in_use_connections) == 1
    finally:
        await index.close()
