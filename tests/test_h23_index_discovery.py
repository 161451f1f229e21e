"""Discovery follows a replica whose agent re-registers it under the same id at another
(allowlisted) URL: its engine moved, and the registration its agent keeps alive never
expires, so the old URL would be routed to until the gateway restarted."""

from __future__ import annotations

import httpx
import pytest

from cachecore.registry import MemoryRegistry, Registration, ReplicaAllowlist
from gateway.discovery import Discovery
from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy


def _reg(rid: str, url: str) -> Registration:
    return Registration(
        replica_id=rid, url=url, model="m", block_size=16, capacity_blocks=100,
        agent_id=f"agent-{rid}", registered_ms=0,
    )  # fmt: skip


async def test_a_replica_re_registered_at_another_url_is_routed_there() -> None:
    registry = MemoryRegistry()
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        allow = ReplicaAllowlist(["http://10.0.0.2:8000", "gpu=http://10.0.0.3:8000"])
        disc = Discovery(registry, allow, pool, set())
        await registry.register(_reg("gpu", "http://10.0.0.2:8000"), 60_000, now_ms=0)
        await disc.refresh_once(now_ms=10)
        rep = pool.get("gpu")
        assert rep is not None and rep.url == "http://10.0.0.2:8000"
        pool.record_failure("gpu", definitive=True)  # the old engine went away
        pool.cordon("gpu")  # the operator's word on the replica
        assert not rep.routable(0.0)
        # its agent re-registers it where the engine runs now (the heartbeat goes on)
        await registry.register(_reg("gpu", "http://10.0.0.3:8000/"), 60_000, now_ms=20)
        for t in range(3):
            await disc.refresh_once(now_ms=30 + t)
        moved = pool.get("gpu")
        assert moved is not None and moved.url == "http://10.0.0.3:8000"
        assert pool.ids() == ["gpu"]
        assert moved.healthy and moved.ejected_until == 0.0  # the old URL's failure is not its
        assert moved.cordoned  # the operator's cordon stays
        pool.cordon("gpu", on=False)
        assert pool.candidates("m") == [moved]
        # spelled differently, the same URL: no move
        await registry.register(_reg("gpu", "HTTP://10.0.0.3:8000"), 60_000, now_ms=40)
        pool.record_failure("gpu", definitive=True)
        await disc.refresh_once(now_ms=50)
        assert pool.get("gpu") is moved and not moved.healthy


