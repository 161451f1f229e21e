"""Review S4: a /v1/completions ``prompt`` list is a batch (vLLM runs one engine request
per element). The gateway sized, charged, counted and cold-confined it by its first
prompt only: ``["hi", <600 unique tokens> x 8]`` passed an uncached-token budget that
refused one such prompt alone. Now a batch of more than one prompt is sized and charged
as the sum of its prompts and routed by load (unkeyed: a confined tenant's batch is cold)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from cachecore.keys import Scope, ScopeKind
from cachecore.tokenizer import builtin_tokenizer
from gateway.auth import KeyStore, hash_key
from gateway.errors import GatewayError
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(120)

KEYS = {"sk-a": "a", "sk-b": "b", "sk-c": "c"}


def key_store() -> KeyStore:
    return KeyStore({hash_key(k): t for k, t in KEYS.items()})


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class Recorder:
    """ASGI wrapper of a simulated replica: records each completion body it receives."""

    def __init__(self, app: Any, bodies: list[dict[str, Any]]) -> None:
        self.app, self.bodies = app, bodies

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            await self.app(scope, receive, send)
            return
        chunks = []
        for _ in range(100_000):  # bounded
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        raw = b"".join(chunks)
        self.bodies.append(json.loads(raw))
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def record(st: Stack) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    for server in st.fleet.servers:
        server.config.loaded_app = Recorder(server.config.loaded_app, bodies)
    return bodies


async def test_a_batch_is_charged_the_sum_of_its_prompts_before_it_is_sent() -> None:
    """Tenant b's budget (700 uncached tokens of burst) takes one unique 600-token prompt
    and refuses a second; a batch of eight such prompts behind ``"hi"`` is refused by the
    budget too, before it reaches a replica."""
    policy = (
        "tenants: {a: {}, b: {limits: {uncached_tokens_per_s: 10, uncached_tokens_burst: 700}}}"
    )
    build = {"key_store": key_store()}
    async with (
        stack(count=1, policy=policy, build=build, open_access=False) as st,
        st.http() as h,
    ):
        bodies = record(st)
        gw = st.gw
        tok = builtin_tokenizer()
        batch = ["hi"] + [words(600, 970 + i) for i in range(8)]
        body = {"model": st.model, "prompt": batch, "max_tokens": 1}
        d = await gw.prepare("completion", "b", dict(body), {}, "x", explain_only=True)
        assert d.prompt_tokens == sum(len(tok.encode(p)) for p in batch)
        assert d.unkeyed and not d.keys  # routed by load
        one = {"model": st.model, "prompt": words(600, 990), "max_tokens": 1}
        r = await h.post("/v1/completions", json=one, headers=auth("sk-b"))
        assert r.status_code == 200, r.text
        sent = len(bodies)
        two = dict(one, prompt=words(600, 991))
        r = await h.post("/v1/completions", json=two, headers=auth("sk-b"))
        assert r.status_code == 429  # the budget refuses a second such prompt ...
        r = await h.post("/v1/completions", json=body, headers=auth("sk-b"))
        assert r.status_code == 429, r.text  # ... and eight behind "hi"
        assert r.json()["error"]["type"] == "tokens"
        assert len(bodies) == sent  # refused before sending


async def test_token_id_batches_count_every_prompt_truncated_as_the_engine_runs_it() -> None:
    async with stack(count=1) as st:
        gw = st.gw
        ids = [list(range(100 + i, 400 + i)) for i in range(3)]
        body: dict[str, Any] = {"model": st.model, "prompt": ids, "max_tokens": 1}
        d = await gw.prepare("completion", "anonymous", dict(body), {}, "x", explain_only=True)
        assert d.prompt_tokens == 900 and d.unkeyed
        body["truncate_prompt_tokens"] = 100  # vLLM truncates each prompt
        d = await gw.prepare("completion", "anonymous", dict(body), {}, "x", explain_only=True)
        assert d.prompt_tokens == 300
        one = {"model": st.model, "prompt": [ids[0]], "max_tokens": 1}  # a batch of one
        d = await gw.prepare("completion", "anonymous", one, {}, "x", explain_only=True)
        assert d.prompt_tokens == 300 and not d.unkeyed and d.keys
        # what vLLM's request model refuses: a mixed batch, a bad element
        for bad in (["a", [1, 2]], [[1, 2], "a"], [[1, 2], [3, -1]], [[1], []]):
            with pytest.raises(GatewayError) as err:
                body = {"model": st.model, "prompt": bad, "max_tokens": 1}
                await gw.prepare("completion", "anonymous", body, {}, "x", explain_only=True)
            assert err.value.status == 400 and err.value.param == "prompt"


async def test_a_batch_behind_a_warm_prompt_is_cold_confined() -> None:
    """A tenant confined to one replica for its cold traffic: a batch whose first prompt
    is cached on every replica is still a batch of uncached prompts, confined."""
    policy = "tenants: {c: {limits: {cold_replica_count: 1}}}"
    build = {"key_store": key_store()}
    async with stack(count=3, agents=True, policy=policy, build=build, open_access=False) as st:
        gw = st.gw
        warm = list(range(1000, 1320))
        salt = gw.minter.salts(Scope(ScopeKind.TENANT, "c"))[0]
        async with httpx.AsyncClient(timeout=30.0) as direct:
            for e in st.fleet.endpoints:  # c's prompt cached on every replica, indexed
                body = {"model": st.model, "prompt": warm, "max_tokens": 1, "cache_salt": salt}
                r = await direct.post(e.url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
        await asyncio.sleep(0.8)
        single = {"model": st.model, "prompt": warm, "max_tokens": 1}
        d = await gw.prepare("completion", "c", single, {}, "x", explain_only=True)
        assert all(s.eligible for s in d.decision.scores)  # warm everywhere: not confined
        batch = {"model": st.model, "prompt": [warm, *([list(range(7000, 7600))] * 4)]}
        d = await gw.prepare("completion", "c", batch, {}, "x", explain_only=True)
        assert d.cold_replicas is not None and len(d.cold_replicas) == 1
        others = [s for s in d.decision.scores if s.replica not in d.cold_replicas]
        assert others and all(not s.eligible for s in others), d.decision.scores
        assert d.replica in d.cold_replicas


async def test_an_engine_tokenized_pool_counts_every_text_of_a_batch() -> None:
    """The engine tokenizes (``engine_tokenize``): each text of a batch is asked of it."""
    policy = "models: {default: {tokenizer: engine_tokenize}}"
    async with stack(count=1, policy=policy) as st:
        tok = builtin_tokenizer()
        batch = [words(50 + 10 * i, 300 + i) for i in range(11)]  # more than one round
        body: dict[str, Any] = {"model": st.model, "prompt": batch, "max_tokens": 1}
        d = await st.gw.prepare("completion", "anonymous", body, {}, "x", explain_only=True)
        assert d.prompt_tokens == sum(len(tok.encode(p)) for p in batch) and d.unkeyed
        body["truncate_prompt_tokens"] = 60
        d = await st.gw.prepare("completion", "anonymous", body, {}, "x", explain_only=True)
        assert d.prompt_tokens == 50 + 60 * 10


async def test_the_simulated_replica_serves_a_batch_as_vllm() -> None:
    """One engine request per prompt, a choice each (index i), usage summed (cached tokens
    the last prompt's); streamed chunks carry their prompt's index; and through the
    gateway a batch is answered whole, its size the engine's."""
    async with stack(count=1) as st, st.http() as h, httpx.AsyncClient(timeout=30.0) as direct:
        url = st.fleet.endpoints[0].url + "/v1/completions"
        prompts = [list(range(100, 164)), list(range(100, 164)), list(range(500, 520))]
        body: dict[str, Any] = {"model": st.model, "prompt": prompts, "max_tokens": 3}
        r = await direct.post(url, json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert [c["index"] for c in got["choices"]] == [0, 1, 2]
        assert got["usage"]["prompt_tokens"] == 64 + 64 + 20
        assert got["usage"]["completion_tokens"] == 9
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the last's
        stream = dict(body, stream=True, stream_options={"include_usage": True})
        seen: dict[int, int] = {}
        final: dict[str, Any] = {}
        async with direct.stream("POST", url, json=stream) as s:
            async for line in s.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    seen[c["index"]] = seen.get(c["index"], 0) + 1
                final = chunk.get("usage") or final
        assert seen == {0: 3, 1: 3, 2: 3} and final["prompt_tokens"] == 148
        r = await direct.post(url, json=dict(body, prompt=[[1, 2], [3, -1]]))
        assert r.status_code == 400
        texts = {"model": st.model, "prompt": [words(30, 1), words(40, 2)], "max_tokens": 1}
        texts["truncate_prompt_tokens"] = 35
        d = await st.gw.prepare("completion", "anonymous", dict(texts), {}, "x", explain_only=True)
        r = await h.post("/v1/completions", json=texts)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        assert r.json()["usage"]["prompt_tokens"] == d.prompt_tokens == 30 + 35
