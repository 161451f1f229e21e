"""An agent restart must not take a healthy engine out of routing.

A clean agent stop deregistered its replica at once, so a routine agent upgrade or restart
(old agent stopped, new one started, the engine untouched and serving) took the engine out
of every discovering gateway once the gap outlasted their removal grace: requests naming its
model answered 404 model_not_found (with one replica), and the gateways dropped what they
kept for it (their pending entries, in-flight counts, trees, quarantine state, series) and
took it back as a new replica. The shared index's entries were never cleared by the stop
nor by the removal: the new agent loads them and replays what it missed.

Now a clean stop asks the engine (``/health``, bounded by ``scrape_timeout_s``): while it
answers, the registration is handed over (kept ``handover_window_s`` from the stop, only if
it is still the stopping agent's own) and the next agent's first heartbeat overwrites it;
an engine that is down or unhealthy is deregistered at once, as before
(``KVGATE_AGENT_DEREGISTER_ON_STOP``: auto, always, never).

Real pieces: the simulated engine (``cachecore.replica``), real agents, a started gateway
with discovery, and the registry, index and load store in memory or on a real redis-server.
Discovery and the agents run on scaled-down times (refresh 0.2 s, removal grace 1 s,
heartbeat 0.2 s, registration TTL 1 s, hand-over window 6 s), the restart gap 2 s: longer
than the grace, as a real upgrade's gap (a process or container start) is longer than 5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from pydantic import SecretStr

from cachecore.agent import Agent
from cachecore.agent.cli import redis_stores
from cachecore.agent.settings import AgentSettings
from cachecore.index.base import PrefixIndex
from cachecore.index.layout import KeyLayout, acl_setuser_args, agent_acl_rules
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKey
from cachecore.loadstate import LoadStore, MemoryLoadStore
from cachecore.registry import (
    MemoryRegistry,
    RedisRegistry,
    Registration,
    RegistryError,
    RegistryStore,
)
from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.replica.settings import ReplicaEndpoints
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer, free_port
from gateway.core import Gateway
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text
from tests.test_agent_helpers import MODEL, Rig, counter_total, until
from tests.test_agent_replica import agent_settings, assert_index_matches, replica_settings
from tests.test_gateway_support import SECRET, kill_replica, words

pytestmark = pytest.mark.timeout(120)

RID = "r0"
HEARTBEAT_S = 0.2
REGISTRATION_TTL_S = 1.0
WINDOW_S = 10.0  # the hand-over window: GAP_S plus a new agent's start, with room on a loaded CI
DISCOVERY_S = 0.2  # the gateway's registry reads
GRACE_S = 1.0  # the gateway's removal grace
GAP_S = 2.0  # from the old agent's stop to the new agent's start
POLL_S = 0.05
STORES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


def now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    """One simulated engine, the stores (memory or Redis), and the agents' settings."""

    kind: str
    fleet: Fleet
    redis_url: str | None
    index: PrefixIndex  # a reader of the shared index
    registry: RegistryStore  # a reader of the shared registry
    load: LoadStore | None  # in memory: shared by the gateway and the agents
    agents: list[Agent] = field(default_factory=list)
    _closers: list[Any] = field(default_factory=list)

    @property
    def ep(self) -> ReplicaEndpoints:
        return self.fleet.endpoints[0]

    def settings(self, **kw: Any) -> AgentSettings:
        base: dict[str, Any] = {
            "heartbeat_interval_s": HEARTBEAT_S,
            "registration_ttl_s": REGISTRATION_TTL_S,
            "handover_window_s": WINDOW_S,
            "redis": self.redis_url,
            "redis_timeout_s": PATIENT_TIMEOUT_S,  # its own clients' (with redis_url)
        }
        return agent_settings(self.ep, RID, **{**base, **kw})

    async def new_agent(self, **kw: Any) -> Agent:
        """A started agent with stores of its own on Redis (a process of its own, as
        ``kvgate agent``), the shared ones in memory; ready, and registered."""
        settings = self.settings(**kw)
        if self.redis_url is not None:
            index, load, registry = redis_stores(settings)
            self._closers += [index, load, registry]
            agent = Agent(settings, index, load, registry)
        else:
            agent = Agent(settings, self.index, self.load, self.registry)
        self.agents.append(agent)
        await agent.start()
        await agent.wait_ready(20.0)
        link = agent.registry_link
        assert link is not None
        await until(lambda: self.registered_by(link.agent_id), 10.0)
        return agent

    async def registration(self) -> Registration | None:
        regs = await self.registry.discover(now_ms(), [RID])
        return regs[0] if regs else None

    async def registered_by(self, agent_id: str) -> bool:
        reg = await self.registration()
        return reg is not None and reg.agent_id == agent_id

    async def close(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):
                await agent.stop(deregister=False)
        for closer in [*self._closers, self.registry, self.index]:
            with contextlib.suppress(Exception):
                await closer.close()


