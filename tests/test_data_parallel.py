"""Data-parallel engines behind one URL (vLLM's internal load balancing): the replicas
``R`` and ``R@dpN`` share the URL, each rank has its own KV cache and event stream, and the
gateway names the rank it chose in ``X-data-parallel-rank`` so the request runs on the
cache the index matched. The engine is a simulated data-parallel replica
(``kvgate replica --data-parallel-size 2``: two engine cores behind one port that, like
vLLM's API server, run a request on the named core, else on the least loaded)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.agent.embedded import build_embedded_agents
from cachecore.agent.scrape import parse_metrics
from cachecore.index.layout import dp_replica_id, split_dp_replica_id
from cachecore.index.memory import MemoryIndex
from cachecore.registry import MemoryRegistry, Registration, ReplicaAllowlist
from cachecore.replica.dp import DataParallelFront
from cachecore.replica.fleet import run_fleet
from cachecore.testing import free_port
from gateway.discovery import Discovery
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import HealthPolicy
from tests.test_gateway_support import FAST, SECRET, kill_replica, words

pytestmark = pytest.mark.timeout(90)

RANK = "x-data-parallel-rank"


def test_split_dp_replica_id_inverts_dp_replica_id() -> None:
    for name in ("R", "a.b-c", "x@dp1"):
        for rank in (1, 2, 17, 1023):
            assert split_dp_replica_id(dp_replica_id(name, rank)) == (name, rank)
    assert split_dp_replica_id("R") == ("R", None)
    assert split_dp_replica_id("R@dp0") == ("R@dp0", None)  # rank 0 is R itself
    assert split_dp_replica_id("R@dp01") == ("R@dp01", None)  # not an id the agent makes
    assert split_dp_replica_id("@dp1") == ("@dp1", None)


async def test_replicas_sharing_a_url_get_ranks_only_under_dp_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.replicas")
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        a = pool.add(ReplicaSpec("R", "http://h:8000"))
        assert a.dp_rank is None  # its own URL: nothing to name
        b = pool.add(ReplicaSpec("R@dp1", "http://h:8000/"))
        c = pool.add(ReplicaSpec("R@dp2", "http://H:8000"))
        other = pool.add(ReplicaSpec("S@dp1", "http://h:8001"))
        assert [r.dp_rank for r in (a, b, c, other)] == [0, 1, 2, None]
        assert "data-parallel ranks behind one URL" in caplog.text
        assert pool.get("R@dp2") is c and c.state(0.0)["dp_rank"] == 2
        pool.remove("R@dp1")
        pool.remove("R@dp2")
        # the URL is a data-parallel server's: R stays its rank 0 while the others are gone
        assert pool.get("R") is a and [r.dp_rank for r in pool.all()] == [0, None]
        # two names at one URL are one engine's cache, not ranks: no header, and a warning
        x = pool.add(ReplicaSpec("x", "http://h:9000"))
        y = pool.add(ReplicaSpec("y", "http://h:9000"))
        assert x.dp_rank is None and y.dp_rank is None
        assert "share one URL without data-parallel ids" in caplog.text


def test_a_rank_agent_reads_its_own_core_from_a_data_parallel_servers_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 3',
            'vllm:num_requests_running{engine="1",model_name="m"} 1',
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting{engine="0",model_name="m"} 5',
            'vllm:num_requests_waiting{engine="1",model_name="m"} 0',
            "# TYPE vllm:prompt_tokens counter",
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 100',
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 40',
        ]
    )
    snap = parse_metrics(text)
    assert (snap.running, snap.waiting, snap.prompt_tokens) == (4, 5, 140)
    one = snap.for_core(1)
    assert (one.running, one.waiting, one.prompt_tokens) == (1, 0, 40)
    assert one.engines == {}
    zero = snap.for_core(0)
    assert (zero.running, zero.waiting, zero.prompt_tokens) == (3, 5, 100)
    assert snap.for_core(None) is snap and snap.for_core(7) is snap  # no such core


def test_a_rank_agent_reads_its_own_rank_from_sglangs_metrics() -> None:
    """SGLang labels each attention-DP rank's series ``dp_rank`` (and each tensor-parallel
    rank ``tp_rank``: the largest value of a DP rank's TP ranks counts once)."""
    text = "\n".join(
        [
            "# TYPE sglang:num_running_reqs gauge",
            'sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="0"} 2',
            'sglang:num_running_reqs{dp_rank="0",model_name="m",tp_rank="1"} 2',
            'sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 6',
            "# TYPE sglang:num_queue_reqs gauge",
            'sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 1',
            'sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="0"} 4',
        ]
    )
    snap = parse_metrics(text)
    assert (snap.running, snap.waiting) == (8, 5)
    assert (snap.for_core(1).running, snap.for_core(1).waiting) == (6, 4)
    assert (snap.for_core(0).running, snap.for_core(0).waiting) == (2, 1)
    assert snap.engines == {}  # SGLang's ranks are not judged for stalls (no counters)
    one_rank = parse_metrics('sglang:num_running_reqs{dp_rank="0",model_name="m"} 3\n')
    assert one_rank.for_core(0) is one_rank


