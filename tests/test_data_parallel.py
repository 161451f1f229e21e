"""Data-parallel engines behind one URL (vLLM's internal load balancing): the replicas
``R`` and ``R@dpN`` share the URL, each rank has its own KV cache and event stream, and the
gateway names the rank it chose in ``X-data-parallel-rank`` so the request runs on the
cache the index matched. The engine is a simulated data-parallel replica
(``kvgate replica --data-parallel-size 2``: two engine cores behind one port that, like
vLLM's API server, run a request on the named core, else on the least loaded)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.agent.scrape import parse_metrics
from cachecore.index.layout import dp_replica_id, split_dp_replica_id
from cachecore.replica.dp import DataParallelFront
from cachecore.replica.fleet import run_fleet
from cachecore.testing import free_port
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import HealthPolicy
from tests.test_gateway_support import FAST, SECRET, words

pytestmark = pytest.mark.timeout(90)

RANK = "x-data-parallel-rank"


def test_split_dp_replica_id_inverts_dp_replica_id() -> None:
    for name in ("R", "a.b-c", "x@dp1"):
        for rank in (1, 2, 17, 1023):
            assert split_dp_replica_id(dp_replica_id(name, rank)) == (name, rank)
    assert split_dp_replica_id("R") == ("R", None)
    assert split_dp_replica_id("R@dp0") == ("R", 0)
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
        assert pool.get("R") is a and [r.dp_rank for r in pool.all()] == [None, None]
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
        assert snap.for_core(1).prompt_tokens == 64 + 16 and snap.for_core(0).prompt_tokens == 64
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
