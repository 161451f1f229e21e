"""A replica that discovery removes for good takes the gateway's own state of it along.

The gateway's local index (``GatewayIndex.local``: this gateway's pending decisions, used
with a shared primary) and its live marks (``GatewayIndex._local_live``) kept an entry per
replica id ever seen: autoscaled replicas with fresh ids (cachecore/registry.py,
gateway/discovery.py) grew them for the gateway's whole life. Now Discovery calls
``on_removed`` when it removes a replica after its grace, and ``GatewayIndex.forget`` drops
the replica's local entries, meta and live mark; a replica re-added later is a new one.
An in-process primary (embedded mode) drops the replicas no agent wrote.

Real pieces throughout: a real redis-server (tests/conftest.py) as the shared primary, the
in-process MemoryRegistry agents register in, a real ReplicaPool (no probes run)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from pydantic import SecretStr

from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import IndexWrite
from cachecore.registry import MemoryRegistry, Registration, ReplicaAllowlist
from cachecore.testing import PATIENT_TIMEOUT_S, free_ports
from gateway.core import Gateway
from gateway.discovery import Discovery
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaPool
from gateway.settings import GatewaySettings
from policies.schema import HealthPolicy, parse_policy_text

KEYS = BlockKeyer(4).keys(list(range(4 * 8)), "kvg1:t", "m")
OTHER = BlockKeyer(4).keys(list(range(100, 100 + 4 * 8)), "kvg1:t", "m")
TTL_MS = 600_000  # pending entries outlive the test: only a forget removes them
GRACE_MS = 5_000  # Discovery's default removal grace
URL = "http://10.0.0.9:8000"


@dataclass
class Fleet:
    registry: MemoryRegistry
    pool: ReplicaPool
    index: GatewayIndex
    discovery: Discovery
    client: httpx.AsyncClient
    now: int = 1_000_000

    async def join(self, rid: str) -> None:
        """``rid``'s agent registers; the next refresh adds it to the pool."""
        reg = Registration(
            replica_id=rid, url=URL, model="m", block_size=4, capacity_blocks=100,
            agent_id=f"agent-{rid}", registered_ms=self.now,
        )  # fmt: skip
        await self.registry.register(reg, 1_000, now_ms=self.now)
        self.now += 1
        await self.discovery.refresh_once(now_ms=self.now)
        assert self.pool.get(rid) is not None

    async def leave(self, rid: str) -> None:
        """``rid``'s registration expires; a refresh past the grace removes it."""
        self.now += GRACE_MS + 1_001
        await self.discovery.refresh_once(now_ms=self.now)
        assert self.pool.get(rid) is None

    def route(self, rid: str, keys: list[bytes] = KEYS) -> None:
        """A request dispatched to ``rid`` whose engine took it."""
        w = self.index.add_pending(rid, keys, TTL_MS, self.now)
        assert w is not None
        self.index.done(w)


async def _fleet(primary: RedisIndex | MemoryIndex, local: MemoryIndex | None) -> Fleet:
    registry = MemoryRegistry()
    client = httpx.AsyncClient()
    pool = ReplicaPool(client, HealthPolicy())
    index = GatewayIndex(primary, GatewayMetrics(), local)
    disc = Discovery(
        registry, ReplicaAllowlist([URL]), pool, set(), on_removed=index.forget
    )  # as Gateway.start wires it
    return Fleet(registry, pool, index, disc, client)


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[Fleet]:
    primary = RedisIndex.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    f = await _fleet(primary, MemoryIndex())
    yield f
    await f.index.close()
    await f.client.aclose()


@pytest.fixture
async def embedded() -> AsyncIterator[Fleet]:
    f = await _fleet(MemoryIndex(), None)
    yield f
    await f.index.close()
    await f.client.aclose()


async def _local_replicas(f: Fleet) -> int:
    assert f.index.local is not None
    return (await f.index.local.stats()).replicas


@pytest.mark.redis
async def test_churned_replica_ids_leave_no_local_state(fleet: Fleet) -> None:
    """500 autoscaled replicas, each discovered, routed to (the local index and its live
    mark hold it), then removed: nothing is left of them (before: 500 of each)."""
    for i in range(500):
        rid = f"gpu-{i}"
        await fleet.join(rid)
        fleet.route(rid)
        assert fleet.index._local_live == {rid}
        assert await _local_replicas(fleet) == 1
        await fleet.leave(rid)
        if i % 50 == 0:
            await fleet.index.settle()  # the shared index's writes: bounded background
    assert fleet.index._local_live == set()
    assert await _local_replicas(fleet) == 0
    assert fleet.index._inflight == {}
    assert fleet.index.local is not None
    fleet.index.local.check_invariants()
    await fleet.index.settle()


@pytest.mark.redis
async def test_a_replica_back_after_its_removal_is_a_new_one(fleet: Fleet) -> None:
    """Re-added under the same id, a replica is marked live again at its first pending
    write and holds only what was routed to it since: the decisions made for the departed
    one (pending for 10 minutes) are not its."""
    local = fleet.index.local
    assert local is not None
    await fleet.join("gpu-a")
    fleet.route("gpu-a", KEYS)
    await fleet.leave("gpu-a")
    assert (await local.meta("gpu-a")).state is ReplicaState.UNKNOWN  # forgotten
    await fleet.join("gpu-a")
    assert "gpu-a" not in fleet.index._local_live  # nothing routed to it yet
    fleet.route("gpu-a", OTHER)
    assert fleet.index._local_live == {"gpu-a"}
    assert (await local.meta("gpu-a")).state is ReplicaState.LIVE
    got = await local.lookup(KEYS, ["gpu-a"], fleet.now)
    assert got["gpu-a"].pending_blocks == 0  # the departed replica's decisions
    got = await local.lookup(OTHER, ["gpu-a"], fleet.now)
    assert got["gpu-a"].pending_blocks == len(OTHER)
    # and the gateway routes by it: read-your-writes over the shared index
    res = await fleet.index.lookup(OTHER, ["gpu-a"], fleet.now, PATIENT_TIMEOUT_S)
    assert res.source == "primary" and res.matches["gpu-a"].pending_blocks == len(OTHER)
    await fleet.index.settle()


