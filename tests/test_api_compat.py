"""The HTTP surface as OpenAI clients and vLLM see it: field parsing the engine's way, error
shapes, headers on every answer, model cards, and a loop that a long prompt cannot stall."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cachecore.tokenizer import TokenizerError, builtin_tokenizer, message_text
from gateway.errors import GatewayError
from gateway.tokenization import LocalPromptTokenizer, add_generation_prompt
from tests.test_gateway_support import stack, words

VALID_ID = "client-id-0123"


def test_text_parts_render_as_vllm_renders_them() -> None:
    """vLLM (string-content templates): every text-like part's text, empty ones dropped,
    joined by newlines; a media part is refused, not dropped."""
    parts = [
        {"type": "text", "text": "first"},
        "bare",
        {"type": "input_text", "text": "second"},
        {"type": "text", "text": ""},
        {"type": "refusal", "refusal": "no"},
        {"type": "output_text", "text": None},
        {"type": "thinking", "thinking": "hmm"},
    ]
    assert message_text(parts) == "first\nbare\nsecond\nno\nhmm"
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    with pytest.raises(TokenizerError, match="image_url"):
        message_text([{"type": "image_url", "image_url": {"url": "http://x"}}])
    with pytest.raises(TokenizerError, match="must be a string"):
        message_text([{"type": "text", "text": 5}])


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (0, False), (1, True), ("false", False), ("No", False),
     ("off", False), ("0", False), ("true", True), ("YES", True), ("t", True)],
)  # fmt: skip
def test_add_generation_prompt_reads_as_pydantic_reads_it(value: object, expected: bool) -> None:
    assert add_generation_prompt({"add_generation_prompt": value}) is expected


@pytest.mark.parametrize("value", ["maybe", 2, None, [], 0.5])
def test_add_generation_prompt_rejects_what_the_engine_rejects(value: object) -> None:
    with pytest.raises(GatewayError) as err:
        add_generation_prompt({"add_generation_prompt": value})
    assert err.value.status == 400 and err.value.param == "add_generation_prompt"


async def test_async_tokenization_equals_the_sync_path_and_keeps_the_cache() -> None:
    """Offloaded or not, the ids are the tokenizer's; cached pieces are reused, and only
    the uncached text counts toward the offload bound."""
    tok = builtin_tokenizer()
    lp = LocalPromptTokenizer(tok)
    system = words(3000, 1)
    for i in range(3):
        body = {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": words(50 + i, 2 + i)}]}  # fmt: skip
        want = tok.encode_chat(body["messages"])
        assert await lp.chat(body, "tenant:a", offload_chars=1000) == want
        assert lp.chat_sync(body, "tenant:a") == want
    assert lp.segments.hits >= 2  # the system prompt came from the cache
    assert await lp.completion({"prompt": system}, None, offload_chars=10) == tok.encode(system)


async def test_a_long_prompt_does_not_stall_the_event_loop() -> None:
    """Tokenizing a ~3 MB prompt takes the better part of a second. Offloaded, the loop
    keeps ticking through it; inline (offload disabled), it does not tick at all."""
    prompt = words(400_000, 1)

    async def ticks_during_explain(offload_chars: int) -> int:
        async with stack(count=1, tokenize_offload_chars=offload_chars) as st, st.http() as h:
            body = {"model": st.model, "messages": [{"role": "user", "content": prompt}]}
            ticks = 0
            done = asyncio.Event()

            async def ticker() -> None:
                nonlocal ticks
                while not done.is_set():
                    await asyncio.sleep(0.01)
                    ticks += 1

            task = asyncio.create_task(ticker())
            r = await h.post("/admin/route/explain", json=body, headers=st.admin_headers())
            done.set()
            await task
            assert r.status_code == 200 and r.json()["prompt_tokens"] > 400_000
            return ticks

    assert await ticks_during_explain(16_384) >= 10
    assert await ticks_during_explain(1 << 30) <= 3  # the control: inline blocks the loop


async def test_openai_shapes_headers_and_model_cards() -> None:
    async with stack(count=1) as st, st.http() as h:
        auth = {"authorization": "Bearer x"}
        # a wrong method: a client error, with Allow; every answer carries a valid request id
        r = await h.get("/v1/chat/completions", headers={"x-request-id": "bad id"})
        assert r.status_code == 405
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "POST" in r.headers["allow"]
        assert r.headers["x-request-id"] != "bad id" and len(r.headers["x-request-id"]) == 32
        r = await h.get("/v1/nope", headers={"x-request-id": VALID_ID})
        assert r.status_code == 404 and r.headers["x-request-id"] == VALID_ID
        assert r.json()["error"] == {
            "message": "Invalid URL (GET /v1/nope)",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        for path in ("/health", "/v1/models", "/metrics"):
            r = await h.get(path, headers={"x-request-id": VALID_ID, **auth})
            assert r.status_code == 200 and r.headers["x-request-id"] == VALID_ID, path
            head = await h.head(path, headers=auth)
            assert head.status_code == 200 and head.content == b"", path
        # model cards: the engine's fields pass through, OpenAI's required ones are there
        cards = (await h.get("/v1/models", headers=auth)).json()["data"]
        card = next(c for c in cards if c["id"] == st.model)
        assert card["object"] == "model" and isinstance(card["created"], int)
        assert isinstance(card["max_model_len"], int) and card["owned_by"]
        one = await h.get(f"/v1/models/{st.model}", headers=auth)
        assert one.status_code == 200 and one.json() == card
        missing = await h.get("/v1/models/no-such-model", headers=auth)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        c = st.client()
        got = await c.models.retrieve(st.model)
        assert got.id == st.model and got.created == card["created"]
        # "stream": null is "not streamed" (a nullable boolean in OpenAI's schema and vLLM's)
        body = {"model": st.model, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "stream": None}  # fmt: skip
        r = await h.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        # any other value as vLLM's pydantic model reads it: a lax bool, else a 400
        for value, streamed in (("false", False), ("no", False), (0, False), ("true", True),
                                (1, True)):  # fmt: skip
            r = await h.post("/v1/chat/completions", json={**body, "stream": value},
                             headers=auth)  # fmt: skip
            assert r.status_code == 200, (value, r.text)
            assert r.headers["content-type"].startswith("text/event-stream") is streamed, value
        r = await h.post("/v1/chat/completions", json={**body, "stream": "maybe"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        # add_generation_prompt as a string: the gateway's tokens equal the engine's
        for value in ("false", "no", "true"):
            body = {"model": st.model, "messages": [{"role": "user", "content": words(20, 7)}],
                    "max_tokens": 1, "add_generation_prompt": value}  # fmt: skip
            ex = await h.post("/admin/route/explain", json=body, headers=st.admin_headers())
            r = await h.post("/v1/chat/completions", json=body, headers=auth)
            assert r.json()["usage"]["prompt_tokens"] == ex.json()["prompt_tokens"], value
        # a refusal part in an assistant turn is text, as in vLLM
        msgs: Any = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": [{"type": "text", "text": "b"},
                                             {"type": "text", "text": "c"}]}]  # fmt: skip
        raw = await c.chat.completions.with_raw_response.create(
            model=st.model,
            messages=msgs,
            max_tokens=1,
        )
        assert raw.headers["x-kvgate-replica"]
        # media parts: the gateway cannot key them as vLLM does (item hashes), so it sizes
        # the request by its text and an estimate per part, routes it by load and passes
        # it on untouched
        text = {"type": "text", "text": words(40, 3)}
        image = {"type": "image_url", "image_url": {"url": "http://x"}}
        with_image = {"model": st.model, "messages": [{"role": "user", "content": [text, image]}]}
        text_only = {"model": st.model, "messages": [{"role": "user", "content": [text]}]}
        adm = st.admin_headers()
        ex = (await h.post("/admin/route/explain", json=with_image, headers=adm)).json()
        plain = (await h.post("/admin/route/explain", json=text_only, headers=adm)).json()
        assert ex["decision"]["reason"] == "unkeyed_load"
        # the text's tokens plus the pool's estimate per media part (media_part_tokens)
        assert ex["prompt_tokens"] == plain["prompt_tokens"] + 1024
        assert all(s["matched_blocks"] == 0 for s in ex["decision"]["scores"])
        # the simulated engine is text-only and says so, in its own words (passed through)
        r = await h.post("/v1/chat/completions", json={**with_image, "max_tokens": 1}, headers=auth)
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
        assert r.headers["x-kvgate-replica"]  # routed and sent, not refused by the gateway
        # no keys, so no prediction to report (a text chat has one)
        assert "x-kvgate-predicted-cached-tokens" not in r.headers
        assert "x-kvgate-predicted-cached-tokens" in raw.headers


async def test_only_uncached_text_past_the_bound_goes_to_a_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short prompts stay inline; a long one goes to a thread until its text is cached
    (second sighting), after which the cache answers inline."""
    calls = 0
    real = asyncio.to_thread

    async def counting(fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr("cachecore.tokenizer.asyncio.to_thread", counting)
    tok = builtin_tokenizer()
    lp = LocalPromptTokenizer(tok)
    for i in range(5):
        await lp.completion({"prompt": words(100, i)}, "tenant:a", offload_chars=2000)
    assert calls == 0
    system = words(3000, 9)
    for i in range(4):
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": words(10, 20 + i)}]  # fmt: skip
        assert await lp.chat({"messages": msgs}, "tenant:a", 2000) == tok.encode_chat(msgs)
    assert calls == 2  # first and second sight; cached from then on
