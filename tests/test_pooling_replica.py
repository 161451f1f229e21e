"""The simulated replica's chat form of embeddings and vLLM's other pooling endpoints
(``/pooling``, ``/classify``, ``/score`` and ``/v1/score``, ``/rerank``, ``/v1/rerank`` and
``/v2/rerank``, D29): vLLM's shapes and 400s, deterministic outputs of the token ids, and
each input or pair a prefill-only engine request (the load, the metrics, the cache salt)."""

from __future__ import annotations

import asyncio
import math

import httpx
import numpy as np
import pytest

from cachecore.replica.fleet import run_fleet
from cachecore.replica.protocol import CLASSIFY_LABELS, EMBEDDING_DIM
from tests.test_embeddings_replica import _metric, replica
from tests.test_gateway_support import FAST, words

pytestmark = pytest.mark.timeout(60)
_HI = [{"role": "user", "content": "hi"}]


async def test_the_chat_form_embeds_the_rendered_messages() -> None:
    """``messages`` rendered with the chat template, no generation prompt by default (vLLM's
    EmbeddingChatRequest), embedded as the token ids of that rendering would be."""
    async with replica() as (h, model):
        messages = [{"role": "system", "content": words(6, 1)}, {"role": "user", "content": "hi"}]
        r = await h.post("/v1/embeddings", json={"model": model, "messages": messages})
        assert r.status_code == 200, r.text
        got = r.json()
        assert len(got["data"]) == 1 and got["data"][0]["object"] == "embedding"
        for add_gen in (False, True):
            tok = (
                await h.post(
                    "/tokenize", json={"messages": messages, "add_generation_prompt": add_gen}
                )
            ).json()
            want = (
                await h.post(
                    "/v1/embeddings",
                    json={"messages": messages, "add_generation_prompt": add_gen},
                )
            ).json()
            ids = (await h.post("/v1/embeddings", json={"input": tok["tokens"]})).json()
            assert np.allclose(want["data"][0]["embedding"], ids["data"][0]["embedding"])
            assert want["usage"]["prompt_tokens"] == tok["count"]
            if not add_gen:
                assert got["data"][0]["embedding"] == want["data"][0]["embedding"]
                assert got["usage"]["prompt_tokens"] == tok["count"]
        # with both forms, the messages run (vLLM's smart union: tests/test_pooling_options.py)
        both = await h.post("/v1/embeddings", json={"input": "a b", "messages": messages})
        assert both.json()["usage"]["prompt_tokens"] == got["usage"]["prompt_tokens"]


async def test_pooling_and_classify_answer_per_input() -> None:
    async with replica() as (h, model):
        texts = [words(20, 1), words(12, 2)]
        r = await h.post("/pooling", json={"model": model, "input": texts})
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["object"], got["model"], got["usage"]["prompt_tokens"]) == ("list", model, 32)
        assert [(d["index"], d["object"]) for d in got["data"]] == [(0, "pooling"), (1, "pooling")]
        assert all(len(d["data"]) == EMBEDDING_DIM for d in got["data"])
        emb = (await h.post("/v1/embeddings", json={"input": texts})).json()
        assert got["data"][1]["data"] == emb["data"][1]["embedding"]  # the pooled state
        r = await h.post("/classify", json={"input": [*texts, words(5, 3)]})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["id"].startswith("classify-") and got["usage"]["prompt_tokens"] == 37
        for i, d in enumerate(got["data"]):
            assert d["index"] == i and d["num_classes"] == len(CLASSIFY_LABELS)
            assert math.isclose(sum(d["probs"]), 1.0) and min(d["probs"]) > 0
            assert d["label"] == CLASSIFY_LABELS[int(np.argmax(d["probs"]))]
        again = (await h.post("/classify", json={"input": texts[0]})).json()
        assert again["data"][0]["probs"] == got["data"][0]["probs"]  # deterministic


async def test_score_pairs_one_to_one_one_to_n_and_n_to_n() -> None:
    async with replica() as (h, model):
        q, docs = words(4, 1), [words(6, 2), words(8, 3), words(3, 4)]
        one_n = (await h.post("/score", json={"model": model, "text_1": q, "text_2": docs})).json()
        assert [(d["index"], d["object"]) for d in one_n["data"]] == [
            (0, "score"), (1, "score"), (2, "score"),
        ]  # fmt: skip
        scores = [d["score"] for d in one_n["data"]]
        assert all(0 <= s < 1 for s in scores) and len(set(scores)) == 3
        assert one_n["usage"]["prompt_tokens"] == 3 * 4 + 6 + 8 + 3  # each pair both texts
        # the same pairs, N:N and 1:1 (on /v1/score): the same scores
        n_n = (await h.post("/v1/score", json={"text_1": [q] * 3, "text_2": docs})).json()
        assert [d["score"] for d in n_n["data"]] == scores
        one = (await h.post("/v1/score", json={"text_1": [q], "text_2": docs[1]})).json()
        assert [d["score"] for d in one["data"]] == scores[1:2]


