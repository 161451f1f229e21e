"""What a client sees when its replica answers with something other than a completion or
an error (scripted fake replicas behind the real gateway, a real keep-alive client)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.test_upstream_faults import MODEL, FakeReplica, completion, gateway

pytestmark = pytest.mark.timeout(60)


def raw_answer(status: int, body: bytes, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n"
    return head % (status, len(body), extra) + body


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        raw_answer(302, b"", b"location: http://elsewhere/v1/completions\r\n"),
        raw_answer(201, b'{"choices": []}'),
    ],
)
async def test_a_status_that_is_neither_a_completion_nor_an_error_is_a_502(reply: bytes) -> None:
    """A replica's 204 (or 3xx, 201) was relayed with its status and the gateway's error
    body: after a 204 or a 304 carrying a body the client's next response on the same
    keep-alive connection failed to parse ('illegal status line'), and a 3xx or 2xx told
    an SDK nothing. It is a 502 in OpenAI's shape, counted against the replica."""
    replies = [reply]

    async def script(w: asyncio.StreamWriter) -> None:
        if replies:
            w.write(replies.pop())
        else:
            w.write(raw_answer(200, json.dumps({"choices": [{"index": 0, "text": "ok"}]}).encode()))

    rep = FakeReplica(script)
    async with gateway([rep]) as (gw, _):
        base = f"http://{gw.settings.host}:{gw.settings.port}"
        limits = httpx.Limits(max_connections=1)  # both requests on one connection
        async with httpx.AsyncClient(base_url=base, timeout=10, limits=limits) as h:
            r = await h.post("/v1/completions", json=completion("a"))
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "upstream_error" and "HTTP" in err["message"]
            after = await h.post("/v1/completions", json=completion("b"))
            assert after.status_code == 200, after.text
        assert rep.posts == 2
        assert gw.pool is not None
        rid = gw.pool.all()[0].id
        assert gw.metrics.upstream_errors.labels(rid, "protocol")._value.get() == 1


@pytest.mark.parametrize("status", [429, 503])
async def test_an_engines_retry_after_reaches_the_client(status: int) -> None:
    """An engine's (or the rate limiter in front of it) 429 or 503 with ``Retry-After``
    reached the client without the header, so the OpenAI SDK retried on its own short
    backoff (0.5 s, 1 s, ...) into the same refusal instead of waiting as told."""
    body = json.dumps({"error": {"message": "slow down", "type": "x", "code": status}})

    async def refuse(w: asyncio.StreamWriter) -> None:
        w.write(raw_answer(status, body.encode(), b"Retry-After: 7\r\n"))

    async with gateway([FakeReplica(refuse)]) as (_, h):
        for stream in (False, True):
            r = await h.post("/v1/completions", json={**completion(), "stream": stream})
            assert r.status_code == status
            assert r.headers.get("retry-after") == "7"
            assert r.json()["error"]["message"] == "slow down"
        client = AsyncOpenAI(base_url=str(h.base_url) + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert err.value.status_code == status
        assert err.value.response.headers["retry-after"] == "7"


async def test_an_engine_error_that_is_a_bare_string_keeps_its_words() -> None:
    """``{"error": "...", "error_type": ...}`` (TGI's shape, and what many proxies in front
    of an engine answer) reached the client as "upstream replica returned HTTP 422", the
    engine's reason dropped."""
    body = json.dumps(
        {"error": "Input validation error: top_p must be > 0", "error_type": "validation"}
    )

    async def refuse(w: asyncio.StreamWriter) -> None:
        w.write(raw_answer(422, body.encode()))

    async with gateway([FakeReplica(refuse)]) as (_, h):
        for stream in (False, True):
            r = await h.post("/v1/completions", json={**completion(), "stream": stream})
            assert r.status_code == 422
            err = r.json()["error"]
            assert err["message"] == "Input validation error: top_p must be > 0"
            assert err["type"] == "validation"
