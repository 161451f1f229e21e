"""The chat form of embeddings and vLLM's other pooling endpoints (``/pooling``,
``/classify``, ``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``)
through the gateway (D29), end to end: real simulated replicas and a real gateway on free
loopback ports. Before, the chat form was a 400 naming ``input`` and the others 404s, though
both peer routers proxy them. Routed by load alone, salted per scope, charged whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from cachecore.keys import Scope, ScopeKind
from gateway.app import create_app
from gateway.auth import hash_key
from tests.test_agent_helpers import counter_total
from tests.test_embeddings_gateway import _first_block_salts
from tests.test_gateway_support import Stack, record_pending, stack, words

pytestmark = pytest.mark.timeout(90)

_MESSAGES = [
    {"role": "system", "content": words(30, 1)},
    {"role": "user", "content": words(12, 2)},
]


def _bodies(model: str) -> dict[str, dict[str, Any]]:
    """One body per endpoint (path -> body), each over a prompt of two full blocks."""
    q, docs = words(20, 3), [words(24, 4), words(30, 5), words(22, 6)]
    return {
        "/v1/embeddings": {"model": model, "messages": _MESSAGES},
        "/pooling": {"model": model, "input": [words(40, 7), words(36, 8)]},
        "/classify": {"model": model, "input": words(40, 9)},
        "/score": {"model": model, "text_1": q, "text_2": docs},
        "/v1/score": {"model": model, "text_1": [q, q], "text_2": docs[:2]},
        "/rerank": {"model": model, "query": q, "documents": docs},
        "/v1/rerank": {"model": model, "query": q, "documents": docs, "top_n": 2},
        "/v2/rerank": {"model": model, "query": q, "documents": docs},
    }


_NAMES = {
    "/v1/embeddings": "embeddings", "/pooling": "pooling", "/classify": "classify",
    "/score": "score", "/v1/score": "score_v1", "/rerank": "rerank",
    "/v1/rerank": "rerank_v1", "/v2/rerank": "rerank_v2",
}  # fmt: skip


def _stable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs per request (its id, its time)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


async def _direct(st: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url, timeout=30) as h:
        r = await h.post(path, json=body)
        assert r.status_code == 200, r.text
        return dict(r.json())


async def test_each_endpoint_answers_through_the_gateway_as_the_engine() -> None:
    """Each endpoint's answer is the engine's (vLLM's shapes); the gateway sizes each
    request as the engine counts it (its usage), and counts it under its endpoint."""
    async with stack(count=2) as st, st.http() as h:
        for path, body in _bodies(st.model).items():
            r = await h.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            got = r.json()
            assert _stable(got) == _stable(await _direct(st, path, body)), path
            assert r.headers["x-kvgate-replica"] in {st.replica_id(0), st.replica_id(1)}
            assert "x-kvgate-predicted-cached-tokens" not in r.headers  # routed by load
            d = await st.gw.prepare(_NAMES[path], "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == got["usage"]["prompt_tokens"] > 0, path
            assert counter_total(st.gw.metrics.requests, endpoint=_NAMES[path], status="200") == 1
        # the shapes: score 1:N and N:N, rerank best first and top_n
        score = (await h.post("/score", json=_bodies(st.model)["/score"])).json()
        assert [(x["index"], x["object"]) for x in score["data"]] == [
            (0, "score"), (1, "score"), (2, "score"),
        ]  # fmt: skip
        scores = [x["score"] for x in score["data"]]
        n_n = (await h.post("/v1/score", json=_bodies(st.model)["/v1/score"])).json()
        assert [x["score"] for x in n_n["data"]] == scores[:2]
        order = sorted(range(3), key=lambda i: -scores[i])
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            got = (await h.post(path, json=_bodies(st.model)[path])).json()
            want = order[:2] if path == "/v1/rerank" else order
            assert [x["index"] for x in got["results"]] == want, path
            assert [x["relevance_score"] for x in got["results"]] == [scores[i] for i in want]
        cls = (await h.post("/classify", json=_bodies(st.model)["/classify"])).json()
        assert set(cls["data"][0]) == {"index", "label", "probs", "num_classes"}
        emb = (await h.post("/v1/embeddings", json=_bodies(st.model)["/v1/embeddings"])).json()
        assert emb["data"][0]["object"] == "embedding" and len(emb["data"]) == 1


async def test_each_tenants_requests_reach_the_engine_under_its_own_salt(
    tmp_path: Path,
) -> None:
    """Each pooling request's blocks are hashed under the scope's salt, a client's own
    replaced: read off block 0 at the replica, endpoint by endpoint."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n" + "".join(f"  - {{sha256: {hash_key('sk-' + t)}, tenant: {t}}}\n" for t in "ab")
    )
    async with stack(count=1, api_keys_file=keys) as st, st.http() as h:
        want = {t: st.gw.minter.salt(Scope(ScopeKind.TENANT, t)) for t in "ab"}
        replica = st.fleet.endpoints[0].url
        for path, body in _bodies(st.model).items():
            await h.post(f"{replica}/reset_prefix_cache")
            for t in "ab":
                r = await h.post(
                    path,
                    json={**body, "cache_salt": "client-chosen"},
                    headers={"authorization": f"Bearer sk-{t}"},
                )
                assert r.status_code == 200, (path, r.text)
            salts = set(await _first_block_salts(st))
            assert salts == set(want.values()), (path, salts, want)


