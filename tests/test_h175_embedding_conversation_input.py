"""A chat conversation in an embeddings request's ``input`` (H175). vLLM 0.33's
``EmbeddingRequest`` union (``vllm/entrypoints/pooling/embed/protocol.py``) has a member,
``EmbeddingChatInputRequest``, whose before-validator copies an ``input`` that is a
conversation (a non-empty list of objects with a string ``role``) into ``messages``; the
completion form refuses such an input, so the chat form runs, rendered as ``messages``
are (``EmbedIOProcessor._get_request_factory_chat_input_online``: the chat template, its
``add_generation_prompt`` false and ``add_special_tokens`` false by default). The gateway
answered it with a 400 naming ``input`` and the simulated replica too; both now read it
as the chat form. /pooling and /classify have no such member: still a 400."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(90)

_CONVERSATION = [
    {"role": "system", "content": words(30, 1)},
    {"role": "user", "content": words(12, 2)},
]


def _stable(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("id", "created")}


async def _direct(st: Stack, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url, timeout=30) as h:
        return await h.post(path, json=body)


async def test_a_conversation_in_input_is_embedded_and_charged_as_the_chat_form() -> None:
    """Served as vLLM serves it (the same answer as ``messages``, through the gateway and
    at the replica), and charged what the replica computes (its usage)."""
    async with stack(count=1) as st, st.http() as h:
        as_messages = await _direct(st, "/v1/embeddings", {"messages": _CONVERSATION})
        assert as_messages.status_code == 200, as_messages.text
        want = _stable(as_messages.json())
        for extra in ({}, {"add_generation_prompt": True}, {"continue_final_message": True}):
            body = {"model": st.model, "input": _CONVERSATION, **extra}
            direct = await _direct(st, "/v1/embeddings", body)
            assert direct.status_code == 200, direct.text
            r = await h.post("/v1/embeddings", json=body)
            assert r.status_code == 200, r.text
            got = r.json()
            assert _stable(got) == _stable(direct.json())
            if not extra:
                assert {**_stable(got), "model": None} == {**want, "model": None}
            d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == got["usage"]["prompt_tokens"] > 42, extra
        # with messages beside it, the messages run (vLLM's member normalizes no input then)
        other = [{"role": "user", "content": words(200, 3)}]
        body = {"model": st.model, "input": _CONVERSATION, "messages": other}
        r = await h.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        alone = await _direct(st, "/v1/embeddings", {"messages": other})
        assert r.json()["data"] == alone.json()["data"]
        d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == r.json()["usage"]["prompt_tokens"] > 200


async def test_pooling_and_classify_still_refuse_a_conversation_in_input() -> None:
    """vLLM's /pooling and /classify unions have no conversation-in-input member: a 400
    naming ``input`` at the gateway (before routing) and at the replica."""
    async with stack(count=1) as st, st.http() as h:
        for path in ("/pooling", "/classify"):
            body = {"model": st.model, "input": _CONVERSATION}
            r = await h.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
            direct = await _direct(st, path, body)
            assert direct.status_code == 400, direct.text
            assert direct.json()["error"]["param"].startswith("input"), direct.text


async def test_a_conversation_in_inputs_media_uuids_go_scoped() -> None:
    """Its content parts' ``uuid`` name items in vLLM's unsalted multimodal caches, as
    the chat form's: scoped per scope, as ``messages``' are."""
    uid = "their-image-0001"
    conv = [
        {"role": "user", "content": [
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": None, "uuid": uid},
        ]},
    ]  # fmt: skip
    async with stack(count=1) as st:
        body = {"model": st.model, "input": conv}
        d = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
        d.raw_body = orjson.dumps(body)
        sent = orjson.loads(st.gw.upstream_body(d))
        got = sent["input"][0]["content"][1]["uuid"]
        assert got != uid and got.startswith("kvg1:"), got
        assert "messages" not in sent  # the client's body, its input scoped
