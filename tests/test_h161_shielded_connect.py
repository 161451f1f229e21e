"""A lookup cut at ``index.lookup_timeout_ms`` must not throw away the connection it began.

redis-py connects lazily, inside the command that takes a connection, and a cancelled
command dropped the connect it had begun (``connect_check_health`` disconnects on
BaseException). The gateway cuts lookups at 5 ms: where a connect and its handshake took
longer (a loaded host, TLS, a distant Redis), every lookup began one and threw it away, and
a gateway whose connection dropped (a Redis restart) fell back on every lookup for as long
as nothing but lookups used the client: measured with a 20 ms handshake, 20 lookups in 20
fell back, each with a new connection. A loopback proxy holds each new connection's
handshake until the test lets it through: deterministic, no timing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis

from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics
from tests.test_agent_helpers import counter_total, until
from tests.test_gateway_support import LoopbackProxy

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

KEYS = BlockKeyer(4).keys(list(range(4 * 8)), "kvg1:t", "m")
NOW = 1_000_000
PASSWORD = "h161-secret"  # AUTH in the handshake: a command sent into it reads NOAUTH
CUT_S = 0.05  # the lookup's cut; the held handshake overruns any cut


class HoldingProxy(LoopbackProxy):
    """A loopback TCP proxy to ``upstream_port`` that holds each new connection's first
    client bytes (its handshake) until :meth:`release`, and records when the client closed
    each connection (seen once the connection is released)."""

    def __init__(self, upstream_port: int, password: str = PASSWORD) -> None:
        super().__init__(upstream_port)
        self.password = password
        self.client_closed: list[asyncio.Event] = []
        self._gates: list[asyncio.Event] = []

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def release(self) -> None:
        """Let the connections accepted so far through; later ones are held again."""
        for gate in self._gates:
            gate.set()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._gates.append(asyncio.Event())
        self.client_closed.append(asyncio.Event())
        super()._accept(reader, writer)

    async def pass_on(self, conn: int, from_client: bool, src: asyncio.StreamReader) -> bool:
        if from_client:  # set once released: only the handshake waits
            await self._gates[conn].wait()
        return True

    def on_client_closed(self, conn: int) -> None:
        self.client_closed[conn].set()


@pytest.fixture
def redis_with_password() -> Iterator[RedisServer]:
    with RedisServer(extra_args=["--requirepass", PASSWORD]) as srv:
        yield srv


@contextlib.asynccontextmanager
async def held_index(
    srv: RedisServer, password: str = PASSWORD
) -> AsyncIterator[tuple[HoldingProxy, GatewayIndex]]:
    proxy = await HoldingProxy(srv.port, password).start()
    # the gateway's own client (RedisIndex.from_url), patient timeouts: only the cut cuts
    primary = RedisIndex.from_url(
        proxy.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    index = GatewayIndex(primary, GatewayMetrics(), MemoryIndex())
    try:
        yield proxy, index
    finally:
        proxy.release()
        await index.close()
        await proxy.close()


async def test_a_lookup_cut_during_the_handshake_leaves_its_connection_to_the_next(
    redis_with_password: RedisServer,
) -> None:
    async with held_index(redis_with_password) as (proxy, index):
        first = await index.lookup(KEYS, ["r0"], NOW, CUT_S)
        assert (first.source, index.fallbacks, proxy.accepted) == ("local", 1, 1)
        proxy.release()  # the first connection's handshake goes through; new ones are held
        # served through that first connection: its connect went on after the cut, and this
        # lookup, taking it, waited for the same connect (AUTH first: no NOAUTH). Without
        # the fix the cut had closed it, this lookup opened a second one, held: cut again
        second = await index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S)
        assert (second.source, index.fallbacks, proxy.accepted) == ("primary", 1, 1)
        assert not proxy.client_closed[0].is_set()
        third = await index.lookup(KEYS, ["r0"], NOW, CUT_S)  # the pool keeps it
        assert (third.source, index.fallbacks, proxy.accepted) == ("primary", 1, 1)


async def test_closing_the_client_ends_a_connect_its_lookup_gave_up_on(
    redis_with_password: RedisServer,
) -> None:
    """The connect that goes on after its lookup's cut is the client's to end: closed
    while it waits, it ends and its socket with it (no connect outlives the gateway)."""
    async with held_index(redis_with_password) as (proxy, index):
        got = await index.lookup(KEYS, ["r0"], NOW, CUT_S)
        assert (got.source, proxy.accepted) == ("local", 1)
        primary = index.primary
        assert isinstance(primary, RedisIndex)
        await primary.close()  # the handshake is still held: its connect ends with it
        connecting = [t for t in asyncio.all_tasks() if "Connection.connect" in repr(t.get_coro())]
        assert connecting == []
        assert isinstance(primary.client, Redis)
        pool = primary.client.connection_pool
        conns = [*pool._available_connections, *pool._in_use_connections]
        assert conns and not any(c._writer for c in conns)  # every socket closed
        proxy.release()  # the proxy reads on, and finds the client gone
        await asyncio.wait_for(proxy.client_closed[0].wait(), PATIENT_TIMEOUT_S)


async def test_a_command_sent_on_a_connection_still_connecting_waits_for_its_handshake(
    redis_with_password: RedisServer,
) -> None:
    """Redis Cluster's nodes send on a connection without the pool's connect step
    (``send_packed_command`` connects it only when it reads as not connected): while a
    cut command's connect goes on, the connection must read as not connected, or the next
    command is written into the handshake, ahead of AUTH's reply."""
    proxy = await HoldingProxy(redis_with_password.port).start()
    index = RedisIndex.from_url(
        proxy.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    assert isinstance(index.client, Redis)
    conn = index.client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(CUT_S):
                await conn.connect()
        assert not conn.is_connected  # the socket is open, the handshake is not done
        proxy.release()
        await conn.send_packed_command(conn.pack_command("PING"))
        assert await conn.read_response() == b"PONG"
        assert proxy.accepted == 1
    finally:
        proxy.release()
        await conn.disconnect()
        await index.close()
        await proxy.close()


async def test_a_handshake_that_fails_after_its_lookups_cut_is_logged_once_per_window(
    redis_with_password: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong password seen only after the lookup's cut: the lookups read as timeouts
    (``reason="timeout"``) and no command is left to see AUTH's error, so the client logs
    it, type and message (never the password), at most once per window."""
    caplog.set_level(logging.WARNING, logger="cachecore.index.redis")

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "cachecore.index.redis"]

    async def fails_after_the_cut(conn: int) -> None:
        got = await index.lookup(KEYS, ["r0"], NOW, CUT_S)
        assert (got.source, proxy.accepted) == ("local", conn + 1)
        proxy.release()  # AUTH with the wrong password goes through, refused
        await asyncio.wait_for(proxy.client_closed[conn].wait(), PATIENT_TIMEOUT_S)
        await asyncio.sleep(0)  # the attempt's done-callbacks run

    async with held_index(redis_with_password, "wrong-password") as (proxy, index):
        await fails_after_the_cut(0)
        await until(lambda: bool(warnings()), PATIENT_TIMEOUT_S)
        [record] = warnings()
        assert record.levelno == logging.WARNING
        assert getattr(record, "error", None) == "AuthenticationError"
        assert "wrong-password" not in record.getMessage() + str(record.__dict__)
        await fails_after_the_cut(1)  # the same client's next attempt fails alike
        await asyncio.sleep(0.05)
        assert len(warnings()) == 1  # within the window: not logged again
        assert counter_total(index.metrics.index_fallbacks, reason="timeout") == 2


async def test_a_failed_connect_a_lookup_waited_for_is_the_lookups_to_report(
    redis_with_password: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A command that waits for the attempt gets its error (the gateway logs the lookup's
    failure): the client does not log it again."""
    caplog.set_level(logging.WARNING, logger="cachecore.index.redis")
    async with held_index(redis_with_password, "wrong-password") as (proxy, index):
        lookup = asyncio.ensure_future(index.lookup(KEYS, ["r0"], NOW, PATIENT_TIMEOUT_S))
        await until(lambda: proxy.accepted == 1, PATIENT_TIMEOUT_S)
        proxy.release()
        got = await lookup
        assert (got.source, counter_total(index.metrics.index_fallbacks, reason="error")) == (
            "local",
            1,
        )
        await asyncio.wait_for(proxy.client_closed[0].wait(), PATIENT_TIMEOUT_S)
        await asyncio.sleep(0.05)
        assert [r for r in caplog.records if r.name == "cachecore.index.redis"] == []
