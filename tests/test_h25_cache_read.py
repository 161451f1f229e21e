"""Requests an engine serves without reading its prefix cache (vLLM: prompt logprobs, asked
directly or through ``echo``), and the gateway's /health, which answers anyone.

vLLM computes every prompt token of such a request and reports ``cached_tokens`` 0 while
the replica holds the prefix. Judged as a claim, three of them quarantined an honest
replica for every tenant; charged as a hit, they passed the uncached-token budget that
bounds flooding while the engine computed whole prompts."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from cachecore.cacheread import body_reads_prefix_cache
from cachecore.engine import EngineRequest
from cachecore.replica.settings import ReplicaSettings
from gateway.auth import KeyStore, hash_key
from tests.test_engine import engine, outputs, run, toks
from tests.test_gateway_faults import claim_checks
from tests.test_gateway_support import ADMIN, stack, words

pytestmark = pytest.mark.timeout(120)

KEYS = {"sk-a": "a", "sk-b": "b"}


def key_store() -> KeyStore:
    return KeyStore({hash_key(k): t for k, t in KEYS.items()})


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("body", "chat", "reads"),
    [
        ({}, True, True),
        ({}, False, True),
        ({"prompt_logprobs": 0}, True, False),
        ({"prompt_logprobs": 1}, False, False),
        ({"prompt_logprobs": None}, False, True),
        # vLLM: a chat's echo takes top_logprobs, 0 when absent; a completion's takes logprobs
        ({"echo": True}, True, False),
        ({"echo": True, "top_logprobs": None}, True, True),
        ({"echo": True}, False, True),
        ({"echo": True, "logprobs": 0}, False, False),
        ({"echo": "true", "logprobs": 2}, False, False),  # a lax bool, as pydantic reads it
        ({"echo": False, "logprobs": 2}, False, True),
        ({"echo": "maybe", "logprobs": 2}, False, True),  # refused by the engine: no prefill
    ],
)  # fmt: skip
def test_which_bodies_read_the_prefix_cache(body: dict[str, Any], chat: bool, reads: bool) -> None:
    assert body_reads_prefix_cache(body, chat) is reads


def test_the_engine_reads_no_cache_for_prompt_logprobs_but_caches_its_blocks() -> None:
    """vLLM's get_computed_blocks returns no hit and records no prefix-cache query for a
    request that skips reading; its blocks are cached all the same."""
    core = engine(block_size=16)
    prompt = toks(64)
    core.add_request(EngineRequest("warm", prompt, max_tokens=1), 0.0)
    _, now = run(core)
    queries = core.kv.prefix_stats.queries
    core.add_request(
        EngineRequest("logprobs", prompt, max_tokens=1, skip_reading_prefix_cache=True), now
    )
    steps, now = run(core, now)
    assert outputs(steps)["logprobs"][-1].num_cached_tokens == 0
    assert core.kv.prefix_stats.queries == queries  # not counted, as vLLM
    core.add_request(EngineRequest("again", prompt, max_tokens=1), now)
    steps, _ = run(core, now)
    assert outputs(steps)["again"][-1].num_cached_tokens == 48  # (64 - 1) // 16 blocks


async def test_prompt_logprobs_neither_quarantine_an_honest_replica_nor_pass_the_budget() -> None:
    """Tenant b re-sends its cached prefix with prompt logprobs (or echo + logprobs): the
    replica reports 0 cached tokens, as vLLM. Before: each counted as a false claim and
    three quarantined the replica for tenant a too; and each was charged as a hit. Now
    they are routed by load, judged by nothing and charged their whole prompt."""
    policy = (
        "tenants: {a: {}, b: {limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 3100}}}\n"
        "quarantine: {missing_fraction: 0.5, k: 3, m: 5, min_claimed_blocks: 2,"
        " recover_after: 3, settle_s: 0.2}"
    )
    build = {"key_store": key_store()}
    admin = {"x-admin-key": ADMIN}
    async with (
        stack(count=1, policy=policy, agents=True, build=build, open_access=False) as st,
        st.http() as h,
    ):
        gw = st.gw
        home = st.replica_id(0)
        prefix = words(600, 902)
        first = {"model": st.model, "prompt": prefix + " b0", "max_tokens": 1}
        r = await h.post("/v1/completions", json=first, headers=auth("sk-b"))
        assert r.status_code == 200, r.text
        probe = {"model": st.model, "prompt": prefix + " b9", "max_tokens": 1}
        predicted = 0
        for _ in range(100):  # bounded: until the agent has indexed the prefix
            e = await h.post("/admin/route/explain", json=probe, headers={**auth("sk-b"), **admin})
            predicted = e.json()["decision"]["scores"][0]["predicted_cached_tokens"]
            if predicted:
                break
            await asyncio.sleep(0.05)
        assert predicted >= 592
        asks: list[dict[str, Any]] = [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}]
        statuses = []
        for i in range(4):
            body = {"model": st.model, "prompt": f"{prefix} b{i + 1}", "max_tokens": 1}
            body.update(asks[i % 2])
            r = await h.post("/v1/completions", json=body, headers=auth("sk-b"))
            statuses.append(r.status_code)
            if r.status_code == 200:
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                # no prediction: routed by load, as a media request
                assert "x-kvgate-predicted-cached-tokens" not in r.headers
        # the first ~602 tokens, then ~603 each, against a burst of 3,100: the fifth refused
        # (charged as hits, ~13 tokens each, all four passed and many more would)
        assert statuses == [200, 200, 200, 200]
        body = {"model": st.model, "prompt": f"{prefix} b5", "prompt_logprobs": 1}
        r = await h.post("/v1/completions", json=body, headers=auth("sk-b"))
        assert r.status_code == 429, r.text
        await asyncio.sleep(0.6)  # past settle_s: a claim check would have judged by now
        assert sum(claim_checks(gw, home).values()) == 0
        assert not gw.quarantine.is_quarantined(home)
        # the same prefix without the field: a hit, judged and agreeing
        r = await h.post("/v1/completions", json=probe, headers=auth("sk-b"))
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 592


async def test_health_tells_anyone_nothing_of_the_traffic() -> None:
    """/health answers without a key: it carried the gateway-wide in-flight count, so an
    anonymous poller saw each tenant's request start and end (a hit's short prefill
    showed). Liveness only now; the count is the admins', on /admin/replicas."""
    slow = ReplicaSettings(time_scale=1.0)
    build = {"key_store": key_store()}
    async with (
        stack(count=1, replica=slow, build=build, open_access=False) as st,
        st.http() as h,
        httpx.AsyncClient(base_url=st.url, timeout=30.0) as anon,
    ):
        body = {"model": st.model, "prompt": words(1600, 960), "max_tokens": 1}
        task = asyncio.create_task(h.post("/v1/completions", json=body, headers=auth("sk-a")))
        busy = None
        for _ in range(200):  # bounded: 2 s
            state = (await h.get("/admin/replicas", headers={"x-admin-key": ADMIN})).json()
            if state["in_flight"]:
                busy = (await anon.get("/health")).json()
                break
            await asyncio.sleep(0.01)
        assert (await task).status_code == 200
        assert busy == {"status": "ok"}
        assert (await anon.get("/health")).json() == {"status": "ok"}
        state = (await h.get("/admin/replicas", headers={"x-admin-key": ADMIN})).json()
        assert state["in_flight"] == 0
