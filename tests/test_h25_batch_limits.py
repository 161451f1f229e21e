"""Review 4, V1 and V4: the work a /v1/completions prompt batch costs before the budget can
refuse it. V1: every text of a batch was BPE'd on the event loop, one at a time, each
under ``KVGATE_TOKENIZE_OFFLOAD_CHARS`` alone (100,000 short prompts, 1.1 MB: a 426 ms
stall of every request on the loop). Now a batch whose texts together pass the bound is
tokenized in one worker thread, as one long text is. V4: under engine tokenizers each text
was one /tokenize call (8 at a time: 2,000 prompts, 1.7 s), and nothing but the body size
bounded the number of prompts. Now engine-tokenized batch texts are sized locally (the
built-in tokenizer) and a batch holds at most ``KVGATE_MAX_PROMPT_BATCH`` prompts (a 400
beyond)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from cachecore.tokenizer import Truncation, builtin_tokenizer
from gateway.errors import GatewayError
from gateway.settings import GatewaySettings
from gateway.tokenization import EnginePromptTokenizer, LocalPromptTokenizer
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(120)


class ThreadRecordingTokenizer:
    """The built-in tokenizer, recording the thread of every ``encode``. No ``_tok``
    attribute: the segment cache is off, so each text's BPE is one ``encode`` call here."""

    def __init__(self) -> None:
        self.inner = builtin_tokenizer()
        self.name = self.inner.name
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return self.inner.encode(text)

    def __getattr__(self, name: str) -> Any:  # the rest of the Tokenizer protocol
        if name.startswith("_"):  # no ``_tok``: the segment cache stays off
            raise AttributeError(name)
        return getattr(self.inner, name)


async def test_a_batch_past_the_offload_bound_is_tokenized_off_the_event_loop() -> None:
    rec = ThreadRecordingTokenizer()
    tok = LocalPromptTokenizer(rec)
    loop_thread = threading.get_ident()
    batch = [words(8, 7000 + i) for i in range(400)]  # each ~50 chars, ~20k together
    assert max(map(len, batch)) < 1000 < sum(map(len, batch))
    body: dict[str, Any] = {"model": "m", "prompt": batch}
    expected = [len(rec.inner.encode(p)) for p in batch]
    rec.threads.clear()
    lengths = await tok.prompt_lengths(body, "scope", offload_chars=1000)
    assert lengths == expected
    assert rec.threads and loop_thread not in rec.threads  # each text alone is under it
    # under the bound together: on the loop, as before (no thread for a small batch)
    rec.threads.clear()
    small = {"model": "m", "prompt": batch[:10]}
    assert await tok.prompt_lengths(small, "scope", offload_chars=1000) == expected[:10]
    assert set(rec.threads) == {loop_thread}
    # truncated: each text's count cut as the engine cuts it, offloaded or not
    cut = [min(n, 5) for n in expected]
    assert await tok.prompt_lengths(body, "s", 1000, Truncation(5)) == cut
    assert await tok.prompt_lengths(body, "s", 10**9, Truncation(5)) == cut
    ids = {"model": "m", "prompt": [[1, 2, 3]] * 3}
    assert await tok.prompt_lengths(ids, "s", 0) == [3, 3, 3]


async def test_the_loop_keeps_running_while_a_large_batch_is_tokenized() -> None:
    """The reviewer's measure, loosely bounded: a ticker on the loop while a ~0.5 MB batch
    of short prompts is sized (all on the loop: one gap as long as the whole BPE)."""
    tok = LocalPromptTokenizer(builtin_tokenizer())
    batch = [words(60, 9000 + i) for i in range(2000)]
    body: dict[str, Any] = {"model": "m", "prompt": batch}
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        for _ in range(1_000_000):  # bounded; ends when the sizing does
            if done.is_set():
                return
            await asyncio.sleep(0)
            now = loop.time()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = asyncio.get_running_loop().time()
    lengths = await tok.prompt_lengths(body, "scope")
    wall = asyncio.get_running_loop().time() - start
    done.set()
    await t
    assert len(lengths) == 2000
    # on the loop the longest gap is the whole wall time; off it, a small part of it
    assert max(gaps) < 0.5 * wall, (max(gaps), wall)


