"""``add_special_tokens``: vLLM tokenizes a completion's text prompt with the tokenizer's
special tokens by default (a Llama-family BOS) and a chat's rendered prompt without them
(its template writes the BOS). The gateway's local tokenizers did neither, so behind a
model whose tokenizer adds a BOS every completion's block keys were the engine's shifted by
one token: no key the agents indexed from the engine's blocks ever matched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import HFTokenizer, builtin_tokenizer, export_builtin
from gateway.errors import GatewayError
from gateway.tokenization import LocalPromptTokenizer
from tests.test_gateway_support import stack, words

BOS = 0  # the built-in vocabulary's <|endoftext|>, made a BOS below


def bos_model(directory: Path) -> Path:
    """The built-in tokenizer as an HF model directory whose post-processor puts a BOS
    before every sequence (as Llama 3's ``TemplateProcessing`` does)."""
    export_builtin(directory)
    tj = directory / "tokenizer.json"
    data = json.loads(tj.read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [BOS], "tokens": ["<|endoftext|>"]}
        },
    }
    tj.write_text(json.dumps(data))
    return directory


def test_special_affixes_are_what_the_post_processor_adds(tmp_path: Path) -> None:
    assert builtin_tokenizer().special_affixes == ((), ())
    assert HFTokenizer.from_dir(bos_model(tmp_path)).special_affixes == ((BOS,), ())


def test_local_tokens_are_the_engines_for_either_api(tmp_path: Path) -> None:
    hf = HFTokenizer.from_dir(bos_model(tmp_path))
    local = LocalPromptTokenizer(hf)
    text = words(40, 1)
    plain = hf.encode(text)
    assert local.completion_sync({"prompt": text}) == [BOS, *plain]  # vLLM's default
    for off in (False, "false", 0):
        assert local.completion_sync({"prompt": text, "add_special_tokens": off}) == plain
    assert local.completion_sync({"prompt": [5, 6, 7]}) == [5, 6, 7]  # ids as given
    msgs = [{"role": "user", "content": text}]
    rendered = hf.encode(hf.apply_chat_template(msgs, True))
    assert local.chat_sync({"messages": msgs}) == rendered  # the template's own text
    assert local.chat_sync({"messages": msgs, "add_special_tokens": True}) == [BOS, *rendered]
    with pytest.raises(GatewayError) as err:
        local.completion_sync({"prompt": text, "add_special_tokens": "perhaps"})
    assert err.value.status == 400 and err.value.param == "add_special_tokens"


async def test_completion_keys_match_the_engines_behind_a_bos_tokenizer(tmp_path: Path) -> None:
    """A replica whose tokenizer adds a BOS, agents feeding the index from its KV events,
    the gateway on the same tokenizer: a repeated completion prefix is predicted from the
    index (the gateway's own pending entries lapse after 1 ms) as the engine then reports
    it, and the start-up probe finds the tokenizers aligned."""
    model = str(bos_model(tmp_path))
    policy = (
        f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
        "index: {pending_ttl_ms: 1}\n"
    )
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    async with stack(count=1, replica=replica, policy=policy, agents=True) as st:
        assert st.gw.alignment_problems == []
        prefix = words(600, 2)
        got: list[tuple[int, int]] = []
        async with httpx.AsyncClient(base_url=st.url, timeout=30.0) as h:
            for i in range(40):  # bounded: the agent indexes the first answer's blocks
                body = {"model": st.model, "prompt": prefix + words(8, 100 + i), "max_tokens": 1}
                r = await h.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
                actual = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                got.append((predicted, actual))
                if i and predicted > 0:
                    break
                await asyncio.sleep(0.1)
        predicted, actual = got[-1]
        assert actual >= 592, got  # the engine holds the prefix (BOS + 600 words)
        assert predicted == actual, got
