"""Review R2: vLLM's ``truncate_prompt_tokens`` (completions and chats) makes the engine
run only the prompt's last k tokens (``truncation_side: right``: its first k; ``-1``: the
model's context less the output tokens asked for). The gateway keyed, predicted and
charged the whole prompt: the engine (rightly) reported a miss for a prefix the index
holds, and the claim check quarantined an honest replica.

The simulated replica truncates as vLLM does; the agents, index, gateway and claim check
are the real ones."""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFLib

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import HFTokenizer
from gateway.errors import GatewayError
from gateway.tokenization import LocalPromptTokenizer
from tests.test_gateway_faults import checked
from tests.test_gateway_support import stack, words
from tests.test_special_tokens import BOS, bos_model

pytestmark = pytest.mark.timeout(120)

QUARANTINE = "quarantine: {settle_s: 0.3}"  # defaults otherwise: k=3 of m=5
VLLM_FIELDS = ("truncate_prompt_tokens", "truncation_side")


async def create(c: Any, body: dict[str, Any]) -> Any:
    """The SDK's completion with vLLM's own fields in ``extra_body``."""
    plain = {k: v for k, v in body.items() if k not in VLLM_FIELDS}
    extra = {k: v for k, v in body.items() if k in VLLM_FIELDS}
    return await c.completions.create(**plain, extra_body=extra)


async def test_truncated_prompts_are_keyed_as_the_engine_runs_them() -> None:
    """A client capping a growing prompt (each request keeps another tail), token ids and
    text: the gateway's prompt size is the engine's, no claim check is false, the replica
    stays in service, and a repeat of a truncated prompt is predicted as the engine hits."""
    rng = random.Random(3)
    base = [rng.randrange(1000, 5000) for _ in range(320)]
    text = words(320, 11)
    async with stack(count=1, agents=True, policy=QUARANTINE) as st:
        gw, c, rep = st.gw, st.client(), st.replica_id(0)
        await c.completions.create(model=st.model, prompt=base, max_tokens=1)  # indexed
        await c.completions.create(model=st.model, prompt=text, max_tokens=1)
        await asyncio.sleep(0.5)
        sizes: list[tuple[int, int, bool]] = []  # (k, the gateway's size, unkeyed)
        for i in range(4):
            k = 300 - 7 * i
            for prompt in ([*base, 7 + i], f"{text} w{i}"):
                body = {"model": st.model, "prompt": prompt, "max_tokens": 1}
                body["truncate_prompt_tokens"] = k
                d = await gw.prepare(
                    "completion", "anonymous", dict(body), {}, "x", explain_only=True
                )
                sizes.append((k, d.prompt_tokens, d.unkeyed))
                r = await create(c, body)
                assert r.usage is not None and r.usage.prompt_tokens == k  # the engine's
        got = await checked(gw, rep, len(sizes), timeout_s=10.0)
        assert got["false"] == 0, got
        assert not gw.quarantine.is_quarantined(rep)
        assert all(size == k and not unkeyed for k, size, unkeyed in sizes), sizes
        # the same truncated tail again: predicted from the index, and the engine hits
        await asyncio.sleep(0.5)
        k = 256
        body = {"model": st.model, "prompt": [*base, 99], "max_tokens": 1}
        body["truncate_prompt_tokens"] = k
        await create(c, body)
        await asyncio.sleep(0.5)
        d = await gw.prepare("completion", "anonymous", dict(body), {}, "x", explain_only=True)
        r = await create(c, body)
        assert d.decision.predicted_cached_tokens >= 240
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == d.decision.predicted_cached_tokens


async def test_chat_truncation_and_the_right_side() -> None:
    """A chat's rendered prompt is truncated too, and ``truncation_side: right`` keeps the
    first k tokens: the gateway's size is the engine's for both."""
    async with stack(count=1) as st:
        gw, h = st.gw, st.http()
        msgs = [{"role": "user", "content": words(200, 5)}]
        async with h:
            for extra in ({}, {"truncation_side": "right"}):
                chat = {"model": st.model, "messages": msgs, "max_tokens": 1}
                chat |= {"truncate_prompt_tokens": 64, **extra}
                comp = {"model": st.model, "prompt": list(range(100, 300)), "max_tokens": 1}
                comp |= {"truncate_prompt_tokens": 64, **extra}
                for endpoint, path, body in (
                    ("chat", "/v1/chat/completions", chat),
                    ("completion", "/v1/completions", comp),
                ):
                    d = await gw.prepare(
                        endpoint, "anonymous", dict(body), {}, "x", explain_only=True
                    )
                    r = await h.post(path, json=body)
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["prompt_tokens"] == d.prompt_tokens == 64
            # right keeps the first 64 ids: the keys are the full prompt's first blocks (3:
            # the block of the last prompt token is never a hit)
            whole = dict(comp, truncate_prompt_tokens=None)
            full = await gw.prepare("completion", "anonymous", whole, {}, "x", explain_only=True)
            right = await gw.prepare(
                "completion", "anonymous", dict(comp), {}, "x", explain_only=True
            )
            assert right.keys[0] == full.keys[0][:3]


