"""A request whose exchange a replica breaks after receiving it (its engine died of it: a
query of death) is retried on at most ``KVGATE_DROP_RETRIES`` (1) more replicas. It was
retried on up to ``KVGATE_RETRIES`` (2) more, so one poison request took three engines down
one after another. A refused connection (the request never sent) keeps the full budget."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.replica.fleet import run_fleet
from cachecore.testing import free_port
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text
from tests.test_gateway_support import FAST, SECRET, words

pytestmark = pytest.mark.timeout(60)

MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One HTTP/1.1 request read whole (a Content-Length body, if any): its path and body."""
    head = await reader.readuntil(b"\r\n\r\n")
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    body = await reader.readexactly(n) if n else b""
    return head.split(b" ", 2)[1], body


@contextlib.asynccontextmanager
async def dying_engine() -> AsyncIterator[dict[str, Any]]:
    """A loopback engine that answers /health and /v1/models and, like an engine that
    crashes on a request, closes the connection with no answer on every completion it
    reads whole. Yields its URL, the number of completions it received (``posts``) and
    ``stop`` (await it: from then on its port refuses connections)."""
    state: dict[str, Any] = {"url": "", "posts": 0}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100):  # bounded: a test sends a handful of requests
                path, _ = await read_request(reader)
                if path == b"/v1/completions":
                    state["posts"] += 1
                    return  # closed unanswered (finally)
                body = MODELS if path == b"/v1/models" else b"{}"
                status = b"200 OK" if path in (b"/health", b"/v1/models") else b"404 Not Found"
                writer.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n" % (status, len(body)))
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    state["url"] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def stop() -> None:  # from now on its port refuses connections
        server.close()
        await server.wait_closed()

    state["stop"] = stop
    try:
        yield state
    finally:
        await stop()


async def _post(replicas: list[str], **settings: Any) -> httpx.Response:
    gs = GatewaySettings(
        replicas=replicas,
        port=free_port(),
        open_access=True,
        salt_secrets=[SecretStr(SECRET)],
        **settings,
    )
    async with (
        serve_in_loop(build_gateway(gs)) as url,
        httpx.AsyncClient(base_url=url, timeout=30.0) as h,
    ):
        body = {"model": "m", "prompt": "a prompt that crashes its engine", "max_tokens": 1}
        return await h.post("/v1/completions", json=body)


async def test_a_request_that_kills_its_engine_reaches_at_most_two_replicas() -> None:
    async with dying_engine() as a, dying_engine() as b, dying_engine() as c:
        r = await _post([a["url"], b["url"], c["url"]])
        assert r.status_code == 502
        err = r.json()["error"]
        assert "2 replicas closed the connection" in err["message"], err
        # before: all three engines got it (KVGATE_RETRIES=2)
        assert a["posts"] + b["posts"] + c["posts"] == 2


async def test_drop_retries_zero_sends_it_once_and_the_budget_is_configurable() -> None:
    async with dying_engine() as a, dying_engine() as b, dying_engine() as c:
        r = await _post([a["url"], b["url"], c["url"]], drop_retries=0)
        assert r.status_code == 502
        assert a["posts"] + b["posts"] + c["posts"] == 1
    async with dying_engine() as a, dying_engine() as b, dying_engine() as c:
        r = await _post([a["url"], b["url"], c["url"]], drop_retries=5)
        assert r.status_code == 502
        assert a["posts"] + b["posts"] + c["posts"] == 3  # KVGATE_RETRIES still bounds it


async def test_refused_connections_do_not_spend_the_drop_budget() -> None:
    """With ``drop_retries`` 0, requests to a fleet of two replicas that refuse connections
    (stopped after the gateway's start-up probes; never sent: no drop) and one live replica
    all reach the live one. Four fresh gateways: with refusals counted as drops, each whose
    first pick is a refuser answered 502 (two in three)."""
    async with run_fleet(FAST, count=1) as fleet:
        for _ in range(4):
            async with dying_engine() as a, dying_engine() as b:
                urls = [a["url"], b["url"], fleet.urls[0]]
                gs = GatewaySettings(
                    replicas=urls,
                    port=free_port(),
                    open_access=True,
                    salt_secrets=[SecretStr(SECRET)],
                    drop_retries=0,
                )
                policy = parse_policy_text("health: {interval_s: 30}")  # no probe after start
                gw = build_gateway(gs, policy=policy)
                async with (
                    serve_in_loop(gw) as url,
                    httpx.AsyncClient(base_url=url, timeout=30.0) as h,
                ):
                    await a["stop"]()
                    await b["stop"]()
                    body = {
                        "model": fleet.endpoints[0].model,
                        "prompt": words(30, 3),
                        "max_tokens": 1,
                    }
                    r = await h.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text


async def test_a_dropped_request_keeps_its_uncached_token_charge() -> None:
    """A replica that took the request and closed the connection unanswered may have
    computed it (and died of it): the 502's charge is kept, where a request no replica
    could be connected to gets its charge back. It was given back (the drop ends as a
    connect failure), so a tenant's poison requests cost its budget nothing."""
    async with dying_engine() as a:
        gs = GatewaySettings(
            replicas=[a["url"]],
            port=free_port(),
            open_access=True,
            salt_secrets=[SecretStr(SECRET)],
            drop_retries=0,
        )
        limits = "limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
        gw = build_gateway(gs, policy=parse_policy_text(f"default_tenant:\n  {limits}"))
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=30.0) as h:
            body = {"model": "m", "prompt": words(900, 5), "max_tokens": 1}
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 502 and a["posts"] == 1, r.text
            r = await h.post("/v1/completions", json={**body, "prompt": words(900, 6)})
            assert r.status_code == 429, r.text  # refunded, it was sent (and dropped) again
            assert r.json()["error"]["limit"] == "uncached_tokens"
            assert a["posts"] == 1