@pytest.mark.redis
async def test_a_request_in_flight_when_its_replica_left_recreates_nothing(
    fleet: Fleet,
) -> None:
    """A request sent before its replica was removed ends after: its undo (the engine
    never took it) finds nothing local to undo and makes no entry again."""
    await fleet.join("gpu-b")
    w = fleet.index.add_pending("gpu-b", KEYS, TTL_MS, fleet.now)
    assert w is not None
    await fleet.leave("gpu-b")
    assert await _local_replicas(fleet) == 0
    fleet.index.withdraw(w, fleet.now)
    assert await _local_replicas(fleet) == 0
    assert fleet.index._inflight == {} and fleet.index._local_live == set()
    await fleet.index.settle()


async def test_the_embedded_primary_drops_the_churned_replicas_no_agent_wrote(
    embedded: Fleet,
) -> None:
    """Embedded mode (the primary is an in-process MemoryIndex, no local copy): pending
    writes of discovered replicas made an entry per id there too (500 before). One an
    agent writes (cleared, batches applied) is the agent's: discovery's removal of it
    leaves it (its agent may still write it at its epoch)."""
    primary = embedded.index.primary
    assert isinstance(primary, MemoryIndex)
    for i in range(500):
        rid = f"gpu-{i}"
        await embedded.join(rid)
        embedded.route(rid)
        assert (await primary.stats()).replicas == 1
        await embedded.leave(rid)
    assert (await primary.stats()).replicas == 0
    await embedded.join("agent-fed")
    epoch = await primary.clear_replica("agent-fed", ReplicaState.LIVE, embedded.now)
    await primary.apply("agent-fed", epoch, IndexWrite({KEYS[0]: 1}), embedded.now)
    embedded.route("agent-fed")
    await embedded.leave("agent-fed")
    assert (await primary.replica_blocks("agent-fed")) == {KEYS[0]: 1}
    assert (await primary.meta("agent-fed")).epoch == epoch
    primary.check_invariants()


async def test_forget_frees_a_replicas_entries_through_the_graveyard() -> None:
    """MemoryIndex.forget_replica_now: the stored entries stop counting against the
    bound once freed, the meta and removal log go, and a later write starts at epoch 0."""
    idx = MemoryIndex(max_entries=64)
    epoch = await idx.clear_replica("r", ReplicaState.LIVE, 10)
    await idx.apply("r", epoch, IndexWrite({k: 1 for k in KEYS}), 10)
    await idx.apply("r", epoch, IndexWrite({KEYS[-1]: 0}), 11)  # logged as removed
    assert await idx.removed_since("r", [KEYS[-1]], 11) == [True]  # after the clear (10)
    assert not idx.forget_replica_now("r", unwritten_only=True)  # an agent's
    assert idx.forget_replica_now("r")
    assert not idx.forget_replica_now("r")  # nothing left
    idx.check_invariants()
    stats = await idx.stats()
    assert stats.replicas == 0 and stats.stored_entries == 0
    assert stats.extra["graveyard_entries"] == 0  # freed at once (under a drain step)
    assert await idx.meta("r") == (await MemoryIndex().meta("r"))
    assert await idx.removed_since("r", [KEYS[-1]], 0) == [False]
    await idx.apply("r", 0, IndexWrite({KEYS[0]: 1}), 12)  # a new replica: epoch 0
    assert await idx.replica_blocks("r") == {KEYS[0]: 1}
    idx.check_invariants()


@pytest.mark.redis
async def test_a_gateway_with_discovery_forgets_its_churned_replicas(redis_url: str) -> None:
    """Gateway.start wires Discovery's removal to GatewayIndex.forget: a started gateway
    (shared Redis primary, so a local index) keeps nothing of 50 replicas that came,
    were routed to and went."""
    registry = MemoryRegistry()
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"  # nothing listens: probes fail fast, nothing else
    gw = Gateway(
        GatewaySettings(
            salt_secrets=[SecretStr("x" * 32)], open_access=True, replica_allowlist=[url]
        ),
        parse_policy_text(""),
        index=RedisIndex.from_url(
            redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
        ),
        registry=registry,
    )
    await gw.start()
    try:
        assert gw.discovery is not None and gw.index is not None and gw.pool is not None
        await gw.discovery.stop()  # refreshed by hand, at the test's times
        local = gw.index.local
        assert local is not None
        now = int(time.time() * 1000)
        for i in range(50):
            rid = f"gpu-{i}"
            reg = Registration(
                replica_id=rid, url=url, model="m", block_size=4, capacity_blocks=100,
                agent_id=f"agent-{rid}", registered_ms=now,
            )  # fmt: skip
            await registry.register(reg, 1_000, now_ms=now)
            now += 1
            await gw.discovery.refresh_once(now_ms=now)
            assert gw.pool.get(rid) is not None
            w = gw.index.add_pending(rid, KEYS, TTL_MS, now)
            assert w is not None
            gw.index.done(w)
            assert (await local.stats()).replicas == 1
            now += GRACE_MS + 1_001
            await gw.discovery.refresh_once(now_ms=now)
            assert gw.pool.get(rid) is None
        assert (await local.stats()).replicas == 0
        assert gw.index._local_live == set()
        await gw.index.settle()
    finally:
        await gw.stop()