async def test_an_engine_tokenized_batch_is_sized_without_asking_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []
    post = EnginePromptTokenizer._post

    async def recording(self: EnginePromptTokenizer, path: str, payload: Any) -> list[int]:
        asked.append(path)
        return await post(self, path, payload)

    monkeypatch.setattr(EnginePromptTokenizer, "_post", recording)
    policy = "models: {default: {tokenizer: engine_tokenize}}"
    async with stack(count=1, policy=policy) as st:
        tok = builtin_tokenizer()
        batch = [words(20 + i, 400 + i) for i in range(200)]
        body: dict[str, Any] = {"model": st.model, "prompt": batch, "max_tokens": 1}
        asked.clear()  # start-up's own calls
        d = await st.gw.prepare("completion", "anonymous", body, {}, "x", explain_only=True)
        # the built-in count (the simulated engine's tokenizer, so here also its count)
        assert d.prompt_tokens == sum(len(tok.encode(p)) for p in batch) and d.unkeyed
        assert asked == []  # was one /tokenize per text: 200 calls
        # a single prompt still asks the engine
        one = {"model": st.model, "prompt": batch[0], "max_tokens": 1}
        await st.gw.prepare("completion", "anonymous", one, {}, "y", explain_only=True)
        assert asked == ["/tokenize"]


def test_an_engine_tokenizer_made_without_a_sizer_sizes_with_the_builtin() -> None:
    eng = EnginePromptTokenizer("tokenize", None, lambda tried: None)  # type: ignore[arg-type]
    body = {"model": "m", "prompt": ["hello there", "general kenobi"]}
    got = asyncio.run(eng.prompt_lengths(body, "salt"))
    tok = builtin_tokenizer()
    assert got == [len(tok.encode("hello there")), len(tok.encode("general kenobi"))]
    assert asyncio.run(eng.prompt_lengths({"prompt": [[5, 6], [7]]}, "salt")) == [2, 1]


def _status(exc: GatewayError) -> tuple[int, str | None]:
    return exc.status, exc.param


@pytest.mark.parametrize("tokenizer", ["builtin", "engine_tokenize"])
async def test_a_batch_longer_than_max_prompt_batch_is_a_400(tokenizer: str) -> None:
    policy = f"models: {{default: {{tokenizer: {tokenizer}}}}}"
    async with stack(count=1, policy=policy, max_prompt_batch=4) as st, st.http() as h:
        for prompt in (["a b c"] * 5, [[1, 2, 3]] * 5):
            body: dict[str, Any] = {"model": st.model, "prompt": prompt, "max_tokens": 1}
            with pytest.raises(GatewayError) as err:
                await st.gw.prepare("completion", "anonymous", body, {}, "x", explain_only=True)
            assert _status(err.value) == (400, "prompt")
            assert "5 prompts" in str(err.value) and "(4)" in str(err.value)
            ok = {**body, "prompt": prompt[:4]}
            d = await st.gw.prepare("completion", "anonymous", ok, {}, "x", explain_only=True)
            assert d.prompt_tokens == 12
        r = await h.post("/v1/completions", json={"model": st.model, "prompt": ["x"] * 5})
        assert r.status_code == 400, r.text
        err_body = r.json()["error"]
        assert err_body["param"] == "prompt" and err_body["type"] == "invalid_request_error"
        # a string prompt is one prompt, whatever its length
        r = await h.post(
            "/v1/completions", json={"model": st.model, "prompt": "x " * 50, "max_tokens": 1}
        )
        assert r.status_code == 200, r.text


def test_max_prompt_batch_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert GatewaySettings(open_access=True).max_prompt_batch == 2048
    monkeypatch.setenv("KVGATE_MAX_PROMPT_BATCH", "16")
    assert GatewaySettings(open_access=True).max_prompt_batch == 16
    monkeypatch.setenv("KVGATE_MAX_PROMPT_BATCH", "0")
    with pytest.raises(ValueError):
        GatewaySettings(open_access=True)
