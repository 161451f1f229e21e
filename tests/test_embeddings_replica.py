"""The simulated replica's ``POST /v1/embeddings`` (vLLM's, served for pooling models) and
the engine's prefill-only (pooling) requests behind it: vLLM's field types and 400s, a
deterministic unit vector per input, float or base64 encoding, and each input a real engine
request (modelled prefill, the batch, /metrics, /get_load, the cache salt in block 0)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest

from cachecore.engine import EngineConfig, EngineCore, EngineRequest, RequestRejectedError
from cachecore.replica.fleet import run_fleet
from cachecore.replica.protocol import EMBEDDING_DIM
from tests.test_gateway_support import FAST, words

pytestmark = pytest.mark.timeout(60)


def test_a_pooling_request_finishes_at_its_prefill_without_an_output_token() -> None:
    core = EngineCore(EngineConfig(num_blocks=64, block_size=16))
    prompt = list(range(1, 41))  # 40 tokens: two full blocks
    core.add_request(EngineRequest("e", prompt, max_tokens=16, cache_salt="s", pooling=True), 0)
    outs = []
    for _ in range(10):  # bounded: one step computes 40 tokens
        outs += core.step(0.0).outputs
        if not core.has_work():
            break
    assert len(outs) == 1
    (out,) = outs
    assert (out.finished, out.new_token_ids, out.num_output_tokens) == (True, [], 0)
    assert out.num_prompt_tokens == 40
    stats = core.stats()
    assert (stats.num_finished, stats.num_prompt_tokens, stats.num_generation_tokens) == (1, 40, 0)
    blocks = core.cached_blocks()
    assert len(blocks) == 2  # its full blocks stay cached, block 0 under the salt
    first = next(b for b in blocks if b.parent_block_hash is None)
    assert first.extra_keys is not None and "s" in first.extra_keys
    # a pooling prompt may fill the context (no output token is reserved); one over it is
    # refused with vLLM's embedding message
    small = EngineCore(EngineConfig(num_blocks=8, block_size=16, max_model_len=64))
    small.add_request(EngineRequest("fits", [1] * 64, pooling=True), 0)
    with pytest.raises(RequestRejectedError, match="input for embedding generation"):
        small.add_request(EngineRequest("long", [1] * 65, pooling=True), 0)


@asynccontextmanager
async def replica() -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    async with (
        run_fleet(FAST, count=1) as fleet,
        httpx.AsyncClient(base_url=fleet.endpoints[0].url, timeout=30) as h,
    ):
        yield h, fleet.endpoints[0].model


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_embeddings_are_deterministic_unit_vectors_as_float_or_base64() -> None:
    async with replica() as (h, model):
        texts = [words(20, 1), words(30, 2)]
        r = await h.post("/v1/embeddings", json={"model": model, "input": texts})
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["object"], got["model"]) == ("list", model)
        assert [d["index"] for d in got["data"]] == [0, 1]
        assert all(d["object"] == "embedding" for d in got["data"])
        floats = [np.array(d["embedding"]) for d in got["data"]]
        assert [len(v) for v in floats] == [EMBEDDING_DIM] * 2
        assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in floats)
        assert not np.allclose(floats[0], floats[1])
        # a text prompt gets the tokenizer's special tokens (none for the built-in one)
        usage = got["usage"]
        assert (usage["prompt_tokens"], usage["total_tokens"]) == (50, 50)
        # the same input again, alone and as base64 (little-endian float32): the same vector
        r = await h.post("/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"})
        b64 = r.json()["data"][0]["embedding"]
        assert isinstance(b64, str)
        assert np.allclose(np.frombuffer(base64.b64decode(b64), dtype="<f4"), floats[1])
        # token ids give the vector of the text they spell
        ids = (await h.post("/tokenize", json={"prompt": texts[0]})).json()["tokens"]
        r = await h.post("/v1/embeddings", json={"input": [ids]})
        assert np.allclose(r.json()["data"][0]["embedding"], floats[0])
        # dimensions: the leading components, renormalised
        r = await h.post("/v1/embeddings", json={"input": texts[0], "dimensions": 8})
        small = np.array(r.json()["data"][0]["embedding"])
        assert len(small) == 8 and abs(np.linalg.norm(small) - 1) < 1e-5
        assert np.allclose(small, floats[0][:8] / np.linalg.norm(floats[0][:8]), atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], [10**7]]}, "input"),
        ({"input": "a b", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a b", "dimensions": "many"}, "dimensions"),
        ({"input": "a b", "dimensions": EMBEDDING_DIM + 1}, "dimensions"),
        ({"input": "a b", "dimensions": 0}, "dimensions"),
        ({"input": "a b", "add_special_tokens": "perhaps"}, "add_special_tokens"),
        ({"input": "a b", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": "a b", "priority": "first"}, "priority"),
        ({"input": "a b", "cache_salt": ""}, "cache_salt"),
    ],
)
async def test_a_field_vllm_refuses_is_a_400_naming_it(body: dict[str, object], param: str) -> None:
    async with replica() as (h, _):
        r = await h.post("/v1/embeddings", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("BadRequestError", param, 400), err


async def test_each_input_is_an_engine_request_seen_in_the_load_and_the_metrics() -> None:
    async with replica() as (h, model):
        before = (await h.get("/metrics")).text
        # the engine paused: the requests wait in its queue, as /get_load shows
        await h.post("/debug/pause", json={"seconds": 1.0})
        texts = [words(40, 10), words(24, 11), words(16, 12)]
        task = asyncio.ensure_future(
            h.post("/v1/embeddings", json={"input": texts, "cache_salt": "tenant-a"})
        )
        load: dict[str, int] = {}
        for _ in range(50):  # bounded: 50 x 20 ms, within the pause
            load = (await h.get("/get_load")).json()[0]
            if load["num_reqs"]:
                break
            await asyncio.sleep(0.02)
        assert (load["num_reqs"], load["num_waiting_reqs"], load["num_tokens"]) == (3, 3, 80)
        r = await task
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 80
        after = (await h.get("/metrics")).text
        grew = {
            name: _metric(after, name) - _metric(before, name)
            for name in (
                "vllm:prompt_tokens_total",
                "vllm:generation_tokens_total",
                "vllm:request_success_total",
                "kvgate_prefill_tokens_computed_total",
            )
        }
        assert grew == {
            "vllm:prompt_tokens_total": 80,
            "vllm:generation_tokens_total": 0,
            "vllm:request_success_total": 3,
            "kvgate_prefill_tokens_computed_total": 80,
        }
        # block 0 of each input is hashed under the request's cache salt, as a completion's
        blocks = (await h.get("/debug/blocks")).json()["blocks"]
        firsts = [b for b in blocks if b["parent_block_hash"] is None]
        assert len(firsts) == 3 and all("tenant-a" in b["extra_keys"] for b in firsts), firsts
        # the same first input under the same salt hits the cache; reported to nobody
        r = await h.post("/v1/embeddings", json={"input": texts[0], "cache_salt": "tenant-a"})
        assert r.json()["usage"]["prompt_tokens_details"] is None
        hits = _metric((await h.get("/metrics")).text, "vllm:prefix_cache_hits_total")
        assert hits == 32
        # an input over the context is refused as vLLM refuses it
        r = await h.post("/v1/embeddings", json={"input": [[1] * 40000], "model": model})
        assert r.status_code == 400
        assert "input for embedding generation" in r.json()["error"]["message"]


async def test_a_client_that_leaves_aborts_its_inputs_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that hangs up before its embeddings are computed: each input's engine
    request is aborted and the endpoint ends as a 499 with nothing to answer. A cancelled
    asyncio.gather is not ``cancelled()`` (it holds a CancelledError as its exception), so
    the endpoint raised it: uvicorn's 'Exception in ASGI application' traceback per
    departed client (completion batches shared the helper)."""
    async with run_fleet(FAST, count=1) as fleet:
        url = fleet.endpoints[0].url
        async with httpx.AsyncClient(base_url=url, timeout=30) as h:
            await h.post("/debug/pause", json={"seconds": 2.0})
            body = {"input": [words(30, 1), words(30, 2)]}
            with pytest.raises(httpx.TimeoutException):
                async with httpx.AsyncClient(base_url=url, timeout=0.3) as short:
                    await short.post("/v1/embeddings", json=body)
            load: dict[str, int] = {}
            for _ in range(40):  # bounded: 40 x 25 ms, within the pause
                load = (await h.get("/get_load")).json()[0]
                if not load["num_reqs"]:
                    break
                await asyncio.sleep(0.025)
            assert load["num_reqs"] == 0, load
            await asyncio.sleep(0.1)  # the endpoint's own end
    said = [r.getMessage() for r in caplog.records if r.levelno >= 40]
    assert not [m for m in said if "Exception in ASGI application" in m], said
