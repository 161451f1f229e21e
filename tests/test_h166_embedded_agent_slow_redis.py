"""An embedded agent's index write that overruns its Redis read timeout is not lost:
``ReplicaSync`` counts it (``kvgate_agent_index_errors_total{op="apply"}``), marks the
replica dirty, and its next index call, at the latest the index check every
``KVGATE_AGENT_INDEX_CHECK_INTERVAL_S``, rewrites the replica from the agent's mirror
(``kvgate_agent_resyncs_total{cause="index_error"}``), which already holds the batch. The
timeout is ``KVGATE_AGENT_REDIS_TIMEOUT_S``, set here to the gateway index client's serving
0.25 s (the agents wrote through that client before
tests/test_h202_embedded_agent_write_timeout.py). Measured here end to end: a real
redis-server behind a loopback proxy that holds every reply 300 ms for a window, a real
gateway with embedded agents, simulated replicas served traffic during the window; once it
ends the index equals each replica's cache within a bound."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from cachecore.agent import Agent
from cachecore.agent.embedded import EmbeddedAgentsStop
from cachecore.agent.expect import dump_when_idle, expected_keys
from cachecore.index.base import ReplicaState
from cachecore.index.redis import RedisIndex
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from tests.test_agent_helpers import counter_total, salt, until
from tests.test_agent_replica import TOPIC, send_all
from tests.test_gateway_support import LoopbackProxy, stack

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

DELAY_S = 0.3  # over the agents' index client's read timeout as set here
AGENT_TIMEOUT_S = 0.25  # KVGATE_AGENT_REDIS_TIMEOUT_S: the gateway index client's default
# the agents' defaults: index checks every 2 s, retries backing off to at most 5 s; a
# dirty replica is rewritten at the first check past its back-off
CONVERGE_BOUND_S = 2.0 + 5.0 + 8.0  # plus the replicas going idle, a loaded host


class DelayingProxy(LoopbackProxy):
    """A loopback TCP proxy to ``upstream_port`` that, while :attr:`slow`, holds each chunk
    :data:`DELAY_S` before passing it on: with ``hold="replies"`` Redis's replies (the
    command ran, its answer is late: a slow link, a loaded host), with ``hold="commands"``
    the client's commands, dropped if the client gave up on the connection meanwhile (the
    command never ran)."""

    def __init__(self, upstream_port: int, hold: str) -> None:
        super().__init__(upstream_port)
        self.hold = hold
        self.slow = False
        self.delayed = 0  # chunks held
        self.dropped = 0  # commands never passed on

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def pass_on(self, conn: int, from_client: bool, src: asyncio.StreamReader) -> bool:
        if not self.slow or from_client != (self.hold == "commands"):
            return True
        self.delayed += 1
        await asyncio.sleep(DELAY_S)
        if from_client and src.at_eof():  # the client gave up
            self.dropped += 1
            return False
        return True


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@contextlib.asynccontextmanager
async def proxied(srv: RedisServer, hold: str) -> AsyncIterator[tuple[DelayingProxy, RedisIndex]]:
    """The proxy, and a patient client of Redis itself (not through the proxy) to read
    what the index holds."""
    proxy = await DelayingProxy(srv.port, hold).start()
    reader = RedisIndex.from_url(
        srv.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    try:
        yield proxy, reader
    finally:
        await reader.close()
        await proxy.close()


def prompts(seed: int, n: int = 6) -> list[dict[str, Any]]:
    """Scoped prompts (three tenants) on a shared prefix: blocks the agents index."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 5000) for _ in range(48)]
    return [
        {
            "prompt": shared + [rng.randrange(100, 5000) for _ in range(rng.randrange(20, 60))],
            "max_tokens": 3,
            "cache_salt": salt(f"tenant{i % 3}"),
        }
        for i in range(n)
    ]


def index_errors(agents: list[Agent]) -> float:
    return sum(counter_total(a.metrics.index_errors) for a in agents)


def resyncs(agents: list[Agent]) -> float:
    return sum(counter_total(a.metrics.resyncs, cause="index_error") for a in agents)


@pytest.mark.parametrize("failures", [1, 3], ids=["one-write", "retries-too"])
@pytest.mark.parametrize("hold", ["commands", "replies"])
async def test_embedded_agents_writes_cut_by_their_timeout_converge_after_the_delay(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, hold: str, failures: int
) -> None:
    """``hold``: what the proxy delays (commands: a timed-out write never ran; replies: it
    ran, unconfirmed). ``failures``: the failed index calls each agent sees before the
    window ends (3: its retries, the resyncs the index checks start, fail too)."""
    monkeypatch.setenv("KVGATE_AGENT_TOPIC", TOPIC)
    monkeypatch.setenv("KVGATE_AGENT_REDIS_TIMEOUT_S", str(AGENT_TIMEOUT_S))
    async with (
        proxied(redis_server, hold) as (proxy, reader),
        # redis_timeout_s None: the gateway's serving timeouts (0.25 s read), not the
        # patient ones stack() gives a test's redis-server
        stack(count=2, agents=True, redis_url=proxy.url, redis_timeout_s=None) as st,
        httpx.AsyncClient() as client,
    ):
        stop = st.gw._agents_stop
        assert isinstance(stop, EmbeddedAgentsStop)
        agents = stop.group.agents
        ids = [st.replica_id(i) for i in range(2)]
        assert sorted(a.primary_id for a in agents) == sorted(ids)
        # the agents write through a client of their own, at the timeout set
        writes = stop.group.write_index
        assert isinstance(writes, RedisIndex)
        assert all(a.index is writes for a in agents)
        assert isinstance(writes.client, Redis)
        kwargs = writes.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == AGENT_TIMEOUT_S

        async def live() -> bool:
            metas = [await reader.meta(rid) for rid in ids]
            return all(m.state is ReplicaState.LIVE for m in metas)

        await until(live, 15.0)
        await until(lambda: all(a.stream is not None for a in agents), 15.0)
        errors_before, resyncs_before = index_errors(agents), resyncs(agents)

        proxy.slow = True  # 300 ms late: each agent write times out
        for i, ep in enumerate(st.fleet.endpoints):
            await send_all(client, ep.url, prompts(166 + i))
        await until(lambda: index_errors(agents) >= errors_before + 2 * failures, 15.0)
        proxy.slow = False
        window_end = time.monotonic()
        assert proxy.delayed > 0
        if hold == "commands":  # some write never reached Redis: only a rewrite brings it
            await until(lambda: proxy.dropped > 0, 2.0)  # the held chunk's 0.3 s ends

        for i, ep in enumerate(st.fleet.endpoints):
            dump = await dump_when_idle(client, ep.url)
            want = expected_keys(dump, ep.model)
            assert want

            async def matches(rid: str = ids[i], w: set[bytes] = want) -> bool:
                return set((await reader.replica_blocks(rid)).keys()) == w

            left = CONVERGE_BOUND_S - (time.monotonic() - window_end)
            await until(matches, max(left, 0.1), step_s=0.05)
        converged_s = time.monotonic() - window_end
        # the recovery was the mirror's rewrite, and no agent is still dirty
        assert resyncs(agents) > resyncs_before
        assert not any(s.dirty for a in agents for s in a.syncs.values())
        print(
            f"hold {hold}: commands dropped {proxy.dropped}, "
            f"index errors {index_errors(agents) - errors_before:.0f}, "
            f"resyncs {resyncs(agents) - resyncs_before:.0f}, "
            f"converged {converged_s:.2f} s after the window"
        )
