"""``POST /v1/embeddings``, ``/tokenize`` and ``/detokenize`` through the gateway (D28),
end to end: real simulated replicas and a real gateway on free loopback ports. Before,
each was a 404: a client of vllm-router or sglang-router (which proxy them) pointed at
kvgate lost its embeddings and its token counts. Routed by load alone, with the completion
path's auth, model resolution, limits, isolation salt, retries and metrics."""

from __future__ import annotations

import asyncio
import base64
import math
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest

from cachecore.keys import Scope, ScopeKind
from cachecore.traceanalysis import analyze_requests
from gateway.app import create_app
from gateway.auth import hash_key
from tests.test_agent_helpers import counter_total
from tests.test_gateway_support import Stack, kill_replica, record_pending, stack, words

pytestmark = pytest.mark.timeout(90)


async def _direct(st: Stack, body: dict[str, Any]) -> dict[str, Any]:
    """The replica's own answer (the embedding is a function of the input alone)."""
    async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url, timeout=30) as h:
        r = await h.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())


async def test_the_openai_sdk_gets_embeddings_through_the_gateway() -> None:
    async with stack(count=2) as st:
        c = st.client()
        texts = [words(20, 1), words(33, 2), words(5, 3)]
        want = [np.array(d["embedding"]) for d in (await _direct(st, {"input": texts}))["data"]]
        # the SDK's default: base64, decoded by the SDK
        got = await c.embeddings.create(model=st.model, input=texts)
        assert [d.index for d in got.data] == [0, 1, 2]
        assert all(
            np.allclose(d.embedding, w, atol=1e-6) for d, w in zip(got.data, want, strict=True)
        )
        assert (got.usage.prompt_tokens, got.usage.total_tokens) == (58, 58)
        # floats, one input, a smaller size
        one = await c.embeddings.create(
            model=st.model, input=texts[0], encoding_format="float", dimensions=16
        )
        assert len(one.data) == 1 and len(one.data[0].embedding) == 16
        assert np.allclose(one.data[0].embedding, want[0][:16] / np.linalg.norm(want[0][:16]))
        # token ids, one list and a batch of lists: the vectors of the texts they spell
        async with st.http() as h:
            ids = [
                (await h.post("/tokenize", json={"model": st.model, "prompt": t})).json()["tokens"]
                for t in texts[:2]
            ]
        got = await c.embeddings.create(model=st.model, input=ids[0], encoding_format="float")
        assert np.allclose(got.data[0].embedding, want[0], atol=1e-6)
        got = await c.embeddings.create(model=st.model, input=ids, encoding_format="float")
        assert all(
            np.allclose(d.embedding, w, atol=1e-6) for d, w in zip(got.data, want[:2], strict=True)
        )
        # raw: base64 as the engine sent it, with the gateway's headers
        async with st.http() as h:
            r = await h.post(
                "/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"}
            )
        assert r.status_code == 200, r.text
        raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
        assert np.allclose(raw, want[1], atol=1e-6)
        assert r.headers["x-kvgate-replica"] in {st.replica_id(0), st.replica_id(1)}
        assert "x-kvgate-predicted-cached-tokens" not in r.headers  # no prediction: by load
        assert counter_total(st.gw.metrics.requests, endpoint="embeddings", status="200") == 5


