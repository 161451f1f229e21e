"""An engine-tokenized pool whose engine answers its render (or /tokenize) call with 429
or 503 and a Retry-After: the client hears that status and that wait, in OpenAI's error
shape, as the proxy relays the same answer from the completion endpoint (048b99c). It
heard ``502 "engine tokenization returned 429"``, so the SDKs retried on their own short
backoff (or, for a 502, not as a rate limit at all)."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_upstream_faults import FakeReplica, gateway

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("status", [429, 503])
async def test_an_engines_429_or_503_to_tokenize_reaches_the_client_with_its_retry_after(
    status: int,
) -> None:
    body = b'{"error": {"message": "engine is busy", "type": "Busy", "code": 7}}'

    async def busy(w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\nretry-after: 17\r\n"
            b"content-length: %d\r\n\r\n%b" % (status, len(body), body)
        )

    policy = "models: {default: {tokenizer: engine_render}}"
    async with gateway([FakeReplica(busy)], policy) as (_gw, h):
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        r = await h.post("/v1/chat/completions", json=chat)
    assert r.status_code == status, r.text
    assert r.headers.get("retry-after") == "17"
    err = r.json()["error"]
    assert err["message"] == "engine is busy"
    assert err["type"] == "Busy" and err["code"] == 7


async def test_an_engines_bare_429_to_tokenize_is_a_429_without_a_made_up_wait() -> None:
    """No error object and no Retry-After: still the engine's status, with the gateway's
    words and no Retry-After of its own invention."""

    async def bare(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 429 X\r\ncontent-length: 4\r\n\r\nslow")

    policy = "models: {default: {tokenizer: engine_render}}"
    async with gateway([FakeReplica(bare)], policy) as (_gw, h):
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        r = await h.post("/v1/chat/completions", json=chat)
    assert r.status_code == 429, r.text
    assert "retry-after" not in r.headers
    assert r.json()["error"]["message"] == "engine tokenization returned 429"
