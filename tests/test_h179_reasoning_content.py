"""A chat completion's assistant messages with ``reasoning_content`` (H179 review of D34):
vLLM 0.33's ``ChatCompletionRequest._normalize_messages_before`` renames the deprecated
field ``reasoning`` (unless that is set), which ``parse_chat_message_content`` hands the
template as both ``reasoning`` and ``reasoning_content``. Clients send a thinking model's
answers back so; kvgate read ``reasoning`` only, and keyed such a history without it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import HFTokenizer, chat_completion_messages
from tests.test_gateway_support import stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(60)

# ChatML with an assistant's reasoning in think tags (as Qwen3's and DeepSeek's render it)
THINKING = (
    "{%- for message in messages -%}\n"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>"
    "{% endif %}{{ message['content'] }}<|im_end|>\n"
    "{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n<|im_start|>assistant\n{% endif -%}"
)


def test_a_chat_completions_reasoning_content_is_its_reasoning() -> None:
    """vLLM's ChatCompletionRequest renames the deprecated field (the reasoning given
    wins); its other request models leave it unread."""
    said = {"role": "assistant", "content": "A."}
    msgs: list[Any] = [{"role": "user", "content": "q"}, {**said, "reasoning_content": "R"}]
    got = chat_completion_messages(msgs)
    assert got[1] == {**said, "reasoning": "R"} and msgs[1]["reasoning_content"] == "R"
    kept = [{**said, "reasoning": "S", "reasoning_content": "R"}]
    assert chat_completion_messages(kept) == [{**said, "reasoning": "S"}]
    nulled = [{**said, "reasoning": None, "reasoning_content": "R"}]
    assert chat_completion_messages(nulled) == [{**said, "reasoning": "R"}]
    plain: list[Any] = [said, {**said, "reasoning_content": None}]
    assert chat_completion_messages(plain) is plain


async def test_reasoning_content_in_a_chat_history_is_keyed_as_the_engine_renders_it(
    tmp_path: Path,
) -> None:
    """A conversation sent back with the model's reasoning_content: the replica renders
    it (vLLM's chat completion parsing), and the gateway keys the next turn's prompt as
    the replica cached it, past the reasoning (predicted = reported cached). Unread by
    the gateway, its keys part from the engine's at the reasoning."""
    model = str(template_model(tmp_path, "", THINKING))
    tok = HFTokenizer.from_dir(Path(model))
    policy = (
        f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
        "index: {pending_ttl_ms: 1}\n"
    )
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    reasoning = words(200, 11)
    first: list[dict[str, Any]] = [
        {"role": "system", "content": words(100, 12)},
        {"role": "user", "content": "Question one?"},
        {"role": "assistant", "content": "Answer one.", "reasoning_content": reasoning},
        {"role": "user", "content": "Question two?"},
    ]
    engine = [*first[:2], {**first[2], "reasoning": reasoning}, first[3]]
    got: list[tuple[int, int]] = []
    async with stack(count=1, replica=replica, policy=policy, agents=True) as st:
        assert st.gw.alignment_problems == []
        async with httpx.AsyncClient(base_url=st.url, timeout=30.0) as h:
            body = {"model": st.model, "messages": first, "max_tokens": 1}
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(tok.encode_chat(engine))
            assert "<think>" in tok.apply_chat_template(engine)
            for i in range(40):  # bounded: the agent indexes the first request's blocks
                second = [
                    *first,
                    {"role": "assistant", "content": "Answer two."},
                    {"role": "user", "content": words(8, 100 + i)},
                ]
                body = {"model": st.model, "messages": second, "max_tokens": 1}
                r = await h.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
                got.append((predicted, usage["prompt_tokens_details"]["cached_tokens"]))
                if predicted > 0:
                    break
                await asyncio.sleep(0.1)
    predicted, actual = got[-1]
    assert actual >= 304, got  # the system prompt, the first turn and its reasoning
    assert predicted == actual, got
