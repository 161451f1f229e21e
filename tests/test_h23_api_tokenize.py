"""Engine-tokenized pools as a client sees them: the engine's refusal of a prompt reaches
the client in the engine's words, and an engine that answers its tokenize call with no
JSON is an upstream failure, not an internal error."""

from __future__ import annotations

import asyncio

import pytest

from tests.test_gateway_support import stack
from tests.test_upstream_faults import FakeReplica, gateway

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", ["engine_tokenize", "engine_render"])
async def test_the_engines_refusal_to_tokenize_keeps_its_words_and_param(kind: str) -> None:
    """The engine's 400 from /tokenize (or render) reached the client as "the engine
    rejected the prompt: {\\"error\\":{...}}": its error object quoted as a string inside
    the message (cut at 500 characters), its param lost. It is now the engine's message,
    param and type, as the same refusal from the completion endpoint is relayed."""
    policy = f"models: {{default: {{tokenizer: {kind}}}}}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        body = {"model": st.model, "messages": [{"role": "user", "content": 5}]}
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == "message content must be a string or a list of parts"
        assert err["param"] == "messages"
        assert err["type"] == "BadRequestError"


async def test_a_tokenize_answer_that_is_no_json_is_a_502() -> None:
    """A 200 from the engine's render endpoint that is no JSON (a web server that is not
    the engine) raised JSONDecodeError: out of the start-up probe of the engine's
    tokenizer it stopped the gateway from starting at all, and on a request it was a 500
    "internal gateway error" with a logged traceback. It is an engine that does not
    tokenize: reported at start-up, and a 502 in OpenAI's shape for the request."""

    async def page(w: asyncio.StreamWriter) -> None:
        body = b"<html>It works!</html>"
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))

    policy = "models: {default: {tokenizer: engine_render}}"
    async with gateway([FakeReplica(page)], policy) as (gw, h):
        assert any("no token ids" in p for p in gw.alignment_problems)
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 502, r.text
        assert "no token ids" in r.json()["error"]["message"]