async def test_a_move_is_heard_as_the_old_engine_leaving_and_the_new_one_coming() -> None:
    """The gateway checks an engine (block size, tokenizer alignment) again when it hears
    its replica leave service and come back (on_change False, True): a replica that moved
    is another engine. A move of a routable replica to a routable one was silent, so the
    new engine was never checked."""
    registry = MemoryRegistry()
    async with httpx.AsyncClient() as client:
        changes: list[tuple[str, bool]] = []
        pool = ReplicaPool(client, HealthPolicy(), on_change=lambda r, ok: changes.append((r, ok)))
        allow = ReplicaAllowlist(["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
        disc = Discovery(registry, allow, pool, set())
        await registry.register(_reg("gpu", "http://10.0.0.2:8000"), 60_000, now_ms=0)
        await disc.refresh_once(now_ms=10)
        assert changes == []  # a new replica starts routable: nothing to hear
        await registry.register(_reg("gpu", "http://10.0.0.3:8000"), 60_000, now_ms=20)
        await disc.refresh_once(now_ms=30)
        assert changes == [("gpu", False), ("gpu", True)]
        await disc.refresh_once(now_ms=40)
        assert len(changes) == 2


async def test_a_static_replica_keeps_its_declared_url(caplog: pytest.LogCaptureFixture) -> None:
    """Kept, and said once (08bd3cd had dropped the warning with the old branch)."""
    registry = MemoryRegistry()
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        pool.add(ReplicaSpec("static-1", "http://10.0.0.1:8000"))
        allow = ReplicaAllowlist(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
        disc = Discovery(registry, allow, pool, {"static-1"})
        await registry.register(_reg("static-1", "http://10.0.0.2:8000"), 60_000, now_ms=0)
        caplog.set_level("WARNING", logger="gateway.discovery")
        for t in (10, 20, 30):
            await disc.refresh_once(now_ms=t)
        rep = pool.get("static-1")
        assert rep is not None and rep.url == "http://10.0.0.1:8000"
        said = [r for r in caplog.records if "static replica registered at another" in r.msg]
        assert len(said) == 1 and said[0].__dict__["url"] == "http://10.0.0.2:8000"


async def test_a_cordon_outlives_a_gap_in_the_registration() -> None:
    """Registrations gone for longer than discovery's removal grace (a Redis outage, the
    agents unable to heartbeat): discovery removes every discovered replica meanwhile and
    adds it back after. The operator's cordon of one was lost on the way, and the replica
    under maintenance took traffic."""
    registry = MemoryRegistry()
    async with httpx.AsyncClient() as client:
        changes: list[tuple[str, bool]] = []
        pool = ReplicaPool(client, HealthPolicy(), on_change=lambda r, ok: changes.append((r, ok)))
        allow = ReplicaAllowlist(["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
        added: list[str] = []
        disc = Discovery(registry, allow, pool, set(), on_added=lambda sp: added.append(sp.id))
        for rid, url in (("kept", "http://10.0.0.2:8000"), ("free", "http://10.0.0.3:8000")):
            await registry.register(_reg(rid, url), 1_000, now_ms=0)
        await disc.refresh_once(now_ms=10)
        pool.cordon("kept")
        assert changes == [("kept", False)]
        await disc.refresh_once(now_ms=6_000)  # the registrations are gone, past the grace
        assert pool.ids() == []
        for rid, url in (("kept", "http://10.0.0.2:8000"), ("free", "http://10.0.0.3:8000")):
            await registry.register(_reg(rid, url), 10_000, now_ms=7_000)
        await disc.refresh_once(now_ms=7_010)
        kept, free = pool.get("kept"), pool.get("free")
        assert kept is not None and free is not None
        assert kept.cordoned and not free.cordoned
        assert pool.candidates("m") == [free]
        # told after on_added (which marks a new replica healthy): the cordon is the news
        assert changes == [("kept", False), ("kept", False)]
        assert added == ["free", "kept", "free", "kept"]
        pool.cordon("kept", on=False)
        assert sorted(r.id for r in pool.candidates("m")) == ["free", "kept"]
        pool.remove("kept")
        pool.add(ReplicaSpec("kept", "http://10.0.0.2:8000"))
        assert not pool.get("kept").cordoned  # type: ignore[union-attr]


async def test_a_registry_that_lost_every_registration_for_a_heartbeat_empties_no_pool() -> None:
    """A Redis restart: every registration is gone until the agents' next heartbeat (2 s).
    Discovery removed every discovered replica at its next refresh, so a fleet of
    discovered replicas answered 503 no_replica until the refresh after the heartbeats;
    now a replica is removed only when the last read that had it is removal_grace_s old."""
    registry = MemoryRegistry()
    async with httpx.AsyncClient() as client:
        changes: list[tuple[str, bool]] = []
        pool = ReplicaPool(client, HealthPolicy(), on_change=lambda r, ok: changes.append((r, ok)))
        allow = ReplicaAllowlist(["http://10.0.0.2:8000", "http://10.0.0.3:8000"])
        disc = Discovery(registry, allow, pool, set(), removal_grace_s=5.0)
        regs = (("a", "http://10.0.0.2:8000"), ("b", "http://10.0.0.3:8000"))
        for rid, url in regs:
            await registry.register(_reg(rid, url), 10_000, now_ms=0)
        await disc.refresh_once(now_ms=10)
        before = list(changes)
        lost = MemoryRegistry()  # the restarted Redis: empty
        disc.registry = lost
        await disc.refresh_once(now_ms=2_010)
        assert sorted(r.id for r in pool.candidates("m")) == ["a", "b"]
        for rid, url in regs:  # the agents' heartbeats re-register
            await lost.register(_reg(rid, url), 10_000, now_ms=3_000)
        await disc.refresh_once(now_ms=4_010)
        assert sorted(r.id for r in pool.candidates("m")) == ["a", "b"]
        assert changes == before  # never out of service
        await lost.deregister("b", "agent-b")  # b's agent stops for good
        await disc.refresh_once(now_ms=6_010)
        assert sorted(pool.ids()) == ["a", "b"]  # b last seen at 4,010: 2 s ago
        await disc.refresh_once(now_ms=9_010)
        assert pool.ids() == ["a"]
