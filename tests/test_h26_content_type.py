"""A completion request whose Content-Type is not JSON is refused as vLLM refuses it.

The gateway read any body as JSON whatever its Content-Type said: ``text/plain`` with a
JSON body (what a browser may send cross-origin without a preflight) was routed and
answered 200. vLLM's OpenAI server refuses it on both completion routes (its
``validate_json_request`` dependency raises a RequestValidationError, which its handler
answers as a 400 whose message carries "Unsupported Media Type: Only 'application/json' is
allowed"); so does the gateway now, in its OpenAI error object, before reading the body, on
the hot path and the ASGI app alike. ``application/json`` with parameters and a request
without a Content-Type are still served.

Real pieces: a gateway on loopback with one simulated replica."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)

MESSAGE = "Unsupported Media Type: Only 'application/json' is allowed"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_non_json_content_type_is_refused_as_vllm_does(path: str) -> None:
    async with stack(count=1) as st:
        body: dict[str, Any]
        if path.endswith("chat/completions"):
            body = {"model": st.model, "messages": [{"role": "user", "content": words(8, 1)}]}
        else:
            body = {"model": st.model, "prompt": words(8, 1)}
        body["max_tokens"] = 1
        raw = orjson.dumps(body)
        asgi = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(st.gw)), base_url="http://t"
        )
        async with st.http() as hot, asgi:
            for client in (hot, asgi):
                for ctype in (
                    "text/plain",
                    "text/plain; charset=utf-8",
                    "application/x-www-form-urlencoded",
                    "application/jsonx",
                ):
                    r = await client.post(path, content=raw, headers={"content-type": ctype})
                    assert r.status_code == 400, (client is hot, ctype, r.text)
                    err = r.json()["error"]
                    assert err["message"] == MESSAGE
                    assert err["type"] == "invalid_request_error"
                    assert err["code"] == "unsupported_media_type"
                    assert r.headers["x-request-id"]
            refused = st.gw.metrics.requests.labels(
                "chat" if "chat" in path else "completion", "400"
            )._value.get()
            assert refused == 8
            assert (
                st.gw.metrics.requests.labels(
                    "chat" if "chat" in path else "completion", "200"
                )._value.get()
                == 0
            )
            for served in ("application/json", "Application/JSON; charset=utf-8", None):
                headers = {"content-type": served} if served is not None else {}
                r = await hot.post(path, content=raw, headers=headers)
                assert r.status_code == 200, (served, r.text)
