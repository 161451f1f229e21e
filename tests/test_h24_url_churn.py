"""What the gateway keeps per replica URL goes with the URL's last replica.

``ReplicaPool._dp_groups`` (a data-parallel engine's ranks), ``ReplicaPool._shared_warned``
(URLs shared without data-parallel ids, warned once) and Discovery's ``_static_elsewhere``
(a static replica's registrations at other URLs, warned once) were keyed by URL and never
shrank: autoscaled replicas come back at new pod IPs, so they grew by one entry per URL
ever seen. A data-parallel engine's ranks share one URL: its entry goes with the last.

Real pieces: a started gateway on loopback with discovery over the in-process
MemoryRegistry (tests/test_h24_departed_state's fleet: fake engines as raw asyncio
servers), a real ReplicaPool and Discovery for the static replica. The churned URLs are
loopback addresses nothing listens on (their health probes fail; routing is not tested)."""

from __future__ import annotations

import httpx
import pytest

from cachecore.index.layout import split_dp_replica_id
from cachecore.registry import MemoryRegistry, Registration, ReplicaAllowlist
from gateway.discovery import Discovery
from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy
from tests.test_h24_departed_state import Fleet, fleet
from tests.test_upstream_faults import MODEL

pytestmark = pytest.mark.timeout(120)

PAIRS = 25  # of each kind: 50 URLs, 100 replicas
DP_URLS = [f"http://127.0.0.{2 + i}:9" for i in range(PAIRS)]
SHARED_URLS = [f"http://127.0.0.{2 + PAIRS + i}:9" for i in range(PAIRS)]


async def _join(f: Fleet, rid: str, url: str) -> None:
    """Fleet.join, with the rank an agent registers a data-parallel rank with."""
    reg = Registration(
        replica_id=rid, url=url, model=MODEL, block_size=f.block_size, capacity_blocks=100,
        agent_id=f"agent-{rid}", registered_ms=f.now, dp_rank=split_dp_replica_id(rid)[1],
    )  # fmt: skip
    await f.registry.register(reg, 1_000, now_ms=f.now)
    f.now += 1
    assert f.gw.discovery is not None and f.gw.pool is not None
    await f.gw.discovery.refresh_once(now_ms=f.now)
    assert f.gw.pool.get(rid) is not None


async def test_churned_urls_leave_no_per_url_state() -> None:
    """25 data-parallel engines (R, R@dp1 at one URL) and 25 URLs shared by two replicas
    whose ids are not one engine's ranks (x, y@dp1), each discovered and removed: nothing
    of their URLs is left (before: 25 rank groups and 25 warned URLs)."""
    async with fleet("", *DP_URLS, *SHARED_URLS) as f:
        pool = f.gw.pool
        assert pool is not None
        for i in range(PAIRS):
            await _join(f, f"eng{i}", DP_URLS[i])
            await _join(f, f"eng{i}@dp1", DP_URLS[i])
            dp = pool.get(f"eng{i}@dp1")
            assert dp is not None and dp.dp_rank == 1
            assert pool._url_key(dp) in pool._dp_groups
            await _join(f, f"x{i}", SHARED_URLS[i])
            await _join(f, f"y{i}@dp1", SHARED_URLS[i])
            assert len(pool._shared_warned) == 1  # said, once
            await f.leave(f"eng{i}")
            assert pool.get(f"eng{i}@dp1") is None and pool.get(f"y{i}@dp1") is None
        live = {pool._url_key(r) for r in pool.all()}
        assert set(pool._dp_groups) <= live, sorted(pool._dp_groups)[:3]
        assert pool._shared_warned == set()
        assert len(pool._dp_groups) == 0


async def test_a_data_parallel_engines_ranks_stay_while_one_of_them_remains() -> None:
    """Its rank numbering is the URL's until the last rank goes (then forgotten)."""
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        url = "http://10.0.0.1:8000"
        pool.add(ReplicaSpec("R@dp2", url))
        pool.add(ReplicaSpec("R@dp3", url))
        pool.remove("R@dp3")
        lone = pool.get("R@dp2")
        assert lone is not None and lone.dp_rank == 0  # rank 2 counted from 2
        assert len(pool._dp_groups) == 1
        pool.add(ReplicaSpec("R@dp3", url))  # back: still counted from 2
        back = pool.get("R@dp3")
        assert back is not None and back.dp_rank == 1
        pool.remove("R@dp2")
        pool.remove("R@dp3")
        assert pool._dp_groups == {}
        pool.add(ReplicaSpec("x", url))  # a shared URL warned of, then freed
        pool.add(ReplicaSpec("y", url))
        assert len(pool._shared_warned) == 1
        pool.remove("x")
        assert len(pool._shared_warned) == 1  # y is still there
        pool.remove("y")
        assert pool._shared_warned == set()


def _reg(rid: str, url: str) -> Registration:
    return Registration(
        replica_id=rid, url=url, model="m", block_size=16, capacity_blocks=100,
        agent_id=f"agent-{rid}", registered_ms=0,
    )  # fmt: skip


async def test_a_static_replica_registered_at_churning_urls_keeps_one_entry(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A static replica whose agent registers it at 50 pod IPs in turn: each is said once,
    one entry is kept (before: 50), none once it is back at its URL or its registration
    expired."""
    registry = MemoryRegistry()
    declared = "http://10.0.0.1:8000"
    elsewhere = [f"http://10.1.0.{i}:8000" for i in range(50)]
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        pool.add(ReplicaSpec("static-1", declared))
        disc = Discovery(registry, ReplicaAllowlist([declared, *elsewhere]), pool, {"static-1"})
        caplog.set_level("WARNING", logger="gateway.discovery")
        t = 0
        for url in elsewhere:
            await registry.register(_reg("static-1", url), 60_000, now_ms=t)
            for _ in range(2):  # a second refresh at the same URL says nothing
                t += 10
                await disc.refresh_once(now_ms=t)
            assert disc._static_elsewhere == {"static-1": url}
        said = [r for r in caplog.records if "static replica registered at another" in r.msg]
        assert [r.__dict__["url"] for r in said] == elsewhere
        rep = pool.get("static-1")
        assert rep is not None and rep.url == declared
        await registry.register(_reg("static-1", declared), 60_000, now_ms=t)
        await disc.refresh_once(now_ms=t + 10)
        assert disc._static_elsewhere == {}  # back where it was declared
        await registry.register(_reg("static-1", elsewhere[0]), 1_000, now_ms=t + 20)
        await disc.refresh_once(now_ms=t + 30)
        assert disc._static_elsewhere == {"static-1": elsewhere[0]}
        await disc.refresh_once(now_ms=t + 30 + 1_000 + disc.removal_grace_ms + 1)
        assert disc._static_elsewhere == {} and pool.get("static-1") is not None