async def test_minus_one_keeps_the_context_less_the_output_or_routes_by_load() -> None:
    """``-1``: the replicas' cards give max_model_len (512 here), so the engine keeps the
    last 512 - max_tokens tokens, and the gateway keys those; with no card that says it,
    the request is routed by load and judged by nothing."""
    small = ReplicaSettings(time_scale=0.05, max_model_len=512)
    rng = random.Random(5)
    prompt = [rng.randrange(1000, 5000) for _ in range(600)]
    async with stack(count=1, replica=small, agents=True, policy=QUARANTINE) as st:
        gw, c, rep = st.gw, st.client(), st.replica_id(0)
        for i in range(4):
            body: dict[str, Any] = {"model": st.model, "prompt": [*prompt, i], "max_tokens": 2}
            body["truncate_prompt_tokens"] = -1
            d = await gw.prepare("completion", "anonymous", dict(body), {}, "x", explain_only=True)
            assert d.prompt_tokens == 510 and not d.unkeyed
            r = await create(c, body)
            assert r.usage is not None and r.usage.prompt_tokens == 510
            await asyncio.sleep(0.3)
        got = await checked(gw, rep, 4, timeout_s=10.0)
        assert got["false"] == 0, got
        # a completion's max_tokens is 16 when absent (vLLM's default)
        body = {"model": st.model, "prompt": prompt, "truncate_prompt_tokens": -1}
        d = await gw.prepare("completion", "anonymous", dict(body), {}, "x", explain_only=True)
        assert d.prompt_tokens == 512 - 16
        assert gw.pool is not None
        for r_ in gw.pool.all():
            r_.cards = {}  # no card says the context
        d = await gw.prepare("completion", "anonymous", dict(body), {}, "x", explain_only=True)
        assert d.unkeyed and d.prompt_tokens == 600 and not d.keys


async def test_values_vllm_refuses_are_a_400_naming_the_field() -> None:
    """Refused by the gateway before any routing (as vLLM's request model refuses them),
    in the 400 shape of its other fields' refusals."""
    async with stack(count=1) as st, st.http() as h:
        base = {"model": st.model, "prompt": "hello there", "max_tokens": 1}
        bad: list[tuple[str, Any]] = [("truncate_prompt_tokens", v) for v in ("abc", -2, 0)]
        for field, value in [*bad, ("truncation_side", "middle")]:
            with pytest.raises(GatewayError) as err:
                body = {**base, field: value}
                await st.gw.prepare("completion", "anonymous", body, {}, "x", explain_only=True)
            assert err.value.status == 400 and err.value.param == field
        for value in ("abc", -2, 0, 1.5, [3], 2**63):
            r = await h.post("/v1/completions", json={**base, "truncate_prompt_tokens": value})
            assert r.status_code == 400, (value, r.text)
            assert r.json()["error"]["param"] == "truncate_prompt_tokens"
        r = await h.post("/v1/completions", json={**base, "truncation_side": "middle"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"
        chat = {"model": st.model, "messages": [{"role": "user", "content": "hi"}]}
        r = await h.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": -7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
        # pydantic's lax int, as vLLM reads it: "2" and 2.0 are 2
        for value in ("2", 2.0):
            r = await h.post("/v1/completions", json={**base, "truncate_prompt_tokens": value})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2, r.text


def test_a_bos_is_kept_as_the_engines_tokenizer_keeps_it() -> None:
    """A text prompt with special tokens: HF's truncation (what vLLM calls) keeps the BOS
    and shortens the text; token ids are sliced as given."""
    from cachecore.tokenizer import Truncation  # here: the e2e tests run on older code

    with tempfile.TemporaryDirectory() as tmp:
        directory = bos_model(Path(tmp))
        hf = HFTokenizer.from_dir(directory)
        lib = HFLib.from_file(str(directory / "tokenizer.json"))
    local = LocalPromptTokenizer(hf)
    text = words(40, 2)
    for left, direction in ((True, "left"), (False, "right")):
        lib.enable_truncation(max_length=9, direction=direction)
        engine = lib.encode(text, add_special_tokens=True).ids
        body = {"prompt": text}
        assert local.completion_sync(body, trunc=Truncation(9, left)) == engine
        assert engine[0] == BOS and len(engine) == 9
        ids = list(range(50, 90))
        assert local.completion_sync({"prompt": ids}, trunc=Truncation(9, left)) == (
            ids[-9:] if left else ids[:9]
        )


def test_request_truncation_reads_the_fields_as_vllm() -> None:
    from cachecore.tokenizer import Truncation
    from gateway.tokenization import request_truncation

    def ctx() -> int:
        return 100

    def unknown() -> None:
        return None

    assert request_truncation({}, False, ctx) == (None, True)
    assert request_truncation({"truncate_prompt_tokens": 5}, False, ctx) == (Truncation(5), True)
    right = {"truncate_prompt_tokens": 5, "truncation_side": "right"}
    assert request_truncation(right, True, ctx) == (Truncation(5, False), True)
    minus = {"truncate_prompt_tokens": -1}
    assert request_truncation(minus, False, ctx) == (Truncation(84), True)  # 16 reserved
    assert request_truncation(minus, True, ctx) == (Truncation(100), True)  # chat: none
    chat = {**minus, "max_tokens": 10, "max_completion_tokens": 20}
    assert request_truncation(chat, True, ctx) == (Truncation(80), True)
    assert request_truncation(minus, False, unknown) == (None, False)
    assert request_truncation({**minus, "max_tokens": 100}, False, ctx) == (None, False)
    with pytest.raises(GatewayError) as err:
        request_truncation({"truncate_prompt_tokens": True, "truncation_side": 1}, False, ctx)
    assert err.value.status == 400 and err.value.param == "truncation_side"
