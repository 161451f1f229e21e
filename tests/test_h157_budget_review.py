"""Review of the uncached-token budget's refunds and charges (H157): a tenant must not get
engine compute it is not charged for. Real gateways against loopback engines on free ports.

A request sent on a reused keep-alive connection that the replica closes unanswered is
resent on a fresh connection (the idle-close race); when that connect is refused, the
replica may have read the request and died of it (a query of death on a warm connection):
a drop, which keeps the charge and spends the drop budget, not a connect failure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text
from tests.test_gateway_support import SECRET, words
from tests.test_h24_query_of_death import MODELS, read_request

pytestmark = pytest.mark.timeout(60)

POISON = b"poison"


def _completion(prompt_tokens: int) -> bytes:
    return (
        b'{"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": '
        b'[{"index": 0, "text": "a", "finish_reason": "length"}], "usage": '
        b'{"prompt_tokens": %d, "completion_tokens": 1, "total_tokens": %d}}'
        % (prompt_tokens, prompt_tokens + 1)
    )


@contextlib.asynccontextmanager
async def warm_then_dying_engine() -> AsyncIterator[dict[str, Any]]:
    """A loopback engine that answers completions on keep-alive connections until it reads
    one whose body holds ``POISON``: then, like an API server that crashes on it, it stops
    listening (its port refuses connections) and closes the connection unanswered. Yields
    its URL, the completions it answered (``answered``) and the poisoned ones it read."""
    state: dict[str, Any] = {"url": "", "answered": 0, "poisoned": 0}
    server: asyncio.Server | None = None

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(200):  # bounded: a test sends a few dozen requests
                path, body = await read_request(reader)
                if path == b"/v1/completions":
                    if POISON in body:
                        state["poisoned"] += 1
                        assert server is not None
                        server.close()  # dead: no new connection from here
                        return  # this one closed unanswered (finally)
                    state["answered"] += 1
                    answer = _completion(8)
                elif path in (b"/health", b"/v1/models"):
                    answer = MODELS if path == b"/v1/models" else b"{}"
                else:
                    answer = b"{}"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    state["url"] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


def _gateway(urls: list[str], policy: str) -> Any:
    gs = GatewaySettings(
        replicas=urls,
        port=free_port(),
        open_access=True,
        salt_secrets=[SecretStr(SECRET)],
        drop_retries=0,
    )
    # no health probe after start-up: the dead engine stays a candidate, as between probes
    return build_gateway(gs, policy=parse_policy_text(f"health: {{interval_s: 30}}\n{policy}"))


async def test_a_warm_connection_closed_by_a_dying_engine_keeps_the_charge() -> None:
    """The poison request goes on the connection the warm-up left idle; the engine closes
    it unanswered and refuses the resend's connect. It was given its charge back (the
    resend's refused connect read as 'never sent'), so a tenant's query of death on a warm
    connection cost its budget nothing."""
    limits = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 5000}"
    async with warm_then_dying_engine() as a:
        gw = _gateway([a["url"]], limits)
        refunds: list[float] = []
        refund = gw.limiter.refund_uncached

        def spy(tenant: str, tokens: float, now: float) -> None:
            refunds.append(tokens)
            refund(tenant, tokens, now)

        gw.limiter.refund_uncached = spy
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=30.0) as h:
            body = {"model": "m", "prompt": words(8, 1), "max_tokens": 1}
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 200 and a["answered"] == 1, r.text
            poison = {**body, "prompt": words(900, 2) + " " + POISON.decode()}
            r = await h.post("/v1/completions", json=poison)
            assert r.status_code == 502 and a["poisoned"] == 1, r.text
            assert refunds == [], refunds  # the engine read it: no refund


async def test_a_warm_connection_drop_spends_the_drop_budget() -> None:
    """With ``drop_retries`` 0, a poison request reaches one engine. Two engines, each with
    a warm connection: the first's close-then-refuse was read as a connect failure, not a
    drop, so the request went on to the second, which died of it too."""
    async with warm_then_dying_engine() as a, warm_then_dying_engine() as b:
        gw = _gateway([a["url"], b["url"]], "")
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=30.0) as h:
            for i in range(40):  # bounded: until both have a warm connection
                body = {"model": "m", "prompt": words(8, 100 + i), "max_tokens": 1}
                r = await h.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                if a["answered"] and b["answered"]:
                    break
            assert a["answered"] and b["answered"]
            poison = {**body, "prompt": words(50, 2) + " " + POISON.decode()}
            r = await h.post("/v1/completions", json=poison)
            assert r.status_code == 502, r.text
            assert a["poisoned"] + b["poisoned"] == 1, (a, b)
