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
