"""Scope fixes from the twenty-fifth session's isolation review: ``sensitive.models`` covers
a listed model's LoRA adapters (a request naming the adapter was keyed in the tenant's, or
its trust group's, scope and its prompt served from cache to a group member)."""

from __future__ import annotations

import orjson
import pytest

from cachecore.keys import ScopeKind
from cachecore.replica.settings import ReplicaSettings
from gateway.auth import KeyStore, hash_key
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(120)

KEYS = {"sk-a": "a", "sk-b": "b"}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_sensitive_models_cover_the_models_adapters() -> None:
    with_lora = ReplicaSettings(time_scale=0.05, lora=["acme-ft"])
    policy = (
        "tenants: {a: {trust_group: g, sensitive: {models: [kvgate-sim-8b],"
        " models_kind: request}}, b: {trust_group: g}}\ntrust_groups: {g: [a, b]}"
    )
    build = {"key_store": KeyStore({hash_key(k): t for k, t in KEYS.items()})}
    async with (
        stack(count=1, replica=with_lora, policy=policy, build=build, open_access=False) as st,
        st.http() as h,
    ):
        prompt = words(400, 995)
        for model in (st.model, "acme-ft"):
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            d = await st.gw.prepare("completion", "a", dict(body), {}, "x", explain_only=True)
            assert d.scope.kind is ScopeKind.REQUEST, model
        # b, never sensitive, in a's trust group, re-sends a's adapter prompt: no hit
        for key, tail in (("sk-a", " a"), ("sk-b", " b")):
            body = {"model": "acme-ft", "prompt": prompt + tail, "max_tokens": 1}
            r = await h.post("/v1/completions", json=body, headers=auth(key))
            assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_media_uuids_name_items_of_the_requests_own_scope_only() -> None:
    """vLLM takes a media part's ``uuid`` as the item's hash in its processor and encoder
    caches (no cache_salt scopes them) and serves a part with no data but a uuid from
    there: b naming a's uuid read a's image. The gateway sends each uuid scoped like the
    salt: the same within a scope (reuse works), another in every other scope."""
    build = {"key_store": KeyStore({hash_key(k): t for k, t in KEYS.items()})}
    async with stack(count=1, build=build, open_access=False) as st:
        image = {"url": "data:image/png;base64,iVBORw0KGgo="}

        async def sent(tenant: str, part: dict[str, object]) -> tuple[dict[str, object], str]:
            text = {"type": "text", "text": "describe"}
            body = {
                "model": st.model,
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [text, part]}],
            }
            d = await st.gw.prepare("chat", tenant, body, {}, "x", explain_only=True)
            up = orjson.loads(st.gw.upstream_body(d))
            content = up["messages"][0]["content"]
            assert content[0] == text
            return content[1], up["cache_salt"]

        uid = "acme-contract-scan-0042"
        a1, _ = await sent("a", {"type": "image_url", "image_url": image, "uuid": uid})
        a2, _ = await sent("a", {"type": "image_url", "image_url": None, "uuid": uid})
        b, _ = await sent("b", {"type": "image_url", "image_url": None, "uuid": uid})
        assert a1["uuid"] == a2["uuid"] != uid and str(a1["uuid"]).startswith("kvg1:")
        assert b["uuid"] != a1["uuid"] and b["image_url"] is None
        assert a1["image_url"] == image
        plain, _ = await sent("a", {"type": "image_url", "image_url": image})
        assert "uuid" not in plain  # no uuid asked, none added
