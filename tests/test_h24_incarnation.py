"""A probe or a claim check that was out when its replica left and came back under the same
id (a pod keeping its name), or moved to another URL, is not applied to the replica there
now. They were judged by the id alone: the old incarnation's late probe reported its
routability for the new one (its healthy series set from the old object), a probe of the
old URL judged the moved replica, and an old claim check quarantined the new engine (the
reviewer's demonstration: quarantined on the old incarnation's claims)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKeyer, Scope, ScopeKind
from cachecore.lifecycle import IndexWrite
from gateway.core import Dispatch
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.routing import Decision, Strategy
from policies.schema import HealthPolicy
from tests.test_h24_departed_state import fleet
from tests.test_upstream import server
from tests.test_upstream_faults import MODEL

pytestmark = pytest.mark.timeout(60)


async def slow_failing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers 503 after 0.3 s (a probe that is out for a while, then fails)."""
    await reader.readuntil(b"\r\n\r\n")
    await asyncio.sleep(0.3)
    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
    await writer.drain()


async def test_a_late_probe_of_an_old_incarnation_leaves_the_new_one_alone() -> None:
    async with server(slow_failing) as (url, _), httpx.AsyncClient() as client:
        heard: list[tuple[str, bool]] = []
        pool = ReplicaPool(client, HealthPolicy(), on_change=lambda r, ok: heard.append((r, ok)))
        pool.add(ReplicaSpec("vllm-0", url))
        round_ = asyncio.ensure_future(pool.check_once())
        await asyncio.sleep(0.1)  # the probe is out (answered at 0.3 s)
        pool.remove("vllm-0")
        new = pool.add(ReplicaSpec("vllm-0", url))  # back under its name
        await round_
        assert new.healthy and new.health_fails == 0
        assert heard == []  # before: ("vllm-0", False) from the old object


async def test_a_probe_of_the_old_url_does_not_judge_a_moved_replica() -> None:
    async with (
        server(slow_failing) as (old_url, _),
        server(slow_failing) as (new_url, _),
        httpx.AsyncClient() as client,
    ):
        pool = ReplicaPool(client, HealthPolicy())
        rep = pool.add(ReplicaSpec("vllm-0", old_url))
        round_ = asyncio.ensure_future(pool.check_once())
        await asyncio.sleep(0.1)
        pool.move("vllm-0", new_url)  # its agent re-registered it elsewhere
        await round_
        assert rep.healthy and rep.health_fails == 0  # before: unhealthy by the old URL


async def test_an_old_incarnations_claim_check_does_not_quarantine_the_new_one() -> None:
    async with fleet("quarantine: {settle_s: 0.3, k: 1, m: 1}") as f:
        gw = f.gw
        assert gw.pool is not None and gw.index is not None
        primary = gw.index.primary
        assert isinstance(primary, MemoryIndex)
        await f.join("gpu-q", f.churn.url)
        bs = f.block_size
        keys = BlockKeyer(bs).keys(list(range(bs * 4)), "kvg1:t", MODEL)
        epoch = await primary.clear_replica("gpu-q", ReplicaState.LIVE, f.now)
        await primary.apply("gpu-q", epoch, IndexWrite(dict.fromkeys(keys, 1)), f.now)
        d = Dispatch(
            request_id="r1", tenant="t", endpoint="completion", path="/v1/completions",
            body={}, stream=False, client_wants_usage=False, model=MODEL,
            prompt_tokens=bs * 4, block_size=bs, scope=Scope(ScopeKind.TENANT, "t"),
            salts=["s"], keys=[keys], matches=[{}], index_source="primary", candidates=[],
            decision=Decision("gpu-q", Strategy.EXPECTED_LATENCY, "test", ()),
            lookup_ms=int(time.time() * 1000),
            target=gw.pool.get("gpu-q"),  # as the proxy sets it for the attempt
        )  # fmt: skip
        # the engine reported none of the 4 claimed blocks: a false claim, once settled
        check = gw.spawn(gw._recheck(d, 4, 0))
        await asyncio.sleep(0.05)  # settling (settle_s 0.3)
        await f.leave("gpu-q")  # the old incarnation removed for good
        await f.join("gpu-q", f.churn.url)  # a new engine under the same id
        await asyncio.wait_for(check, 30)
        assert not gw.quarantine.is_quarantined("gpu-q")