@contextlib.asynccontextmanager
async def stack(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    async with run_fleet(replica_settings(num_blocks=1024), count=1) as fleet:
        if kind == "redis":
            server: RedisServer = request.getfixturevalue("redis_own")
            index = RedisIndex.from_url(
                server.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
            )
            registry = RedisRegistry.from_url(
                server.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
            )
            s = Stack(kind, fleet, server.url, index, registry, None)
        else:
            s = Stack(kind, fleet, None, MemoryIndex(), MemoryRegistry(), MemoryLoadStore())
        try:
            yield s
        finally:
            await s.close()


@contextlib.asynccontextmanager
async def discovering_gateway(s: Stack) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """A started gateway that routes only to what it discovers (no static replica)."""
    settings: dict[str, Any] = {
        "port": free_port(), "open_access": True, "salt_secrets": [SecretStr(SECRET)],
        "seed": 7, "replica_allowlist": [s.ep.url],
    }  # fmt: skip
    policy = parse_policy_text("")
    if s.redis_url is not None:  # the production shape: kvgate serve --redis --discover
        gw = build_gateway(
            GatewaySettings(
                redis_url=s.redis_url,
                redis_timeout_s=PATIENT_TIMEOUT_S,
                discover=True,
                **settings,
            ),
            policy=policy,
        )
    else:
        gw = Gateway(
            GatewaySettings(**settings), policy, index=s.index, load_store=s.load,
            registry=s.registry,
        )  # fmt: skip
    async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        disc = gw.discovery
        assert disc is not None
        await disc.stop()  # again on scaled-down times: reads every 0.2 s, 1 s grace
        disc.interval_s = DISCOVERY_S
        disc.removal_grace_ms = int(GRACE_S * 1000)
        disc.start()
        yield gw, http


def completion(model: str, i: int) -> dict[str, Any]:
    """A prompt of a shared 48-word prefix and a tail of its own."""
    prompt = words(48, 1) + " " + words(24, 1000 + i)
    return {"model": model, "prompt": prompt, "max_tokens": 1}


async def index_keys(s: Stack) -> set[BlockKey]:
    return set((await s.index.replica_blocks(RID)).keys())


@dataclass
class Watch:
    """What the registry, the gateway's pool and its answers showed, every 50 ms."""

    samples: int = 0
    registry_absent_s: float = 0.0
    pool_absent_s: float = 0.0
    pool_replaced: int = 0  # the replica object changed: removed and added as a new one
    index_short: int = 0  # samples where entries indexed before the stop were missing
    statuses: Counter[int] = field(default_factory=Counter)


async def watch(
    s: Stack, gw: Gateway, http: httpx.AsyncClient, before: set[BlockKey], stop: asyncio.Event
) -> Watch:
    """Poll until ``stop`` (bounded: 60 s); one request through the gateway every other
    poll."""
    assert gw.pool is not None
    w = Watch()
    rep = gw.pool.get(RID)
    assert rep is not None
    last = time.monotonic()
    for i in range(int(60 / POLL_S)):
        if stop.is_set():
            break
        now = time.monotonic()
        step, last = now - last, now
        w.samples += 1
        if await s.registration() is None:
            w.registry_absent_s += step
        cur = gw.pool.get(RID)
        if cur is None:
            w.pool_absent_s += step
        elif cur is not rep:
            w.pool_replaced += 1
            rep = cur
        if not before <= await index_keys(s):
            w.index_short += 1
        if i % 2 == 0:
            r = await http.post("/v1/completions", json=completion(s.ep.model, 100 + i))
            w.statuses[r.status_code] += 1
        await asyncio.sleep(POLL_S)
    return w


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("kind", STORES)
async def test_an_agent_restart_keeps_its_serving_engine_in_discovery(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Agent 1 stops cleanly while its engine serves; agent 2 starts 2 s later (longer
    than the gateways' removal grace). The replica never leaves the registry nor the
    gateway's pool, every request naming its model is answered 200, and the index keeps
    the replica's entries throughout and matches the engine exactly after agent 2 caught up
    (what the engine did meanwhile replayed, nothing cleared). Before: the registration
    was gone from the stop to agent 2's first heartbeat and the gateway removed the
    replica (requests 404 model_not_found) and added it back as a new one."""
    async with stack(kind, request) as s, discovering_gateway(s) as (gw, http):
        first = await s.new_agent()
        assert gw.pool is not None
        await until(lambda: gw.pool is not None and gw.pool.get(RID) is not None, 10.0)
        for i in range(6):  # cached prefixes of the replica, through the gateway
            r = await http.post("/v1/completions", json=completion(s.ep.model, i))
            assert r.status_code == 200, r.text
        before = await assert_index_matches(http, s.ep, first, s.index)
        assert before

        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(s, gw, http, before, stop))
        t0 = time.monotonic()
        await first.stop()  # SIGTERM's path: deregister_on_stop auto, the engine serves
        stop_s = time.monotonic() - t0
        await asyncio.sleep(GAP_S)  # the upgrade: a new process starts
        second = await s.new_agent()
        await asyncio.sleep(3 * DISCOVERY_S)  # the gateway reads the new registration
        stop.set()
        w = await watcher

        print(
            f"\n{kind}: stop {stop_s:.3f} s, {w.samples} samples, registry absent "
            f"{w.registry_absent_s:.2f} s, pool absent {w.pool_absent_s:.2f} s, replaced "
            f"{w.pool_replaced}, index short {w.index_short}, statuses {dict(w.statuses)}"
        )
        assert w.samples >= 20
        assert w.registry_absent_s == 0.0, w
        assert w.pool_absent_s == 0.0 and w.pool_replaced == 0, w
        assert set(w.statuses) == {200}, w
        assert w.index_short == 0, w
        link = second.registry_link
        assert link is not None and await s.registered_by(link.agent_id)
        assert stop_s < 2.0  # one /health probe

        # the index: agent 2 took the entries over (no clear) and replayed the gap
        after = await assert_index_matches(http, s.ep, second, s.index)
        assert before <= after
        assert counter_total(second.metrics.clears) == 0
        for sync in second.syncs.values():
            await sync.check_invariants()
        await asyncio.sleep(3 * HEARTBEAT_S)
        assert second.health()["status"] == "ok", second.health()
        assert not second.registration_conflict


@pytest.mark.parametrize("kind", STORES)
@pytest.mark.parametrize("down", ["closed", "unhealthy"])
async def test_a_clean_stop_with_its_engine_down_still_deregisters_at_once(
    kind: str, down: str, request: pytest.FixtureRequest
) -> None:
    """The engine is gone (its port closed) or says it is unhealthy (/health 503): the
    stop deregisters as before, within the probe, and the gateway removes the replica
    after its grace instead of keeping a dead engine for the hand-over window."""
    async with stack(kind, request) as s, discovering_gateway(s) as (gw, http):
        agent = await s.new_agent()
        assert gw.pool is not None
        await until(lambda: gw.pool is not None and gw.pool.get(RID) is not None, 10.0)
        if down == "closed":
            await kill_replica(s.fleet, 0)
        else:
            r = await http.post(f"{s.ep.url}/debug/health", json={"healthy": False})
            assert r.status_code == 200
        t0 = time.monotonic()
        await agent.stop()
        stop_s = time.monotonic() - t0
        assert await s.registration() is None  # gone when stop returns
        assert stop_s < 3.0, stop_s  # prompt: a refused or 503 probe, then DEL
        t1 = time.monotonic()
        await until(lambda: gw.pool is not None and gw.pool.get(RID) is None, 5.0)
        removed_s = time.monotonic() - t1
        print(f"\n{kind}/{down}: stop {stop_s:.3f} s, removed by the gateway {removed_s:.2f} s")
        # the grace and a few reads (0.9-1.0 s measured), with room for a loaded machine
        assert removed_s < GRACE_S + 5 * DISCOVERY_S + 2.0


# ------------------------------------------------------------------- the stop's choices


@pytest.fixture(params=STORES)
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Rig, RegistryStore]]:
    """The agent rig (engine stub, event source) with a registry in memory or on Redis."""
    registry: RegistryStore
    if request.param == "redis":
        registry = RedisRegistry.from_url(
            request.getfixturevalue("redis_url"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    else:
        registry = MemoryRegistry()
    r = Rig(MemoryIndex(), registration_ttl_s=REGISTRATION_TTL_S, handover_window_s=WINDOW_S)
    try:
        yield r, registry
    finally:
        await r.close()
        await registry.close()


async def _reg(registry: RegistryStore) -> Registration | None:
    regs = await registry.discover(now_ms(), [RID])
    return regs[0] if regs else None


async def _registered(registry: RegistryStore) -> bool:
    return await _reg(registry) is not None


async def _ttl_ms(registry: RegistryStore) -> int | None:
    """The registration's TTL left: Redis's PTTL, or read off the memory store."""
    if isinstance(registry, RedisRegistry):
        left = await registry.client.pttl(registry.layout.registration(RID))
        return int(left) if left >= 0 else None
    assert isinstance(registry, MemoryRegistry)
    item = registry._regs.get(RID)
    return None if item is None else item[1] - now_ms()


async def test_a_hand_over_keeps_the_registration_for_the_window(
    rig: tuple[Rig, RegistryStore],
) -> None:
    """auto, the engine up: the registration stays, its TTL set to the window (6 s, the
    heartbeat TTL is 1 s), and it lapses at the window's end."""
    r, registry = rig
    agent = await r.start(registry=registry)
    link = agent.registry_link
    assert link is not None
    await until(lambda: _registered(registry), 5.0)
    await r.stop_agent()
    reg = await _reg(registry)
    assert reg is not None and reg.agent_id == link.agent_id
    left = await _ttl_ms(registry)
    assert left is not None and WINDOW_S * 1000 - 1_000 < left <= WINDOW_S * 1000, left


async def test_always_deregisters_a_serving_engine(rig: tuple[Rig, RegistryStore]) -> None:
    """The operator's choice for a scale-down that keeps the engine up a while."""
    r, registry = rig
    r.settings_kw["deregister_on_stop"] = "always"
    await r.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    await r.stop_agent()
    assert await _reg(registry) is None


async def test_never_hands_over_even_with_the_engine_down(rig: tuple[Rig, RegistryStore]) -> None:
    r, registry = rig
    r.settings_kw["deregister_on_stop"] = "never"
    await r.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    r.stub.up = False
    await r.stop_agent()
    assert await _reg(registry) is not None


@pytest.mark.parametrize("engine_up", [True, False])
async def test_a_stop_leaves_a_successors_registration_alone(
    rig: tuple[Rig, RegistryStore], engine_up: bool
) -> None:
    """Agents overlapping: the new one registered before the old one stops. The old one's
    stop neither sets the TTL of the new one's registration (the engine serves: a
    hand-over) nor removes it (the engine is down: a deregistration)."""
    r, registry = rig
    r.settings_kw.update(heartbeat_interval_s=5.0, registration_ttl_s=10.0)  # one, at start
    old = await r.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    await registry.register(_registration("successor"), 2_000, now_ms())  # its heartbeat
    r.stub.up = engine_up
    await r.stop_agent()
    reg = await _reg(registry)
    assert reg is not None and reg.agent_id == "successor"
    left = await _ttl_ms(registry)
    assert left is not None and left <= 2_000  # not the old one's 6 s window
    link = old.registry_link
    assert link is not None and link.agent_id != "successor"


@pytest.mark.redis
async def test_forget_says_why_a_handed_over_replica_is_still_registered(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kvgate index forget`` refuses a registered replica; one left registered by a clean
    stop while its engine served is named as such, with the two ways out."""
    from tests.test_h24_index_cli import L, cli, kvgate_in_thread

    index = RedisIndex.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    registry = RedisRegistry.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    r = Rig(index, handover_window_s=WINDOW_S)
    try:
        await r.start(registry=registry)
        ev, _ = r.engine.store(list(range(8)))
        await r.publish(ev)
        await r.settle()
        await until(lambda: _registered(registry), 5.0)
        await r.stop_agent()  # the engine serves: handed over
        argv = cli(redis_url, "forget", RID, "--idle-for", "0s")[1:]
        code, _, err = await kvgate_in_thread(argv, capsys)
        assert code == 2, err
        assert "hand-over window" in err and "--deregister-on-stop always" in err, err
    finally:
        await r.close()
        await registry.close()
        await index.close()


# ----------------------------------------------------------------------------- registry


def _registration(agent_id: str) -> Registration:
    return Registration(
        replica_id=RID, url="http://10.0.0.1:8000", model=MODEL, block_size=16,
        capacity_blocks=100, agent_id=agent_id, registered_ms=1,
    )  # fmt: skip


@pytest.fixture(params=STORES)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[RegistryStore]:
    s: RegistryStore
    if request.param == "redis":
        s = RedisRegistry.from_url(
            request.getfixturevalue("redis_url"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    else:
        s = MemoryRegistry()
    yield s
    await s.close()


async def test_hand_over_sets_the_ttl_of_its_own_registration_only(store: RegistryStore) -> None:
    """A hand-over of another agent's registration, or of none, changes nothing; the next
    agent's register takes over one left to it, which the old agent's deregister then
    cannot remove."""
    t = now_ms()
    assert not await store.hand_over(RID, "old", 5_000, t)  # none there
    await store.register(_registration("old"), 1_000, t)
    assert not await store.hand_over(RID, "other", 60_000, t)
    assert await store.hand_over(RID, "old", 30_000, t)  # lengthened
    assert (left := await _ttl_ms(store)) is not None and 29_000 < left <= 30_000
    assert await store.hand_over(RID, "old", 3_000, t)  # shortened
    assert (left := await _ttl_ms(store)) is not None and 2_000 < left <= 3_000
    await store.register(_registration("new"), 1_000, t)  # the next agent's heartbeat
    assert not await store.hand_over(RID, "old", 30_000, t)
    assert not await store.deregister(RID, "old")
    reg = await _reg(store)
    assert reg is not None and reg.agent_id == "new"
    with pytest.raises(ValueError):
        await store.hand_over(RID, "new", 0, t)


@pytest.mark.redis
async def test_an_agents_acl_lets_it_hand_over_its_own_registration_only(redis_url: str) -> None:
    """The hand-over script's GET and PEXPIRE are within an agent's ACL on its own reg
    key; another replica's is refused (Redis checks a script's commands too)."""
    admin = aioredis.Redis.from_url(redis_url)
    layout = KeyLayout()
    args = acl_setuser_args("agent-h", "pw-agent-h-9", agent_acl_rules(RID, layout))
    await admin.execute_command(*args)  # type: ignore[no-untyped-call]
    agent = RedisRegistry.from_url(
        redis_url.replace("redis://", "redis://agent-h:pw-agent-h-9@"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    try:
        await agent.register(_registration("a1"), 1_000, 0)
        assert await agent.hand_over(RID, "a1", 20_000, 0)
        assert 19_000 < await admin.pttl(layout.registration(RID)) <= 20_000
        with pytest.raises(RegistryError, match=r"NOPERM|permission"):
            await agent.hand_over("r1", "a1", 20_000, 0)
    finally:
        await agent.close()
        await admin.execute_command("ACL", "DELUSER", "agent-h")  # type: ignore[no-untyped-call]
        await admin.aclose()


def test_the_choice_reads_from_the_environment_and_the_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse

    from cachecore.agent.cli import configure, settings_from_args
    from cachecore.agent.settings import StopRegistration

    monkeypatch.setenv("KVGATE_AGENT_DEREGISTER_ON_STOP", "always")
    monkeypatch.setenv("KVGATE_AGENT_HANDOVER_WINDOW_S", "30")
    parser = argparse.ArgumentParser()
    configure(parser)
    base = ["--replica-id", "r0", "--engine-url", "http://127.0.0.1:9", "--events",
            "tcp://127.0.0.1:9", "--redis", "redis://127.0.0.1:9/0"]  # fmt: skip
    s = settings_from_args(parser.parse_args(base))
    assert (s.deregister_on_stop, s.handover_window_s) == (StopRegistration.ALWAYS, 30.0)
    s = settings_from_args(
        parser.parse_args([*base, "--deregister-on-stop", "never", "--handover-window", "5"])
    )
    assert (s.deregister_on_stop, s.handover_window_s) == (StopRegistration.NEVER, 5.0)
    monkeypatch.setenv("KVGATE_AGENT_DEREGISTER_ON_STOP", "sometimes")
    with pytest.raises(ValueError, match="deregister_on_stop"):
        settings_from_args(parser.parse_args(base))
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--deregister-on-stop", "sometimes"])
