"""The per-tenant rule for the engine scheduling ``priority`` field, end to end: a real
gateway, a real simulated replica, and between them a small real HTTP proxy that records
every body the engine receives. Before the rule a client's priority reached the engine as
sent, so on an engine running ``--scheduling-policy priority`` one tenant could schedule its
requests ahead of every other tenant's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pydantic import SecretStr

from cachecore.replica.fleet import run_fleet
from cachecore.testing import free_port, serve_asgi
from gateway.auth import hash_key
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import PolicyError, parse_policy_text
from tests.test_gateway_support import ADMIN, FAST, SECRET, words

pytestmark = pytest.mark.timeout(90)

_HOP = {b"host", b"content-length", b"transfer-encoding", b"connection"}


@asynccontextmanager
async def recording_proxy(upstream: str) -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """An HTTP proxy to ``upstream`` that records the JSON body of every completion."""
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
        if scope["method"] == "POST" and scope["path"].endswith("completions"):
            bodies.append(orjson.loads(body))
        query = scope.get("query_string", b"")
        target = scope["path"] + ("?" + query.decode() if query else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        r = await client.request(scope["method"], target, content=body, headers=headers)
        out = [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP]
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": r.content})

    try:
        async with serve_asgi(app) as url:
            yield url, bodies
    finally:
        await client.aclose()


@asynccontextmanager
async def gateway(
    policy: str | None, **settings: Any
) -> AsyncIterator[tuple[str, str, list[dict[str, Any]]]]:
    """A gateway whose one replica sits behind the recording proxy: (gateway URL, model,
    the bodies the engine received)."""
    async with run_fleet(FAST, count=1) as fleet:
        endpoint = fleet.endpoints[0]
        async with recording_proxy(endpoint.url) as (proxy, bodies):
            settings.setdefault("open_access", "api_keys_file" not in settings)
            gs = GatewaySettings(
                replicas=[proxy],
                port=free_port(),
                salt_secrets=[SecretStr(SECRET)],
                admin_key=SecretStr(ADMIN),
                seed=7,
                **settings,
            )
            pol = parse_policy_text(policy) if policy is not None else None
            gw = build_gateway(gs, policy=pol)
            async with serve_in_loop(gw) as url:
                yield url, endpoint.model, bodies


async def received(
    h: httpx.AsyncClient, model: str, bodies: list[dict[str, Any]], **fields: Any
) -> tuple[int, Any]:
    """Send a completion with ``fields``; return its status and what the engine got for
    ``priority`` (``"absent"`` when the engine got no such field; None: no request)."""
    before = len(bodies)
    body = {"model": model, "prompt": words(40, 900 + before), "max_tokens": 1, **fields}
    r = await h.post("/v1/completions", json=body)
    if r.status_code == 200 and fields.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    got = bodies[before:]
    assert len(got) <= 1
    return r.status_code, (got[0].get("priority", "absent") if got else None)


ABSENT = object()  # the client sends no priority


@pytest.mark.parametrize(
    ("policy", "cases"),
    [
        # the default: strip (every tenant at the engine's default)
        (None, {-5: "absent", 7: "absent", ABSENT: "absent"}),
        (
            "default_tenant: {priority: {mode: passthrough}}",
            {-5: -5, 7: 7, ABSENT: "absent"},
        ),
        (
            "default_tenant: {priority: {mode: fixed, value: 3}}",
            {-100: 3, 3: 3, ABSENT: 3},
        ),
        (
            "default_tenant: {priority: {mode: clamp, min: 0, max: 10}}",
            {-5: 0, 50: 10, 4: 4, "6": 6, ABSENT: 0},
        ),
    ],
    ids=["default-strip", "passthrough", "fixed", "clamp"],
)
async def test_the_engine_receives_the_tenants_priority(
    policy: str | None, cases: dict[object, object]
) -> None:
    async with (
        gateway(policy) as (url, model, bodies),
        httpx.AsyncClient(base_url=url, timeout=30.0) as h,
    ):
        for stream in (False, True):  # the byte-level fast path, and a rewritten body
            for sent, want in cases.items():
                fields: dict[str, Any] = {"stream": stream} if stream else {}
                if sent is not ABSENT:
                    fields["priority"] = sent
                assert await received(h, model, bodies, **fields) == (200, want), (sent, stream)


async def test_a_priority_that_is_no_integer_is_a_400_before_the_engine() -> None:
    async with (
        gateway("default_tenant: {priority: {mode: passthrough}}") as (url, model, bodies),
        httpx.AsyncClient(base_url=url, timeout=30.0) as h,
    ):
        for bad in ("high", 1.5, None, [1]):
            body = {"model": model, "prompt": "hi", "max_tokens": 1, "priority": bad}
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 400, bad
            err = r.json()["error"]
            assert err["param"] == "priority" and "integer" in err["message"]
        assert bodies == []  # refused before routing


async def test_each_tenant_gets_its_own_priority_rule(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - {{sha256: {hash_key('sk-gold')}, tenant: gold}}\n"
        f"  - {{sha256: {hash_key('sk-free')}, tenant: free}}\n"
    )
    policy = (
        "tenants:\n"
        "  gold: {priority: {mode: clamp, min: 0}}\n"
        "  free: {priority: {mode: fixed, value: 10}}\n"
    )
    async with gateway(policy, api_keys_file=keys) as (url, model, bodies):
        for key, want in (("sk-gold", 0), ("sk-free", 10)):
            auth = {"authorization": f"Bearer {key}"}
            async with httpx.AsyncClient(base_url=url, timeout=30.0, headers=auth) as h:
                # both ask to run first (vLLM: lower first)
                assert await received(h, model, bodies, priority=-1000) == (200, want)


@pytest.mark.parametrize(
    ("rule", "field"),
    [
        ("{mode: fixed}", "priority.value"),
        ("{mode: strip, value: 1}", "priority.value"),
        ("{mode: clamp}", "priority.min"),
        ("{mode: clamp, min: 5, max: 1}", "priority.min"),
        ("{mode: passthrough, max: 1}", "priority.max"),
        ("{mode: first}", "priority.mode"),
        ("{mode: fixed, value: 1.5}", "priority.value"),
    ],
)
def test_an_invalid_priority_rule_names_its_field(rule: str, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_text(f"tenants: {{acme: {{priority: {rule}}}}}")
    assert f"tenants.acme.{field}" in err.value.fields, err.value.fields
