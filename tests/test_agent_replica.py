"""Acceptance: simulated replica + agent + index. After mixed workloads and every fault the
agent must survive, the index holds EXACTLY the blocks the engine's block pool holds: the
keys recomputed (with the shared BlockKeyer) from the replica's own ``GET /debug/blocks``."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cachecore.agent import Agent, AgentSettings, start_embedded_agents
from cachecore.agent.expect import dump_when_idle, expected_keys
from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.index.layout import KeyLayout
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKey
from cachecore.kvevents import Encoding
from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.replica.settings import ReplicaEndpoints, ReplicaSettings
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from tests.test_agent_helpers import counter_total, salt, until

BLOCK = 16
LORA = "adapter-x"
TOPIC = "kv-events"


def replica_settings(**kw: Any) -> ReplicaSettings:
    base: dict[str, Any] = {
        "time_scale": 0.02,
        "num_blocks": 48,
        "block_size": BLOCK,
        "lora": [LORA],
        "profile": "8b-h100-fast",
    }
    return ReplicaSettings(**{**base, **kw})


def agent_settings(ep: ReplicaEndpoints, rid: str = "r0", **kw: Any) -> AgentSettings:
    base: dict[str, Any] = {
        "scrape_interval_s": 0.1,
        "unavailable_after_s": 0.5,
        "index_check_interval_s": 0.2,
        "replay_timeout_s": 1.0,
        "topic": TOPIC,
    }
    return AgentSettings(
        replica_id=rid,
        engine_url=ep.url,
        events=ep.events_endpoint,
        replay=ep.replay_endpoint,
        **{**base, **kw},
    )


# ---------------------------------------------------------------------- expectations


async def assert_index_matches(
    client: httpx.AsyncClient, ep: ReplicaEndpoints, agent: Agent, index: PrefixIndex,
    rid: str = "r0", exact: bool = True,
) -> set[BlockKey]:  # fmt: skip
    """Wait until the agent applied every batch the engine published, then compare."""
    dump = await dump_when_idle(client, ep.url)
    last = int(dump["next_event_seq"]) - 1

    def caught_up() -> bool:
        st = agent.stream
        syncs = list(agent.syncs.values())
        return (
            st is not None
            and st.last_seq == last
            and all(s.queued == 0 and not s.dirty for s in syncs)
        )

    await until(caught_up, 15.0)
    await agent.drain(10.0)
    want = expected_keys(dump, ep.model)
    held = set((await index.replica_blocks(rid)).keys())
    if exact:
        assert held == want, (len(held), len(want), len(held - want), len(want - held))
    else:
        assert held <= want, "the index claims blocks the engine does not hold"
    return want


# --------------------------------------------------------------------------- workload


@dataclass
class Workload:
    """Prompts with shared prefixes across tenants (different salts), a LoRA adapter,
    unscoped and ephemeral requests; more distinct blocks than the replica holds."""

    seed: int = 0

    def prompts(self, n: int) -> list[dict[str, Any]]:
        rng = random.Random(self.seed)
        self.seed += 1
        shared = [rng.randrange(100, 5000) for _ in range(3 * BLOCK)]
        out = []
        for i in range(n):
            tail = [rng.randrange(100, 5000) for _ in range(rng.randrange(1, 4) * BLOCK + 5)]
            body: dict[str, Any] = {"prompt": shared + tail, "max_tokens": 3}
            kind = i % 6
            if kind in (0, 1, 2):
                body["cache_salt"] = salt(f"tenant{kind}")
            elif kind == 3:
                body["cache_salt"] = salt("tenant0")
                body["model"] = LORA
            elif kind == 4:
                body["cache_salt"] = f"kvg1:e:{rng.getrandbits(256):064x}"
            # kind 5: no salt (did not come through a gateway)
            out.append(body)
        return out


async def send_all(
    client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]], parallel: int = 3
) -> None:
    sem = asyncio.Semaphore(parallel)

    async def one(body: dict[str, Any]) -> None:
        async with sem:
            r = await client.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text

    await asyncio.gather(*(one(b) for b in bodies))


async def replay_ok(agent: Agent) -> float:
    return counter_total(agent.metrics.replays, outcome="ok") + counter_total(
        agent.metrics.replays, outcome="same"
    )


# ------------------------------------------------------------------------------ tests


@pytest.fixture
async def fleet1() -> AsyncIterator[Fleet]:
    async with run_fleet(replica_settings(event_hash_format="bytes"), count=1) as fleet:
        yield fleet


@pytest.mark.redis
async def test_exact_index_through_eviction_and_every_fault(
    fleet1: Fleet, redis_own: RedisServer
) -> None:
    ep = fleet1.endpoints[0]
    index = RedisIndex.from_url(
        redis_own.url,
        KeyLayout("kvgacc"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    wl = Workload()
    agent = Agent(agent_settings(ep), index)
    try:
        async with httpx.AsyncClient() as client:
            await agent.start()
            await agent.wait_ready(10)
            await asyncio.sleep(0.2)

            # 1. mixed workload under eviction pressure
            await send_all(client, ep.url, wl.prompts(30))
            want = await assert_index_matches(client, ep, agent, index)
            assert want, "the workload indexed nothing"
            assert counter_total(agent.metrics.blocks_removed) > 0, "no eviction happened"

            # 2. a forced gap, recovered by replay
            r = await client.post(f"{ep.url}/debug/drop_events", json={"n": 3})
            assert r.status_code == 200
            before = await replay_ok(agent)
            await send_all(client, ep.url, wl.prompts(8))
            await assert_index_matches(client, ep, agent, index)
            assert await replay_ok(agent) > before
            assert (await index.meta("r0")).state is ReplicaState.LIVE

            # 3. agent restart: mirror and last seq from Redis, replay of what it missed
            await agent.stop()
            await send_all(client, ep.url, wl.prompts(4))
            agent = Agent(agent_settings(ep), index)
            await agent.start()
            await agent.wait_ready(10)
            await asyncio.sleep(0.2)
            await send_all(client, ep.url, wl.prompts(4))
            await assert_index_matches(client, ep, agent, index)
            assert counter_total(agent.metrics.clears) == 0, "the restart lost the mirror"

            # 4. engine restart: sequence reset and a new process start time
            epoch = (await index.meta("r0")).epoch
            r = await client.post(f"{ep.url}/debug/restart")
            assert r.status_code == 200
            await send_all(client, ep.url, wl.prompts(10))
            await assert_index_matches(client, ep, agent, index)
            assert (await index.meta("r0")).epoch > epoch
            assert counter_total(agent.metrics.engine_restarts) >= 1

            # 5. Redis restart: everything lost there, rewritten from the mirror
            redis_own.restart()
            await send_all(client, ep.url, wl.prompts(6))

            async def rewritten() -> bool:
                try:
                    return (await index.meta("r0")).state is ReplicaState.LIVE
                except Exception:
                    return False

            await until(rewritten, 15.0)
            await assert_index_matches(client, ep, agent, index)
            assert counter_total(agent.metrics.resyncs) >= 1
    finally:
        await agent.stop()
        await index.close()


async def test_gap_older_than_the_replay_buffer_marks_the_replica_cold() -> None:
    async with run_fleet(replica_settings(replay_buffer_steps=4), count=1) as fleet:
        ep = fleet.endpoints[0]
        index = MemoryIndex()
        agent = Agent(agent_settings(ep), index)
        try:
            async with httpx.AsyncClient() as client:
                await agent.start()
                await agent.wait_ready(10)
                await asyncio.sleep(0.2)
                wl = Workload(seed=7)
                await send_all(client, ep.url, wl.prompts(6))
                await assert_index_matches(client, ep, agent, index)
                await client.post(f"{ep.url}/debug/drop_events", json={"n": 10})
                await send_all(client, ep.url, wl.prompts(12), parallel=1)
                # the drop outlived the 4-batch buffer: cleared, marked cold, and what the
                # index holds afterwards is still true (never a block the engine lacks)
                await send_all(client, ep.url, wl.prompts(3), parallel=1)
                await assert_index_matches(client, ep, agent, index, exact=False)
                assert (await index.meta("r0")).state is ReplicaState.COLD
                assert counter_total(agent.metrics.clears, cause="gap_unrecoverable") >= 1
        finally:
            await agent.stop()


async def test_two_engines_with_different_hash_seeds_give_the_same_keys() -> None:
    settings = replica_settings(num_blocks=256, event_encoding=Encoding.ARRAY)
    async with run_fleet(settings, count=2) as fleet:
        index = MemoryIndex()
        agents = [
            Agent(agent_settings(ep, rid=f"r{i}"), index) for i, ep in enumerate(fleet.endpoints)
        ]
        try:
            async with httpx.AsyncClient() as client:
                for a in agents:
                    await a.start()
                    await a.wait_ready(10)
                await asyncio.sleep(0.2)
                bodies = Workload(seed=3).prompts(8)
                for ep in fleet.endpoints:
                    await send_all(client, ep.url, bodies, parallel=1)
                wants = []
                for i, (ep, a) in enumerate(zip(fleet.endpoints, agents, strict=True)):
                    wants.append(await assert_index_matches(client, ep, a, index, rid=f"r{i}"))
                d0 = await dump_when_idle(client, fleet.endpoints[0].url)
                d1 = await dump_when_idle(client, fleet.endpoints[1].url)
        finally:
            for a in agents:
                await a.stop()
    h0 = {b["block_hash"] for b in d0["blocks"]}
    h1 = {b["block_hash"] for b in d1["blocks"]}
    assert h0 and not h0 & h1, "the engines' hash seeds should differ"
    assert wants[0] == wants[1] and wants[0]
    assert set((await index.replica_blocks("r0")).keys()) == wants[0]


@dataclass(frozen=True)
class _Spec:
    id: str
    url: str
    events: str | None
    replay: str | None


async def test_embedded_agents_share_the_gateway_memory_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_AGENT_TOPIC", TOPIC)
    monkeypatch.setenv("KVGATE_AGENT_SCRAPE_INTERVAL_S", "0.1")
    async with run_fleet(replica_settings(), count=2) as fleet:
        index = MemoryIndex()
        specs = [
            _Spec(f"e{i}", ep.url, ep.events_endpoint, ep.replay_endpoint)
            for i, ep in enumerate(fleet.endpoints)
        ]
        stop = await start_embedded_agents(specs, index, None)
        try:
            async with httpx.AsyncClient() as client:

                async def live() -> bool:
                    metas = [await index.meta(s.id) for s in specs]
                    return all(m.state is ReplicaState.LIVE for m in metas)

                await until(live, 10.0)
                await asyncio.sleep(0.3)
                wl = Workload(seed=11)
                for ep in fleet.endpoints:
                    await send_all(client, ep.url, wl.prompts(6))
                for i, ep in enumerate(fleet.endpoints):
                    dump = await dump_when_idle(client, ep.url)
                    want = expected_keys(dump, ep.model)

                    async def matches(rid: str = f"e{i}", w: set[BlockKey] = want) -> bool:
                        return set((await index.replica_blocks(rid)).keys()) == w

                    await until(matches, 10.0)
                    assert want
        finally:
            await stop()
