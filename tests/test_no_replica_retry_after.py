"""Every 503 ``no_replica`` says when to ask again: ``Retry-After``.

When no replica could serve (none healthy, every one cordoned or draining, none at all for
a request without ``model``), the gateway answered a retryable 503 ``no_replica`` without
``Retry-After``, so clients fell back on their own backoff (the OpenAI SDKs: 0.5 s, then
1 s, for their 2 retries), while its other retryable refusals (429s, 503
``api_key_store_unavailable``) say when. Now each carries ``Retry-After``: the policy's
health-check interval (``health.interval_s``) rounded up to whole seconds, 1 s at the
default 0.5 s, at most 10 s: until the next check the gateway's view of its replicas'
health cannot change. Checked through the HTTP API (OpenAI's error JSON and the header),
on the hot path (/v1/completions) and the app's (/v1/chat/completions), streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.routing import NoCandidateError
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from tests.test_gateway_support import ADMIN, SECRET, Stack, stack, words

pytestmark = pytest.mark.timeout(60)

CORDONED = "every replica serving this model is cordoned or draining"
UNHEALTHY = "no healthy replica serves this model"


def _bodies(model: str | None) -> list[tuple[str, dict[str, Any]]]:
    """A completion and a chat request, each plain and streamed; without ``model`` when
    it is None."""
    named = {"model": model} if model is not None else {}
    out = []
    for stream in (False, True):
        out.append(("/v1/completions", {**named, "prompt": words(16, 1), "max_tokens": 1}))
        chat = {"messages": [{"role": "user", "content": words(16, 2)}], "max_tokens": 1}
        out.append(("/v1/chat/completions", {**named, **chat}))
        if stream:
            for _, body in out[-2:]:
                body["stream"] = True
    return out


async def assert_no_replica(
    h: httpx.AsyncClient, path: str, body: dict[str, Any], message: str, retry_after: str = "1"
) -> None:
    r = await h.post(path, json=body)
    assert r.status_code == 503, (path, r.status_code, r.text)
    assert r.headers.get("retry-after") == retry_after, (path, dict(r.headers))
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert (err["type"], err["code"], err["message"]) == (
        "service_unavailable", "no_replica", message,
    ), (path, err)  # fmt: skip


async def _set_out(st: Stack, h: httpx.AsyncClient, action: str) -> None:
    for i in range(len(st.gw.specs)):
        r = await h.post(f"/admin/replicas/{st.replica_id(i)}/{action}", headers=st.admin_headers())
        assert r.status_code == 200, r.text


async def test_every_replica_cordoned() -> None:
    async with stack(count=2) as st, st.http() as h:
        await _set_out(st, h, "cordon")
        for path, body in _bodies(st.model):
            await assert_no_replica(h, path, body, CORDONED)
        # without a model: told so, with the same header
        for path, body in _bodies(None):
            await assert_no_replica(
                h, path, body,
                "every replica is cordoned or draining: none can serve a request without "
                "'model'",
            )  # fmt: skip
        # the admin's explain (its own wrapper in the app) too
        r = await h.post(
            "/admin/route/explain", headers=st.admin_headers(), json=_bodies(st.model)[0][1]
        )
        assert (r.status_code, r.headers.get("retry-after")) == (503, "1"), r.text
        assert r.json()["error"]["code"] == "no_replica"
        # the OpenAI SDK reads it: InternalServerError (retried), the header on its response
        c = st.client()
        with pytest.raises(openai.InternalServerError) as exc:
            await c.completions.create(model=st.model, prompt=words(8, 3), max_tokens=1)
        assert exc.value.response.headers.get("retry-after") == "1"


async def test_every_replica_draining() -> None:
    async with stack(count=1) as st, st.http() as h:
        await _set_out(st, h, "drain")
        for path, body in _bodies(st.model)[:2]:
            await assert_no_replica(h, path, body, CORDONED)


async def test_no_healthy_replica_says_the_health_interval_rounded_up() -> None:
    """Both replicas answer /health 503: the gateway's next check marks them unhealthy.
    The policy checks every 1.5 s: Retry-After 2."""
    policy = "health:\n  interval_s: 1.5\n"
    async with stack(count=2, policy=policy) as st, st.http() as h:
        assert st.gw.pool is not None
        for ep in st.fleet.endpoints:
            r = await h.post(f"{ep.url}/debug/health", json={"healthy": False})
            assert r.status_code == 200, r.text
        for _ in range(100):  # bounded: 100 x 0.05 s, past one check and its timeout
            if not st.gw.pool.candidates(st.model):
                break
            await asyncio.sleep(0.05)
        assert not st.gw.pool.candidates(st.model)
        for path, body in _bodies(st.model):
            await assert_no_replica(h, path, body, UNHEALTHY, retry_after="2")
        for path, body in _bodies(None)[:2]:
            await assert_no_replica(
                h, path, body, "no healthy replica to serve a request without 'model'", "2"
            )


async def test_a_sparse_health_check_asks_for_10_s_at_most() -> None:
    async with stack(count=1, policy="health:\n  interval_s: 45\n") as st, st.http() as h:
        await _set_out(st, h, "cordon")
        await assert_no_replica(h, *_bodies(st.model)[0], CORDONED, retry_after="10")


@contextlib.asynccontextmanager
async def _no_replica_gateway() -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(
        port=free_port(), open_access=True, salt_secrets=[SecretStr(SECRET)],
        admin_key=SecretStr(ADMIN), seed=7,
    )  # fmt: skip
    gw = build_gateway(settings)
    async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=30) as h:
        yield h


async def test_a_request_without_model_and_no_replica_at_all() -> None:
    async with _no_replica_gateway() as h:
        for path, body in _bodies(None):
            await assert_no_replica(
                h, path, body, "no healthy replica to serve a request without 'model'"
            )


async def test_a_router_that_finds_no_candidate() -> None:
    """The router's NoCandidateError (a confined tenant's cold request none of its cold
    replicas can take) was turned into the 503 by the app, without the header."""
    async with stack(count=1) as st, st.http() as h:

        def decide(*args: Any, **kw: Any) -> Any:
            raise NoCandidateError("none of the tenant's cold replicas can take this request")

        st.gw.router.decide = decide  # type: ignore[method-assign]
        for path, body in _bodies(st.model):
            await assert_no_replica(
                h, path, body, "none of the tenant's cold replicas can take this request"
            )
        # the admin's explain: prepare's 503 too (the app's own wrapper, without the header,
        # was unreachable for it and is gone)
        r = await h.post(
            "/admin/route/explain", headers=st.admin_headers(), json=_bodies(st.model)[0][1]
        )
        assert (r.status_code, r.headers.get("retry-after")) == (503, "1"), r.text
        assert r.json()["error"]["code"] == "no_replica"


async def test_a_replica_removed_before_the_request_is_sent() -> None:
    """The proxy's own 503: the chosen replica left the pool after the routing decision and
    no other can take the request."""
    async with stack(count=1) as st, st.http() as h:
        gw = st.gw
        assert gw.pool is not None
        pool, prepare = gw.pool, gw.prepare

        async def prepare_then_remove(*args: Any, **kw: Any) -> Any:
            d = await prepare(*args, **kw)
            pool.remove(d.replica)
            return d

        gw.prepare = prepare_then_remove  # type: ignore[method-assign]
        await assert_no_replica(h, *_bodies(st.model)[0], "no replica available")
