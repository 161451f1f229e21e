"""Red team (H29): a model served under several names is one model to ``sensitive.models``.

vLLM serves one model under every ``--served-model-name`` (``vllm serve /models/llama
--served-model-name llama meta-llama/Llama-3.1-8B``: a card per name, one ``root``), and the
gateway routes either name to it (it groups them: docs/gateway.md, step 4). A tenant whose
policy lists the model under one name (``sensitive.models: [llama]``) had every request
naming the other keyed in its tenant scope: indexed, cached tenant-wide, its prefix timed by
every other holder of the key, while the operator's rule read as covering the model (a
listed model's LoRA adapters were the same bug, fixed before: docs/security.md). The rule
now covers each name the replicas serve the listed model by, and adapters of any of them.

Real components: a real gateway and simulated replica, and between them a small real HTTP
proxy that lists an alias of the replica's model (same ``root``, as vLLM does), sends
requests naming it on under the replica's name, and records every body the engine gets.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest

from cachecore.keys import EPHEMERAL_SALT_PREFIX, ScopeKind
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import ReplicaSettings
from cachecore.testing import serve_asgi
from tests.test_gateway_support import FAST, stack, words
from tests.test_isolation import auth, chat_body, key_store

pytestmark = pytest.mark.timeout(90)

ALIAS = "sim-alias/Served-Name-8B"
_HOP = {b"host", b"content-length", b"transfer-encoding", b"connection"}


@asynccontextmanager
async def aliasing_proxy(
    upstream: str, model: str, adapters: tuple[str, ...] = ()
) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """An HTTP proxy to a replica serving ``model`` that serves it as ``ALIAS`` too (vLLM's
    card for a second served name: same root, no parent); yields its URL and the bodies of
    the completions it passed on."""
    bodies: list[dict[str, Any]] = []
    client = httpx.AsyncClient(base_url=upstream, timeout=30.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["method"] == "POST" and body:
            parsed = orjson.loads(body)
            if parsed.get("model") == ALIAS:
                parsed["model"] = model  # the engine's one model, under its other name
            if scope["path"].endswith("completions"):
                bodies.append(parsed)
            body = orjson.dumps(parsed)
        query = scope.get("query_string", b"")
        target = scope["path"] + ("?" + query.decode() if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        r = await client.request(scope["method"], target, content=body, headers=headers)
        content = r.content
        if scope["path"] == "/v1/models" and r.status_code == 200:
            listing = r.json()
            card = next(c for c in listing["data"] if c["id"] == model)
            alias = {**card, "id": ALIAS}
            listing["data"].insert(1, alias)
            for c in listing["data"]:
                if c["id"] in adapters:  # vLLM: an adapter's parent is the first name
                    c["parent"] = model
            content = orjson.dumps(listing)
        out = [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP]
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": content})

    try:
        async with serve_asgi(app) as url:
            yield url, bodies
    finally:
        await client.aclose()


@asynccontextmanager
async def aliased(policy: str, replica: ReplicaSettings = FAST) -> AsyncIterator[Any]:
    """A gateway whose one replica is served under its model's name and ``ALIAS``."""
    async with run_fleet(replica, count=1) as fleet:
        ep = fleet.endpoints[0]
        async with (
            aliasing_proxy(ep.url, ep.model, tuple(replica.lora)) as (url, bodies),
            stack(
                count=0,
                policy=policy,
                extra_replicas=[url],
                build={"key_store": key_store()},
                open_access=False,
            ) as st,
        ):
            yield st, ep.model, bodies


async def _wait_models(st: Any, names: set[str]) -> None:
    deadline = time.monotonic() + 10.0
    async with st.http() as h:
        while True:
            listed = {
                c["id"] for c in (await h.get("/v1/models", headers=auth("sk-a"))).json()["data"]
            }
            if names <= listed:
                return
            assert time.monotonic() < deadline, listed
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("listed", ["first", "alias"])
async def test_sensitive_models_covers_every_served_name_of_the_model(listed: str) -> None:
    name = FAST.model if listed == "first" else ALIAS
    policy = f"tenants: {{a: {{sensitive: {{models: ['{name}'], models_kind: session}}}}, b: {{}}}}"
    async with aliased(policy) as (st, model, bodies), st.http() as h:
        await _wait_models(st, {model, ALIAS})
        system = words(320, 7)
        for requested in (model, ALIAS):
            d = await st.gw.prepare(
                "chat",
                "a",
                chat_body(requested, system, "q"),
                {"x-kvgate-session": "s1"},
                "r",
                True,
            )
            assert d.scope.kind is ScopeKind.SESSION, (requested, d.scope)
        # end to end: both names reach the engine under an ephemeral (per-session) salt, and
        # another session of the tenant gets no hit on what the first one sent
        for i, (requested, session) in enumerate(((model, "s1"), (ALIAS, "s1"), (ALIAS, "s2"))):
            headers = auth("sk-a") | {"x-kvgate-session": session}
            r = await h.post(
                "/v1/chat/completions", json=chat_body(requested, system, f"q{i}"), headers=headers
            )
            assert r.status_code == 200, r.text
            assert bodies[-1]["cache_salt"].startswith(EPHEMERAL_SALT_PREFIX), requested
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if session == "s2":
                assert cached == 0  # before: ~320, session s1's prompt, sent under ALIAS
        # tenant b (no rule) is untouched: its scope is its tenant's
        r = await h.post(
            "/v1/chat/completions", json=chat_body(ALIAS, system, "qb"), headers=auth("sk-b")
        )
        assert r.status_code == 200 and not bodies[-1]["cache_salt"].startswith(
            EPHEMERAL_SALT_PREFIX
        )


async def test_sensitive_models_covers_adapters_of_a_listed_alias() -> None:
    """An adapter's card names the base model's first name as its parent: a rule listing
    the model by its other name covers the adapter too."""
    replica = FAST.model_copy(update={"lora": ["ad-one"]})
    policy = f"tenants: {{a: {{sensitive: {{models: ['{ALIAS}'], models_kind: request}}}}}}"
    async with aliased(policy, replica) as (st, model, _):
        await _wait_models(st, {model, ALIAS, "ad-one"})
        body = {"model": "ad-one", "prompt": words(64, 3), "max_tokens": 1}
        d = await st.gw.prepare("completion", "a", body, {}, "r", True)
        assert d.scope.kind is ScopeKind.REQUEST