async def test_tokenize_then_detokenize_through_the_gateway(tmp_path: Path) -> None:
    trace = tmp_path / "requests.jsonl"
    async with stack(count=2, trace_out=trace) as st, st.http() as h:
        text = words(12, 4)
        r = await h.post("/tokenize", json={"model": st.model, "prompt": text})
        assert r.status_code == 200, r.text
        tok = r.json()
        assert tok["count"] == len(tok["tokens"]) == 12 and tok["max_model_len"] > 0
        r = await h.post("/detokenize", json={"model": st.model, "tokens": tok["tokens"]})
        assert (r.status_code, r.json()) == (200, {"prompt": text})
        # a chat's messages, and no model named (the fleet's one model serves it)
        chat = {"messages": [{"role": "user", "content": text}]}
        r = await h.post("/tokenize", json=chat)
        assert r.status_code == 200 and r.json()["count"] > 12, r.text
        # the engine's own 400 passes through in OpenAI's shape
        r = await h.post("/detokenize", json={"model": st.model, "tokens": [10**7]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        for ep in ("tokenize", "detokenize"):
            assert counter_total(st.gw.metrics.requests, endpoint=ep, status="200") >= 1
        r = await h.post("/v1/embeddings", json={"input": text})
        assert r.status_code == 200, r.text
    # the request trace: a record per routed request, naming its endpoint, no prediction
    records = [orjson.loads(line) for line in trace.read_text().splitlines()]
    assert [(r["endpoint"], r["status"]) for r in records] == [
        ("tokenize", 200), ("detokenize", 200), ("tokenize", 200), ("detokenize", 400),
        ("embeddings", 200),
    ]  # fmt: skip
    assert all(r["reason"] == "unkeyed_load" and r["predicted_cached_tokens"] is None
               for r in records)  # fmt: skip
    assert records[-1]["prompt_tokens"] == 12 and records[-1]["cached_tokens"] is None
    assert analyze_requests(records).requests == 5


async def test_the_completion_paths_refusals(tmp_path: Path) -> None:
    """401 without a key, 404 for an unknown model, 400s naming ``input`` (malformed, or a
    batch over KVGATE_MAX_PROMPT_BATCH), and every replica cordoned: 503 ``no_replica``
    with Retry-After."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{sha256: {hash_key('sk-a')}, tenant: a}}\n")
    async with stack(count=2, api_keys_file=keys, max_prompt_batch=4) as st, st.http() as h:
        bodies: dict[str, dict[str, Any]] = {
            "/v1/embeddings": {"model": st.model, "input": words(8, 5)},
            "/tokenize": {"model": st.model, "prompt": words(8, 5)},
            "/detokenize": {"model": st.model, "tokens": [5, 6]},
        }
        auth = {"authorization": "Bearer sk-a"}
        for path, body in bodies.items():
            r = await h.post(path, json=body)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await h.post(path, json={**body, "model": "no-such-model"}, headers=auth)
            assert r.status_code == 404, (path, r.text)
            assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (
                "model_not_found", "model",
            )  # fmt: skip
            r = await h.post(path, content=b"{not json", headers=auth)
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_json"), r.text
        c = st.client(api_key="sk-a")
        with pytest.raises(openai.AuthenticationError):
            await st.client(api_key="sk-wrong").embeddings.create(model=st.model, input="a")
        for bad in ([1, "a"], {"text": "a"}, [], [[1], "a"]):
            r = await h.post("/v1/embeddings", json={"model": st.model, "input": bad}, headers=auth)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "input", r.text
        r = await h.post("/v1/embeddings", json={"model": st.model}, headers=auth)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "input")
        chat = {"model": st.model, "messages": [{"role": "user", "content": "a"}]}
        r = await h.post("/v1/embeddings", json=chat, headers=auth)  # the chat form (D29)
        assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
        r = await h.post("/v1/embeddings", json={**chat, "messages": "a"}, headers=auth)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "messages"), r.text
        # the batch cap: 4 inputs pass, 5 are refused before routing
        got = await c.embeddings.create(model=st.model, input=[words(4, i) for i in range(4)])
        assert len(got.data) == 4
        with pytest.raises(openai.BadRequestError) as err:
            await c.embeddings.create(model=st.model, input=[words(4, i) for i in range(5)])
        assert err.value.param == "input" and "more than this gateway takes" in err.value.message
        # every replica cordoned
        for i in range(2):
            r = await h.post(
                f"/admin/replicas/{st.replica_id(i)}/cordon", headers=st.admin_headers()
            )
            assert r.status_code == 200, r.text
        for path, body in bodies.items():
            r = await h.post(path, json=body, headers=auth)
            assert r.status_code == 503, (path, r.text)
            assert r.headers.get("retry-after") == "1"
            assert r.json()["error"]["code"] == "no_replica"
        with pytest.raises(openai.InternalServerError) as unavailable:
            await c.embeddings.create(model=st.model, input="a b")
        assert unavailable.value.response.headers.get("retry-after") == "1"


async def _first_block_salts(st: Stack) -> list[str]:
    """The salts in block 0's extra keys of every prompt cached on replica 0."""
    async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url, timeout=30) as h:
        blocks = (await h.get("/debug/blocks")).json()["blocks"]
    return [k for b in blocks if b["parent_block_hash"] is None for k in b["extra_keys"] or []]


async def test_each_tenants_embeddings_reach_the_engine_under_its_own_salt(
    tmp_path: Path,
) -> None:
    """The engine hashes an embedding's blocks under the request's cache_salt: the
    gateway's, per scope, as for completions; a client's own is replaced, and a sensitive
    tenant's requests get one each."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n" + "".join(f"  - {{sha256: {hash_key('sk-' + t)}, tenant: {t}}}\n" for t in "abs")
    )
    policy = "tenants:\n  s: {sensitive: {default: request}}\n"
    async with stack(count=1, policy=policy, api_keys_file=keys) as st:
        text = words(40, 6)  # two full blocks: block 0 is cached
        for tenant in ("a", "b"):
            c = st.client(api_key=f"sk-{tenant}")
            await c.embeddings.create(
                model=st.model, input=text, extra_body={"cache_salt": "client-chosen"}
            )
        salts = await _first_block_salts(st)
        want = {t: st.gw.minter.salt(Scope(ScopeKind.TENANT, t)) for t in ("a", "b")}
        assert sorted(salts) == sorted(want.values()), (salts, want)
        assert "client-chosen" not in salts
        # the sensitive tenant: a salt per request, none of them a tenant's
        c = st.client(api_key="sk-s")
        for _ in range(2):
            await c.embeddings.create(model=st.model, input=text)
        mine = [s for s in await _first_block_salts(st) if s not in want.values()]
        assert len(set(mine)) == 2 and all(s.startswith("kvg1:e:") for s in mine), mine
        # /tokenize carries the scope's salt too (the replica's tokenization cache is
        # scoped by it); /detokenize none, a client's removed
        assert st.gw.pool is not None
        for ep, salted in (("tokenize", True), ("detokenize", False)):
            body = {"model": st.model, "prompt": "a", "tokens": [1], "cache_salt": "mine"}
            d = await st.gw.prepare(ep, "a", body, {}, "rid")  # routed, not sent
            got = orjson.loads(st.gw.upstream_body(d)).get("cache_salt")
            assert got == (want["a"] if salted else None), (ep, got)


async def test_routed_by_load_over_both_replicas_and_counted_in_flight() -> None:
    """No keys, lookup or pending entries: the router's load-only path, its tie rounds
    spreading requests over both replicas; a request in flight counts on its replica."""
    async with stack(count=2) as st, st.http() as h:
        pending = record_pending(st.gw)
        used = []
        for i in range(8):
            body = {"model": st.model, "input": words(48, 100 + i)}
            r = await h.post("/v1/embeddings" if i % 2 == 0 else "/tokenize",
                             json=body if i % 2 == 0 else {"prompt": words(9, i)})  # fmt: skip
            assert r.status_code == 200, r.text
            used.append(r.headers["x-kvgate-replica"])
        assert set(used) == {st.replica_id(0), st.replica_id(1)}, used
        assert pending == []
        assert counter_total(st.gw.metrics.decisions, reason="unkeyed_load") == 8
        # in flight: the engine paused, the request counts on its replica until it ends
        for ep in st.fleet.endpoints:
            await h.post(f"{ep.url}/debug/pause", json={"seconds": 1.0})
        task = asyncio.ensure_future(
            h.post("/v1/embeddings", json={"model": st.model, "input": words(64, 7)})
        )
        assert st.gw.pool is not None
        state: dict[str, int] = {}
        for _ in range(40):  # bounded: 40 x 20 ms, within the pause
            state = {r.id: r.in_flight for r in st.gw.pool.all()}
            if sum(state.values()):
                break
            await asyncio.sleep(0.02)
        assert sorted(state.values()) == [0, 1], state
        views = st.gw.load.views(list(state), {k: 256 for k in state})
        assert {k: v.requests for k, v in views.items()} == state  # what routing reads
        assert (await task).status_code == 200
        assert sum(r.in_flight for r in st.gw.pool.all()) == 0


async def test_a_dead_replica_is_retried_elsewhere() -> None:
    """A replica that refuses the connection: the request is retried on the other one
    (nothing was sent; an embedding is stateless), and the client never sees the failure.
    The health check is slowed so that only the request finds the dead port."""
    async with stack(count=2, policy="health: {interval_s: 30}") as st, st.http() as h:
        await kill_replica(st.fleet, 0)
        served = []
        for i in range(6):  # bounded; the tie rounds send one of the first two to the dead one
            r = await h.post("/v1/embeddings", json={"model": st.model, "input": words(20, i)})
            assert r.status_code == 200, r.text
            served.append(r.headers["x-kvgate-replica"])
        assert set(served) == {st.replica_id(1)}, served
        assert counter_total(st.gw.metrics.retries) >= 1
        r = await h.post("/tokenize", json={"model": st.model, "prompt": "a b"})
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == st.replica_id(1)


async def test_an_embedding_is_charged_to_the_uncached_token_budget() -> None:
    """Its whole input is prefill the engine computes: charged as uncached, given back when
    the engine refuses it (a 400 computes nothing)."""
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
    async with stack(count=1, policy=policy) as st:
        c = st.client()
        for _ in range(3):  # token ids outside the vocabulary: the engine's 400
            with pytest.raises(openai.BadRequestError):
                await c.embeddings.create(model=st.model, input=[[10**6] * 900])
        await c.embeddings.create(model=st.model, input=[words(450, 8), words(450, 9)])
        with pytest.raises(openai.RateLimitError) as err:
            await c.embeddings.create(model=st.model, input=words(450, 8))  # same text: no hit
        body = err.value.body
        assert isinstance(body, dict)
        assert (body["type"], body["limit"]) == ("tokens", "uncached_tokens")
        assert int(err.value.response.headers["retry-after"]) >= 1
        # /tokenize computes nothing: not charged
        async with st.http() as h:
            r = await h.post("/tokenize", json={"model": st.model, "prompt": words(500, 1)})
            assert r.status_code == 200, r.text


async def test_the_asgi_routes_serve_them_too() -> None:
    """Under another ASGI server the FastAPI routes serve the proxied endpoints (the hot
    path is kvgate serve's): each endpoint by its own route, whatever the query says."""
    async with stack(count=1) as st:
        asgi = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(st.gw)), base_url="http://t"
        )
        async with asgi:
            r = await asgi.post("/v1/embeddings?endpoint=chat", json={"input": words(8, 1)})
            assert r.status_code == 200 and r.json()["object"] == "list", r.text
            r = await asgi.post("/tokenize", json={"prompt": words(8, 1)})
            assert (r.status_code, r.json()["count"]) == (200, 8)
            r = await asgi.post("/detokenize", json={"tokens": r.json()["tokens"]})
            assert r.status_code == 200 and r.json()["prompt"] == words(8, 1)
            r = await asgi.post("/v1/completions", json={"prompt": "a b", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
            r = await asgi.get("/v1/embeddings")
            assert r.status_code == 405
        for ep in ("embeddings", "tokenize", "detokenize", "completion"):
            assert counter_total(st.gw.metrics.requests, endpoint=ep, status="200") == 1, ep


async def test_an_engine_tokenized_pool_sizes_embeddings_locally() -> None:
    """Under ``engine_tokenize`` an embeddings input is sized by the built-in tokenizer (as
    a completion batch), not asked of the engine, and charged by that size."""
    policy = (
        "models: {default: {tokenizer: engine_tokenize}}\n"
        "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
    )
    async with stack(count=1, policy=policy) as st:
        c = st.client()
        got = await c.embeddings.create(model=st.model, input=[words(300, 1), words(600, 2)])
        assert got.usage.prompt_tokens == 900
        with pytest.raises(openai.RateLimitError):
            await c.embeddings.create(model=st.model, input=words(300, 3))


async def test_a_tokenize_answer_is_no_evidence_of_engine_progress() -> None:
    """vLLM answers /tokenize and /detokenize in its API server, without the engine core:
    a wedged engine answers them at once. Taken as progress, each one reset the replica's
    last progress (D17), so a client that counts tokens beside its requests hid the
    engine's stall from the charge (``min(stalled, since progress) - grace`` stayed under
    0). An embedding is computed by the engine: its answer is progress."""
    async with stack(count=1) as st, st.http() as h:
        rid = st.replica_id(0)
        r = await h.post("/tokenize", json={"model": st.model, "prompt": words(12, 1)})
        assert r.status_code == 200, r.text
        r = await h.post("/detokenize", json={"model": st.model, "tokens": r.json()["tokens"]})
        assert r.status_code == 200, r.text
        assert st.gw.inflight.since_progress_s(rid, time.monotonic()) == math.inf
        r = await h.post("/v1/embeddings", json={"model": st.model, "input": words(12, 1)})
        assert r.status_code == 200, r.text
        assert st.gw.inflight.since_progress_s(rid, time.monotonic()) < 5.0


async def test_a_tokenize_answer_does_not_clear_a_wedged_engines_failures() -> None:
    """First-byte timeouts of a wedged engine count towards its ejection; a request the
    replica answers counts as a success and clears them. /tokenize and /detokenize are
    answered by vLLM's API server without the engine core, so a client counting tokens
    beside its requests cleared the count after each timeout and the wedged engine was
    never ejected. An embedding, computed by the engine, still clears it."""
    async with stack(count=1) as st, st.http() as h:
        rid = st.replica_id(0)
        assert st.gw.pool is not None
        rep = st.gw.pool.get(rid)
        assert rep is not None
        rep.consecutive_failures = 1  # one first-byte timeout counted (below eject_after)
        r = await h.post("/tokenize", json={"model": st.model, "prompt": words(12, 1)})
        assert r.status_code == 200, r.text
        r = await h.post("/detokenize", json={"model": st.model, "tokens": r.json()["tokens"]})
        assert r.status_code == 200, r.text
        assert rep.consecutive_failures == 1
        r = await h.post("/v1/embeddings", json={"model": st.model, "input": words(12, 1)})
        assert r.status_code == 200, r.text
        assert rep.consecutive_failures == 0


async def test_an_explain_only_prepare_of_an_embedding_charges_and_moves_nothing() -> None:
    """``Gateway.prepare(..., explain_only=True)`` decides without committing or charging
    (the explain API's and the benchmarks' call); for the load-routed endpoints it went on
    to charge the budget and commit the decision (its tie round), as for a request sent."""
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
    async with stack(count=2, policy=policy) as st:
        body = {"model": st.model, "input": words(900, 1)}
        for _ in range(3):  # charged, the second would be a 429
            d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
            assert d.decision.effects is not None and not d.decision.effects.done
            assert d.charged_uncached == 0
        assert st.gw.router.tie_round(d.scope.routing_key()) == frozenset()
        d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "rid")  # a real one
        assert d.charged_uncached == 900 and d.decision.effects is not None
        assert d.decision.effects.done