async def test_each_is_charged_to_the_uncached_token_budget() -> None:
    """A pooling request's whole prefill (each pair both texts) is charged as uncached."""
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        body = {"text_1": words(100, 1), "text_2": [words(200, i) for i in range(2, 5)]}
        r = await h.post("/v1/score", json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 900, r.text
        r = await h.post("/rerank", json={"query": words(60, 1), "documents": [words(50, 2)]})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["limit"] == "uncached_tokens"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        r = await h.post(
            "/v1/embeddings", json={"messages": [{"role": "user", "content": words(900, 1)}]}
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 900, r.text
        r = await h.post("/classify", json={"input": words(100, 2)})
        assert r.status_code == 429, r.text


async def test_the_batch_cap_and_malformed_bodies_are_400s_naming_the_field() -> None:
    """Each pair is one prompt of KVGATE_MAX_PROMPT_BATCH; a malformed body is refused by
    the gateway before routing, naming its field."""
    async with stack(count=1, max_prompt_batch=4) as st, st.http() as h:
        four = [words(3, i) for i in range(4)]
        five = [*four, "e"]
        ok = [
            ("/score", {"text_1": "q", "text_2": four}),
            ("/v1/score", {"text_1": four, "text_2": four}),
            ("/v2/rerank", {"query": "q", "documents": four}),
            ("/classify", {"input": four}),
            ("/pooling", {"input": four}),
        ]
        for path, body in ok:
            r = await h.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
        bad = [
            ("/score", {"text_1": "q", "text_2": five}, "text_2"),
            ("/v1/score", {"text_1": five, "text_2": five}, "text_2"),
            ("/rerank", {"query": "q", "documents": five}, "documents"),
            ("/classify", {"input": five}, "input"),
            ("/score", {"text_2": "a"}, "text_1"),
            ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
            ("/score", {"text_1": "a", "text_2": [1]}, "text_2"),
            ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
            ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
            ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
            ("/v1/rerank", {"query": "a"}, "documents"),
            ("/pooling", {}, "input"),
            ("/v1/embeddings", {"messages": "hi"}, "messages"),
            ("/classify", {"input": "a", "truncate_prompt_tokens": "x"}, "truncate_prompt_tokens"),
        ]
        for path, body, param in bad:
            r = await h.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["param"] == param, (path, body, r.text)
        # refused before routing: nothing reached the replica
        assert counter_total(st.gw.metrics.decisions) == len(ok)


async def test_routed_by_load_over_both_replicas_as_engine_work() -> None:
    """No keys, lookup or pending entries: the load-only path's tie rounds spread them;
    each answer is engine progress and clears a failure count, as an embedding's."""
    async with stack(count=2) as st, st.http() as h:
        assert st.gw.pool is not None
        pending = record_pending(st.gw)
        paths = list(_bodies(st.model))
        used = []
        for i in range(8):
            path = paths[i % len(paths)]
            r = await h.post(path, json=_bodies(st.model)[path])
            assert r.status_code == 200, r.text
            used.append(r.headers["x-kvgate-replica"])
        assert set(used) == {st.replica_id(0), st.replica_id(1)}, used
        assert pending == []
        assert counter_total(st.gw.metrics.decisions, reason="unkeyed_load") == 8
        for path in ("/score", "/v2/rerank", "/classify"):
            for each in st.gw.pool.all():
                each.consecutive_failures = 1
            r = await h.post(path, json=_bodies(st.model)[path])
            assert r.status_code == 200, r.text
            served = st.gw.pool.get(r.headers["x-kvgate-replica"])
            assert served is not None and served.consecutive_failures == 0, path


async def test_the_asgi_routes_serve_them_as_the_hot_path() -> None:
    """Under another ASGI server the FastAPI routes serve each endpoint (the hot path is
    kvgate serve's): the same answers, counted under the same endpoint names."""
    async with stack(count=1) as st, st.http() as h:
        asgi = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(st.gw)), base_url="http://t"
        )
        async with asgi:
            for path, body in _bodies(st.model).items():
                hot = await h.post(path, json=body)
                routed = await asgi.post(path, json=body)
                assert hot.status_code == routed.status_code == 200, (path, routed.text)
                assert _stable(hot.json()) == _stable(routed.json()), path
                r = await asgi.post(path, json={"model": st.model})
                assert r.status_code == 400, (path, r.text)
        for path in _bodies(st.model):
            assert counter_total(st.gw.metrics.requests, endpoint=_NAMES[path], status="200") == 2


