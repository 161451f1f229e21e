"""Data-parallel engines behind one URL (vLLM's internal load balancing): the replicas
``R`` and ``R@dpN`` share the URL, each rank has its own KV cache and event stream, and the
gateway names the rank it chose in ``X-data-parallel-rank`` so the request runs on the
cache the index matched. The engine here is two simulated replicas behind a front that
does what vLLM's API server does with the header: the named rank, else its own balancing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from pydantic import SecretStr

from cachecore.agent.scrape import parse_metrics
from cachecore.index.layout import dp_replica_id, split_dp_replica_id
from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.testing import free_port
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import HealthPolicy
from tests.test_gateway_support import FAST, SECRET, words

pytestmark = pytest.mark.timeout(90)


@contextlib.asynccontextmanager
async def dp_front(fleet: Fleet, seen: list[int | None]) -> AsyncIterator[str]:
    """One HTTP endpoint for the fleet's replicas as the ranks of one engine. ``seen``
    gets the rank each completion request named (None: none named)."""
    app = FastAPI()
    client = httpx.AsyncClient(timeout=30.0)
    rng = random.Random(5)  # the engine's own balancing, blind to caches

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        named = request.headers.get("x-data-parallel-rank")
        rank = int(named) if named is not None else None
        if path.startswith("v1/") and path.endswith("completions"):
            seen.append(rank)
        if rank is None:
            rank = 0 if request.method == "GET" else rng.randrange(len(fleet.endpoints))
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        url = f"{fleet.endpoints[rank].url}/{path}"
        r = await client.request(request.method, url, content=body, headers=headers)
        keep = {k: v for k, v in r.headers.items() if k.lower() == "content-type"}
        return Response(r.content, r.status_code, keep)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        await client.aclose()


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
    seen: list[int | None] = []
    async with run_fleet(FAST, count=2) as fleet, dp_front(fleet, seen) as front:
        e0, e1 = fleet.endpoints
        gs = GatewaySettings(
            replicas=[
                f"R={front}={e0.events_endpoint},{e0.replay_endpoint}",
                f"R@dp1={front}={e1.events_endpoint},{e1.replay_endpoint}",
            ],
            port=free_port(),
            salt_secrets=[SecretStr(SECRET)],
            open_access=True,
            seed=3,
        )
        gw = build_gateway(gs)
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url) as h:
            assert gw.pool is not None
            assert [gw.pool.get(r).dp_rank for r in ("R", "R@dp1")] == [0, 1]  # type: ignore[union-attr]
            served: list[str] = []
            predicted = actual = prompt = 0
            for round_ in range(3):
                for prefix in range(4):
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
            # every request named the rank of the replica the gateway chose
            assert seen == [split_dp_replica_id(rid)[1] or 0 for rid in served]
            assert set(served) == {"R", "R@dp1"}  # the four prefixes spread over both
            # the repeats hit on their rank: the predictions are the engines' own counts
            assert actual > 0.6 * prompt
            assert abs(predicted - actual) <= 0.03 * prompt