async def test_each_request_runs_on_the_rank_whose_cache_the_index_matched() -> None:
    dp2 = FAST.model_copy(update={"data_parallel_size": 2})
    async with run_fleet(dp2, count=1) as fleet:
        e0, e1 = fleet.endpoints
        assert e0.url == e1.url and (e0.dp_rank, e1.dp_rank) == (0, 1)
        gs = GatewaySettings(
            replicas=[
                f"R={e0.url}={e0.events_endpoint},{e0.replay_endpoint}",
                f"R@dp1={e1.url}={e1.events_endpoint},{e1.replay_endpoint}",
            ],
            port=free_port(),
            salt_secrets=[SecretStr(SECRET)],
            open_access=True,
            seed=3,
        )
        gw = build_gateway(gs)
        front = fleet.fronts[0]
        assert isinstance(front, DataParallelFront)
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url) as h:
            assert gw.pool is not None
            assert [gw.pool.get(r).dp_rank for r in ("R", "R@dp1")] == [0, 1]  # type: ignore[union-attr]
            before = list(front.requests_by_rank)  # the start-up tokenizer probe
            served: list[str] = []
            predicted = actual = prompt = 0
            # three prefixes on two cores: a balancer taking turns moves each one every round
            for round_ in range(3):
                for prefix in range(3):
                    body: dict[str, Any] = {
                        "model": e0.model,
                        "prompt": words(640, prefix) + words(16, 100 * round_ + prefix),
                        "max_tokens": 1,
                    }
                    r = await h.post("/v1/completions", json=body, timeout=30.0)
                    assert r.status_code == 200, r.text
                    served.append(r.headers["x-kvgate-replica"])
                    predicted += int(r.headers["x-kvgate-predicted-cached-tokens"])
                    usage = r.json()["usage"]
                    actual += usage["prompt_tokens_details"]["cached_tokens"]
                    prompt += usage["prompt_tokens"]
                    await asyncio.sleep(0.15)  # its KV events reach the index
            routed = [n - b for n, b in zip(front.requests_by_rank, before, strict=True)]
            assert routed == [served.count("R"), served.count("R@dp1")]
            assert set(served) == {"R", "R@dp1"}  # the prefixes spread over both cores
            # the repeats hit on their core: the predictions are the engines' own counts
            assert actual >= 0.6 * prompt
            assert abs(predicted - actual) <= 0.03 * prompt