async def test_an_engine_tokenized_pool_sizes_chats_and_pairs_locally() -> None:
    """Under ``engine_tokenize`` the chat form and the pairs are sized by the built-in
    tokenizer (an estimate, as a batch's), not asked of the engine: here exact."""
    policy = "models: {default: {tokenizer: engine_tokenize}}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        for path in ("/v1/embeddings", "/score", "/v2/rerank"):
            body = _bodies(st.model)[path]
            r = await h.post(path, json=body)
            assert r.status_code == 200, r.text
            d = await st.gw.prepare(_NAMES[path], "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == r.json()["usage"]["prompt_tokens"], path


async def test_the_chat_forms_media_uuids_go_scoped() -> None:
    """vLLM renders a pooling request's ``messages`` as a chat's, and takes a content
    part's ``uuid`` as the item's name in its multimodal caches, which no cache_salt
    scopes (security.md): sent raw, a tenant's chat embedding naming another's uuid read
    the other's image. Scoped as a chat's on every endpoint over inputs, on the raw-bytes
    path too, and with an ``input`` beside the messages (vLLM may run either form)."""
    uid = "their-image-0001"
    msgs = [
        {"role": "user", "content": [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": None, "uuid": uid},
        ]},
    ]  # fmt: skip
    async with stack(count=1) as st:
        for ep in ("embeddings", "pooling", "classify"):
            for extra in ({}, {"input": "describe"}):
                body = {"model": st.model, "messages": msgs, **extra}
                d = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
                d.raw_body = orjson.dumps(body)  # the hot path's: the client's bytes
                sent = orjson.loads(st.gw.upstream_body(d))
                got = sent["messages"][0]["content"][1]["uuid"]
                assert got != uid and got.startswith("kvg1:"), (ep, extra, got)
                assert sent["cache_salt"] == d.salts[0], ep


async def test_an_input_beside_messages_is_charged_as_the_larger_form() -> None:
    """With both ``input`` and ``messages`` vLLM's request union does not always run the
    input: pydantic's smart union picks the form with more of its own fields set, so a
    chat-only field (``add_generation_prompt``, ``chat_template_kwargs``...) makes it run
    the messages. Sized by the input alone, a one-word input beside a 900-word
    conversation was charged one token; now the larger of the two forms is charged."""
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
    msgs = [{"role": "user", "content": words(900, 1)}]
    async with stack(count=1, policy=policy) as st, st.http() as h:
        for ep in ("embeddings", "pooling", "classify"):
            alone = await st.gw.prepare(ep, "anonymous", {"messages": msgs}, {}, "x", True)
            body = {"input": "hi", "messages": msgs, "add_generation_prompt": False}
            both = await st.gw.prepare(ep, "anonymous", body, {}, "x", True)
            assert both.prompt_tokens == alone.prompt_tokens > 900, ep
            big = {"input": [words(300, 2), words(400, 3)], "messages": msgs}
            d = await st.gw.prepare(ep, "anonymous", big, {}, "x", True)
            assert d.prompt_tokens == alone.prompt_tokens, ep
            bigger = {"input": [words(600, 2), words(400, 3)], "messages": msgs}
            d = await st.gw.prepare(ep, "anonymous", bigger, {}, "x", True)
            assert d.prompt_tokens > alone.prompt_tokens, ep
        body = {"input": "hi", "messages": msgs, "add_generation_prompt": False}
        r = await h.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        r = await h.post("/classify", json={"input": words(100, 2)})
        assert r.status_code == 429, r.text  # the 900-word conversation was charged


async def test_scores_other_request_forms_are_refused_not_sized_as_text_pairs() -> None:
    """vLLM's /score request is a union of forms (``queries``/``documents``,
    ``queries``/``items``, ``data_1``/``data_2``, ``text_1``/``text_2``), and its smart
    union runs the first of those with as many fields set: with ``text_1``/``text_2``
    beside ``queries``/``documents`` it scores the queries against the documents. The
    gateway read the text pairs alone, so a one-pair body carrying a thousand documents
    was charged one pair's tokens. It reads the text form only: any other form's field is
    a 400 naming it, before routing."""
    async with stack(count=1) as st, st.http() as h:
        docs = [words(300, i) for i in range(3)]
        for extra in (
            {"queries": "q", "documents": docs},
            {"queries": "q", "items": docs},
            {"data_1": "q", "data_2": docs},
        ):
            for path in ("/score", "/v1/score"):
                for text in ({"text_1": "a", "text_2": "b"}, {}):
                    r = await h.post(path, json={**text, **extra})
                    assert r.status_code == 400, (path, extra, r.text)
                    assert r.json()["error"]["param"] == next(iter(extra)), r.text
        assert counter_total(st.gw.metrics.decisions) == 0
