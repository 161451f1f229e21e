"""Review H160 of 96849fa (a Responses request's and a chat completion's reasoning effort
as template variables): real simulated replicas and a real gateway on free loopback
ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_gateway_support import FAST, stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(90)

# a template that renders the effort's variables first, as the 96849fa tests' does
_HEAD = (
    "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}"
    "{% if enable_thinking is defined %}<think {{ enable_thinking }}>{% endif %}\n"
)


async def test_a_pooling_chat_form_is_sized_without_a_reasoning_effort(tmp_path: Path) -> None:
    """vLLM 0.33's pooling requests have no ``reasoning_effort`` (an extra field, ignored:
    their ``build_chat_params`` passes only the request's template kwargs and generation
    prompt flags), and the simulated replica renders their chat form so. 96849fa made the
    gateway's shared chat reader merge the effort into every chat it renders: a pooling
    chat form with one was charged the effort's template text too (62 for the 51 tokens
    the engine runs), and an effort vLLM ignores (``"extreme"``) a 400 the engine never
    gives."""
    model = template_model(tmp_path, _HEAD)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    msgs = [{"role": "system", "content": words(40, 1)}, {"role": "user", "content": "hi"}]
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for path, ep in (
            ("/v1/embeddings", "embeddings"),
            ("/pooling", "pooling"),
            ("/classify", "classify"),
        ):
            plain = await h.post(path, json={"messages": msgs})
            assert plain.status_code == 200, (path, plain.text)
            runs = plain.json()["usage"]["prompt_tokens"]
            for effort in ("high", "none", "extreme"):
                body: dict[str, Any] = {"messages": msgs, "reasoning_effort": effort}
                r = await h.post(path, json=body)
                assert r.status_code == 200, (path, effort, r.text)
                assert r.json()["usage"]["prompt_tokens"] == runs, (path, effort)
                d = await st.gw.prepare(ep, "anonymous", body, {}, "x", True)
                assert d.prompt_tokens == runs, (path, effort, d.prompt_tokens)


async def test_chat_completions_with_an_effort_or_a_continued_message_are_keyed_as_rendered(
    tmp_path: Path,
) -> None:
    """96849fa's effort merge and its new continue cut reach chat completions too: each
    shape below, sent twice, is predicted exactly the replica's cached tokens on the
    repeat (the gateway keys the prompt the engine renders), and an override of
    ``enable_thinking`` or of a kwarg's ``reasoning_effort`` is another prompt from its
    first token (nothing cached, nothing predicted)."""
    model = template_model(tmp_path, _HEAD)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    system, question = words(64, 41), words(40, 42)
    base = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    shapes: dict[str, dict[str, Any]] = {
        "effort": {"reasoning_effort": "low"},
        "effort, thinking off": {
            "reasoning_effort": "low",
            "chat_template_kwargs": {"enable_thinking": False},
        },
        "kwarg effort, field wins": {
            "reasoning_effort": "medium",
            "chat_template_kwargs": {"reasoning_effort": "max"},
        },
        "kwarg effort alone": {"chat_template_kwargs": {"reasoning_effort": "max"}},
        "continued, spaced": {
            **cont,
            "messages": [*base, {"role": "assistant", "content": "  " + words(20, 43) + "  "}],
        },
        "continued, empty": {**cont, "messages": [*base, {"role": "assistant", "content": ""}]},
    }
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        # each of these renders a head line none before it did
        firsts = {name for name in shapes if "effort" in name}
        for name, extra in shapes.items():
            body = {"model": st.model, "max_tokens": 2, "messages": base, **extra}
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, (name, r.text)
            first = r.headers["x-kvgate-replica"]
            # a new head (another effort line) is a new prompt from its first token
            predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == cached, (name, predicted, cached)
            if name in firsts:
                assert cached == 0, name
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first, name
            usage = r.json()["usage"]
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert predicted > 0 and predicted == cached, (name, predicted, cached)