async def test_the_data_parallel_replica_serves_its_cores_as_vllm_does() -> None:
    dp2 = FAST.model_copy(update={"data_parallel_size": 2})
    async with run_fleet(dp2, count=1) as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as h:
        body = {"model": fleet.endpoints[0].model, "prompt": words(64, 1), "max_tokens": 1}
        for rank in (1, 1, 0):
            r = await h.post("/v1/completions", json=body, headers={RANK: str(rank)})
            assert r.status_code == 200, r.text
        front = fleet.fronts[0]
        assert isinstance(front, DataParallelFront)
        assert front.requests_by_rank == [1, 2]
        # the second request on core 1 hit its cache; core 0 had not seen the prompt
        stats = [rep.core.stats() for rep in fleet.replicas]
        assert [s.prefix_cache_hits for s in stats] == [0, 48]
        for bad in ("2", "-1", "x"):
            r = await h.post("/v1/completions", json=body, headers={RANK: bad})
            assert r.status_code == 400 and "X-data-parallel-rank" in r.text
        # one exposition, each core's series labelled engine="N": a rank's agent reads its own
        snap = parse_metrics((await h.get("/metrics")).text)
        assert set(snap.engines) == {"0", "1"}
        # whole prompts, as vLLM counts them (core 1: two, the second one a 48-token hit)
        assert snap.for_core(1).prompt_tokens == 2 * 64 and snap.for_core(0).prompt_tokens == 64
        loads = (await h.get("/get_load")).json()
        assert [x["dp_rank"] for x in loads] == [0, 1]
        # a flush resets every core
        assert (await h.post("/flush_cache")).status_code == 200
        r = await h.post("/v1/completions", json=body, headers={RANK: "1"})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # without a header, the least loaded core (idle: in turn)
        for _ in range(4):
            assert (await h.post("/v1/completions", json=body)).status_code == 200
        assert front.requests_by_rank == [3, 5]
        info = (await h.get("/get_server_info")).json()
        assert info["dp_size"] == 2


# ------------------------------------------------------------------ review cases


def _reg(rid: str, url: str, dp: int | None) -> Registration:
    return Registration(
        replica_id=rid, url=url, model="m", block_size=16, capacity_blocks=100,
        dp_rank=dp, agent_id=f"agent-{rid}", registered_ms=0,
    )  # fmt: skip


async def test_ranks_group_by_the_normalized_url_and_count_from_the_servers_lowest() -> None:
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        a = pool.add(ReplicaSpec("R", "http://engine"))
        b = pool.add(ReplicaSpec("R@dp1", "http://ENGINE:80/"))
        assert [a.dp_rank, b.dp_rank] == [0, 1]  # one server, the default port spelled out
        # vLLM's hybrid balancing: node 1's API server numbers its engines (global ranks 2
        # and 3, as its agents name them) from 0
        c = pool.add(ReplicaSpec("R@dp2", "http://node1:8000"))
        d = pool.add(ReplicaSpec("R@dp3", "http://node1:8000"))
        assert [c.dp_rank, d.dp_rank] == [0, 1]
        # R@dp0 is not an id an agent makes for a rank (rank 0 is R): two engines' names
        e = pool.add(ReplicaSpec("R@dp0", "http://node2:8000"))
        f = pool.add(ReplicaSpec("Q@dp1", "http://node2:8000"))
        assert [e.dp_rank, f.dp_rank] == [None, None]


def test_an_embedded_agent_for_an_id_that_is_not_a_rank_indexes_under_it() -> None:
    specs = [
        ReplicaSpec("R@dp0", "http://h:8000", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
        ReplicaSpec("R@dp1", "http://h:8000", "tcp://127.0.0.1:3", "tcp://127.0.0.1:4"),
        ReplicaSpec("S", "http://h:8001", "tcp://127.0.0.1:5", "tcp://127.0.0.1:6"),
    ]
    group = build_embedded_agents(specs, MemoryIndex(), None, None)
    try:
        assert [a.primary_id for a in group.agents] == ["R@dp0", "R@dp1", "S"]
        assert [a.settings.data_parallel_rank for a in group.agents] == [None, 1, None]
    finally:
        group.ctx.destroy(linger=0)


def test_a_rank_reads_its_own_kv_usage() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 3',
            'vllm:num_requests_running{engine="1",model_name="m"} 0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.95',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.05',
        ]
    )
    snap = parse_metrics(text)
    assert snap.kv_usage == 0.95
    assert snap.for_core(1).kv_usage == 0.05 and snap.for_core(0).kv_usage == 0.95


