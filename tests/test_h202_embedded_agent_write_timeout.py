"""Agents embedded in a gateway write the Redis index with a standalone agent's timeouts,
not the gateway's lookup client's. They wrote through that client, whose read timeout is
the serving default (``KVGATE_REDIS_TIMEOUT_S`` unset: 0.25 s): under a Redis slower than
that every batch timed out (``kvgate_agent_index_errors_total``) and so did each rewrite
from the mirror, the index stale for as long as it lasted, where a standalone agent (2 s)
wrote fine. Now they write through a client and pool of their own
(``cachecore.agent.embedded.write_index``): ``KVGATE_AGENT_REDIS_TIMEOUT_S``, unset 2 s to
read and 1 s to connect, while the gateway's lookups keep their client and bound.

Real pieces: a redis-server on a free port behind a loopback proxy that holds each of its
replies 0.4 s, a gateway with an embedded agent at the serving timeouts, a simulated
replica served traffic."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from redis.asyncio import Redis

from cachecore.agent.embedded import WRITE_CONNECTIONS_PER_AGENT, EmbeddedAgentsStop
from cachecore.agent.expect import dump_when_idle, expected_keys
from cachecore.index.base import ReplicaState
from cachecore.index.redis import RedisIndex
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from tests.test_agent_helpers import until
from tests.test_agent_replica import TOPIC, send_all
from tests.test_gateway_support import LoopbackProxy, Stack, stack
from tests.test_h166_embedded_agent_slow_redis import index_errors, prompts

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]

DELAY_S = 0.4  # over the gateway index client's 0.25 s, under the agent's 2 s


class LateReplies(LoopbackProxy):
    """A loopback proxy to a redis-server that, while :attr:`slow`, holds each chunk of
    its replies :data:`DELAY_S` (the commands run at once, their answers are late)."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.slow = False
        self.delayed = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def pass_on(self, conn: int, from_client: bool, src: asyncio.StreamReader) -> bool:
        if self.slow and not from_client:
            self.delayed += 1
            await asyncio.sleep(DELAY_S)
        return True


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@contextlib.asynccontextmanager
async def gateway(srv: RedisServer) -> AsyncIterator[tuple[LateReplies, RedisIndex, Stack]]:
    """The proxy, a patient client of Redis itself (not through the proxy) and a gateway on
    the proxy at the serving timeouts with one embedded agent, its replica LIVE."""
    proxy = await LateReplies(srv.port).start()
    reader = RedisIndex.from_url(
        srv.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    try:
        # redis_timeout_s None: the gateway's serving timeouts (0.25 s read), not the
        # patient ones stack() gives a test's redis-server
        async with stack(count=1, agents=True, redis_url=proxy.url, redis_timeout_s=None) as st:
            rid = st.replica_id(0)

            async def live() -> bool:
                return (await reader.meta(rid)).state is ReplicaState.LIVE

            await until(live, 15.0)
            yield proxy, reader, st
    finally:
        await reader.close()
        await proxy.close()


def timeouts(index: RedisIndex) -> tuple[float, float]:
    assert isinstance(index.client, Redis)
    kw = index.client.connection_pool.connection_kwargs
    return kw["socket_timeout"], kw["socket_connect_timeout"]


def group_of(st: Stack) -> tuple[EmbeddedAgentsStop, RedisIndex, RedisIndex]:
    """The agents' stop, their index client and the gateway's."""
    stop = st.gw._agents_stop
    assert isinstance(stop, EmbeddedAgentsStop)
    writes = stop.group.write_index
    primary = st.gw.index.primary if st.gw.index is not None else None
    assert isinstance(writes, RedisIndex) and isinstance(primary, RedisIndex)
    assert writes is not primary and writes.client is not primary.client
    assert all(a.index is writes for a in stop.group.agents)
    return stop, writes, primary


async def test_embedded_agent_writes_land_under_a_redis_slower_than_the_gateway_timeout(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_AGENT_TOPIC", TOPIC)
    monkeypatch.delenv("KVGATE_AGENT_REDIS_TIMEOUT_S", raising=False)
    async with gateway(redis_server) as (proxy, reader, st), httpx.AsyncClient() as client:
        stop, writes, primary = group_of(st)
        agents = stop.group.agents
        assert timeouts(primary) == (0.25, 0.5)  # the gateway's lookups: serving timeouts
        assert timeouts(writes) == (2.0, 1.0)  # the agent's: a standalone agent's
        await until(lambda: all(a.stream is not None for a in agents), 15.0)
        errors_before = index_errors(agents)

        proxy.slow = True  # every reply 0.4 s late
        ep = st.fleet.endpoints[0]
        await send_all(client, ep.url, prompts(202))
        want = expected_keys(await dump_when_idle(client, ep.url), ep.model)
        assert want

        async def landed() -> bool:
            return set((await reader.replica_blocks(st.replica_id(0))).keys()) == want

        t0 = time.monotonic()
        await until(landed, 15.0, step_s=0.05)
        landed_s = time.monotonic() - t0
        assert proxy.delayed > 0
        assert index_errors(agents) == errors_before  # no write timed out
        assert not any(s.dirty for a in agents for s in a.syncs.values())

        # the gateway's lookups still give up at their own bound, on their own client
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017  # redis-py's TimeoutError, as raised
            await primary.lookup([bytes(16)], [st.replica_id(0)], int(time.time() * 1000))
        lookup_s = time.monotonic() - t0
        assert 0.2 < lookup_s < DELAY_S, lookup_s

        assert isinstance(writes.client, Redis)
        pool = writes.client.connection_pool
        opened = len(pool._available_connections) + len(pool._in_use_connections)
        assert 1 <= opened <= WRITE_CONNECTIONS_PER_AGENT
        print(
            f"landed {landed_s:.2f} s after the traffic, lookup failed after "
            f"{lookup_s:.3f} s, the agent's pool opened {opened} connection(s)"
        )
    # the stop closed the agents' client
    assert stop.group.write_index is None
    assert not pool._in_use_connections
    assert not any(c.is_connected for c in pool._available_connections)


async def test_the_agent_redis_timeout_bounds_embedded_writes(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVGATE_AGENT_REDIS_TIMEOUT_S`` below the delay: the write times out and is counted,
    as a standalone agent's would."""
    monkeypatch.setenv("KVGATE_AGENT_TOPIC", TOPIC)
    monkeypatch.setenv("KVGATE_AGENT_REDIS_TIMEOUT_S", "0.1")
    async with gateway(redis_server) as (proxy, _, st), httpx.AsyncClient() as client:
        stop, writes, _ = group_of(st)
        agents = stop.group.agents
        assert timeouts(writes) == (0.1, 0.1)
        await until(lambda: all(a.stream is not None for a in agents), 15.0)
        errors_before = index_errors(agents)

        proxy.slow = True
        await send_all(client, st.fleet.endpoints[0].url, prompts(203))
        await until(lambda: index_errors(agents) > errors_before, 15.0)
        proxy.slow = False
