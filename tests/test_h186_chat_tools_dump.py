"""A chat completion's and a chat /tokenize's ``tools`` as vLLM 0.33 renders them (H186
review of d4aebeb): ``render_chat`` and ``create_tokenize`` pass the template each tool's
``ChatCompletionToolsParam.model_dump()`` (a missing description or parameters null, a
top-level ``defer_loading`` also the function's, other keys dropped), not the body's
tool. The gateway and the simulated replica rendered the raw tool. Also: under a template
that prints its tools and kwargs, the gateway predicts the cache the replica reports on a
two-request chat and Responses sequence (chat_template_kwargs over the request's fields)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import ChatForm, ChatOptions, HFTokenizer, TokenizerError
from tests.test_gateway_support import stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(90)

_HEAD = (
    "{% if tools is not none %}<tools {{ tools | tojson }}>{% endif %}"
    "{% if flag is defined %}<flag {{ flag }}>{% endif %}\n"
)
_RAW = [{"type": "function", "function": {"name": "lookup", "x": 1}, "defer_loading": "yes"}]
_DUMP = [
    {
        "type": "function",
        "function": {"name": "lookup", "description": None, "parameters": None,
                     "defer_loading": True},
        "defer_loading": True,
    }
]  # fmt: skip


def test_request_tools_are_rendered_as_their_model_dump() -> None:
    """vLLM's ChatCompletionToolsParam dump for a chat and /tokenize; the kwargs' tools,
    which win, go raw (no model reads them); what the model refuses, refused."""
    forms: tuple[ChatForm, ...] = ("chat", "tokenize")
    for form in forms:
        opts = ChatOptions.from_body({"tools": _RAW}, form)
        assert opts is not None and opts.tools == _DUMP, opts
    kw = [{"name": "raw"}]
    opts = ChatOptions.from_body({"tools": _RAW, "chat_template_kwargs": {"tools": kw}})
    assert opts is not None and opts.tools == kw
    bads: list[list[Any]] = [
        [{"type": "custom", "function": {"name": "f"}}],
        [{"function": {}}],
        ["f"],
    ]
    for bad in bads:
        with pytest.raises(TokenizerError):
            ChatOptions.from_body({"tools": bad})


async def _predicted_and_cached(
    h: httpx.AsyncClient,
    path: str,
    first: dict[str, Any],
    second: Callable[[int], dict[str, Any]],
    usage: str,
) -> tuple[int, int]:
    """The second request's predicted and reported cached tokens, once the agent has
    indexed the first's blocks."""
    r = await h.post(path, json=first)
    assert r.status_code == 200, r.text
    got = (0, 0)
    for i in range(40):  # bounded: the agent indexes the first request's blocks
        r = await h.post(path, json=second(i))
        assert r.status_code == 200, r.text
        cached = r.json()["usage"][usage]["cached_tokens"]
        got = (int(r.headers.get("x-kvgate-predicted-cached-tokens", "0")), cached)
        if got[0] > 0:
            break
        await asyncio.sleep(0.1)
    return got


async def test_tools_and_kwargs_run_charge_and_key_as_the_engine_renders(tmp_path: Path) -> None:
    model = str(template_model(tmp_path, _HEAD))
    tok = HFTokenizer.from_dir(Path(model))
    policy = (
        f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
        "index: {pending_ttl_ms: 1}\n"
    )
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    msgs = [{"role": "system", "content": words(120, 21)}, {"role": "user", "content": "q1"}]
    vllm = len(tok.encode_chat(msgs, True, ChatOptions(_DUMP)))
    async with stack(count=1, replica=replica, policy=policy, agents=True) as st:
        url = st.fleet.endpoints[0].url
        async with httpx.AsyncClient(base_url=st.url, timeout=30.0) as h:
            chat = {"model": st.model, "messages": msgs, "tools": _RAW, "max_tokens": 1}
            r = await h.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == vllm
            d = await st.gw.prepare("chat", "anonymous", dict(chat), {}, "x", True)
            assert d.prompt_tokens == vllm
            r = await h.post(url + "/tokenize", json={"model": st.model, "messages": msgs,
                                                        "tools": _RAW})  # fmt: skip
            assert r.json()["count"] == vllm, r.text
            # two-request sequences: the second turn's prefix predicted as cached
            kw = {"flag": "on", "tools": [{"name": "k"}], "enable_thinking": None}
            first = {**chat, "messages": msgs, "chat_template_kwargs": kw}

            def chat2(i: int) -> dict[str, Any]:
                more = [{"role": "assistant", "content": "a1"},
                        {"role": "user", "content": words(8, 200 + i)}]  # fmt: skip
                return {**first, "messages": [*msgs, *more]}

            p, c = await _predicted_and_cached(
                h, "/v1/chat/completions", first, chat2, "prompt_tokens_details"
            )
            assert c >= 128 and p == c, (p, c)
            rkw = {"flag": None, "other": "auto"}
            fn = {"type": "function", "name": "fn", "parameters": {}}
            resp = {"model": st.model, "input": msgs, "max_output_tokens": 1, "tools": [fn],
                    "chat_template_kwargs": rkw, "reasoning": {"effort": "low"}}  # fmt: skip

            def resp2(i: int) -> dict[str, Any]:
                more = [{"role": "assistant", "content": "a1"},
                        {"role": "user", "content": words(8, 300 + i)}]  # fmt: skip
                return {**resp, "input": [*msgs, *more]}

            p, c = await _predicted_and_cached(
                h, "/v1/responses", resp, resp2, "input_tokens_details"
            )
            assert c >= 128 and p == c, (p, c)