async def test_discovery_admits_the_ranks_of_a_pinned_engine() -> None:
    """A static ``R`` pins its URL to engine R: its ranks' registrations are admitted,
    another engine's id at that URL is not, nor an id whose rank is not its registration's."""
    url = "http://10.0.0.1:8000"
    for static in (["R"], ["R", "R@dp1"]):
        registry = MemoryRegistry()
        async with httpx.AsyncClient() as client:
            pool = ReplicaPool(client, HealthPolicy())
            for rid in static:
                pool.add(ReplicaSpec(rid, url))
            allow = ReplicaAllowlist([f"{rid}={url}" for rid in static])  # as the gateway pins
            disc = Discovery(registry, allow, pool, set(static))
            for rid, rank in (("R", 0), ("R@dp1", 1), ("R@dp2", 2)):
                await registry.register(_reg(rid, url, rank), 60_000, now_ms=0)
            await registry.register(_reg("X", url, 3), 60_000, now_ms=0)
            await registry.register(_reg("R@dp4", url, 5), 60_000, now_ms=0)
            await disc.refresh_once(now_ms=10)
            assert sorted(pool.ids()) == ["R", "R@dp1", "R@dp2"], static
            assert [pool.get(r).dp_rank for r in ("R", "R@dp1", "R@dp2")] == [0, 1, 2]  # type: ignore[union-attr]
            assert disc.rejected == 2


async def test_a_rank_keeps_its_header_while_a_sibling_agent_restarts() -> None:
    registry = MemoryRegistry()
    url = "http://10.0.0.1:8000"
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        disc = Discovery(registry, ReplicaAllowlist([url]), pool, set())
        await registry.register(_reg("R", url, 0), 60_000, now_ms=0)
        await registry.register(_reg("R@dp1", url, 1), 60_000, now_ms=0)
        await disc.refresh_once(now_ms=10)
        assert [pool.get(r).dp_rank for r in ("R", "R@dp1")] == [0, 1]  # type: ignore[union-attr]
        await registry.deregister("R", "agent-R")  # its agent stops (a rolling restart)
        await disc.refresh_once(now_ms=20)  # within discovery's removal grace: kept
        assert sorted(pool.ids()) == ["R", "R@dp1"]
        await disc.refresh_once(now_ms=5_010)
        assert pool.ids() == ["R@dp1"] and pool.get("R@dp1").dp_rank == 1  # type: ignore[union-attr]
        # a lone R@dpN at a URL never seen with its siblings is a server of its own
        lone = pool.add(ReplicaSpec("T@dp3", "http://10.0.0.2:8000"))
        assert lone.dp_rank is None


@pytest.mark.parametrize("seed", range(3))
async def test_a_dead_data_parallel_server_is_left_whole(seed: int) -> None:
    """A refused connection is the server's: every rank behind the URL is ejected, so the
    retry goes to another server, not to a sibling rank on the same closed port."""
    async with run_fleet(FAST, count=2) as fleet:
        e0, e1 = fleet.endpoints
        gs = GatewaySettings(
            replicas=[f"R={e0.url}", f"R@dp1={e0.url}", f"R@dp2={e0.url}",
                      f"R@dp3={e0.url}", f"S={e1.url}"],
            port=free_port(), salt_secrets=[SecretStr(SECRET)], open_access=True, seed=seed,
        )  # fmt: skip
        gw = build_gateway(gs)
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url) as h:
            assert gw.pool is not None
            assert [r.dp_rank for r in gw.pool.all()] == [0, 1, 2, 3, None]
            await kill_replica(fleet, 0)
            statuses = []
            for i in range(6):
                body = {"model": e1.model, "prompt": words(64, 1000 + i), "max_tokens": 1}
                r = await h.post("/v1/completions", json=body, timeout=30.0)
                statuses.append(r.status_code)
            assert statuses == [200] * 6, statuses
            assert not any(r.routable(time.monotonic()) for r in gw.pool.all()[:4])