async def test_rerank_orders_the_documents_and_keeps_top_n() -> None:
    async with replica() as (h, model):
        q, docs = words(4, 1), [words(6, i) for i in range(2, 8)]
        scores = [
            d["score"]
            for d in (await h.post("/score", json={"text_1": q, "text_2": docs})).json()["data"]
        ]
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            r = await h.post(path, json={"model": model, "query": q, "documents": docs})
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["model"] == model and got["usage"] == {
                "prompt_tokens": 60, "total_tokens": 60,
            }  # fmt: skip
            order = sorted(range(6), key=lambda i: -scores[i])
            assert [x["index"] for x in got["results"]] == order
            assert [x["relevance_score"] for x in got["results"]] == [scores[i] for i in order]
            assert all(x["document"] == {"text": docs[x["index"]]} for x in got["results"])
        top = (await h.post("/rerank", json={"query": q, "documents": docs, "top_n": 2})).json()
        assert [x["index"] for x in top["results"]] == order[:2]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"messages": "hi"}, "messages"),
        ("/v1/embeddings", {"messages": _HI, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
        (
            "/v1/embeddings",
            {"messages": _HI, "add_generation_prompt": "x"},
            "add_generation_prompt",
        ),
        ("/pooling", {}, "input"),
        ("/pooling", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ("/classify", {"input": []}, "input"),
        ("/classify", {"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ("/score", {"text_2": "a"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": 3}, "text_2"),
        ("/score", {"text_1": [], "text_2": "a"}, "text_1"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "cache_salt": ""}, "cache_salt"),
        ("/rerank", {"query": "a"}, "documents"),
        ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v2/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
        ("/rerank", {"query": "a", "documents": ["b"], "priority": "first"}, "priority"),
    ],
)
async def test_a_field_vllm_refuses_is_a_400_naming_it(
    path: str, body: dict[str, object], param: str
) -> None:
    async with replica() as (h, _):
        r = await h.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("BadRequestError", param, 400), err


async def test_each_pair_is_an_engine_request_under_the_salt() -> None:
    async with replica() as (h, _):
        before = (await h.get("/metrics")).text
        await h.post("/debug/pause", json={"seconds": 1.0})
        q, docs = words(20, 1), [words(20, 2), words(24, 3)]
        body = {"query": q, "documents": docs, "cache_salt": "tenant-a"}
        task = asyncio.ensure_future(h.post("/v1/rerank", json=body))
        load: dict[str, int] = {}
        for _ in range(50):  # bounded: 50 x 20 ms, within the pause
            load = (await h.get("/get_load")).json()[0]
            if load["num_reqs"]:
                break
            await asyncio.sleep(0.02)
        assert (load["num_reqs"], load["num_tokens"]) == (2, 84)
        r = await task
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 84, r.text
        after = (await h.get("/metrics")).text
        grew = {
            n: _metric(after, n) - _metric(before, n)
            for n in ("vllm:prompt_tokens_total", "vllm:request_success_total")
        }
        assert grew == {"vllm:prompt_tokens_total": 84, "vllm:request_success_total": 2}
        blocks = (await h.get("/debug/blocks")).json()["blocks"]
        firsts = [b for b in blocks if b["parent_block_hash"] is None]
        assert firsts and all("tenant-a" in b["extra_keys"] for b in firsts), firsts


async def test_a_client_that_leaves_a_score_aborts_its_pairs_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with run_fleet(FAST, count=1) as fleet:
        url = fleet.endpoints[0].url
        async with httpx.AsyncClient(base_url=url, timeout=30) as h:
            await h.post("/debug/pause", json={"seconds": 2.0})
            body = {"text_1": words(30, 1), "text_2": [words(30, 2), words(30, 3)]}
            with pytest.raises(httpx.TimeoutException):
                async with httpx.AsyncClient(base_url=url, timeout=0.3) as short:
                    await short.post("/score", json=body)
            load: dict[str, int] = {}
            for _ in range(40):  # bounded: 40 x 25 ms, within the pause
                load = (await h.get("/get_load")).json()[0]
                if not load["num_reqs"]:
                    break
                await asyncio.sleep(0.025)
            assert load["num_reqs"] == 0, load
            await asyncio.sleep(0.1)
    said = [r.getMessage() for r in caplog.records if r.levelno >= 40]
    assert not [m for m in said if "Exception in ASGI application" in m], said
