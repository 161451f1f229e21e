"""A pooling request's chat form renders no request ``tools`` or ``documents`` (H180).
vLLM 0.33's pooling chat requests (``EmbeddingChatRequest``, ``EmbeddingChatInputRequest``,
the batched ``EmbeddingBatchChatRequest`` / ``...InputRequest``, ``PoolingChatRequest``,
``ClassificationChatRequest``: ``vllm/entrypoints/pooling/*/protocol.py``) declare no
``tools``, ``documents`` or ``reasoning_effort``; ``OpenAIBaseModel`` allows extra fields,
so they are ignored, not refused. ``ChatRequestOptionsMixin.build_chat_params`` passes the
request's ``chat_template_kwargs`` with ``add_generation_prompt`` and
``continue_final_message`` over them, and the pooling IO processors'
``with_defaults(tools=None, ...)`` lets the kwargs' ``tools`` and ``documents`` replace
those defaults (``merge_kwargs``: a None or "auto" value is no override), so they reach
``apply_chat_template``. The gateway and the simulated replica rendered the top-level
fields (charged and run more than the engine runs; a malformed one a 400 the engine never
gives) and dropped the kwargs' ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_gateway_support import FAST, stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(120)

# renders the tools, the documents and one extra variable first, when the template has them
_HEAD = (
    "{% if tools is not none %}<tools {{ tools | tojson }}>{% endif %}"
    "{% if documents is not none %}<docs {{ documents | tojson }}>{% endif %}"
    "{% if flag is defined %}<flag {{ flag }}>{% endif %}\n"
)
_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
_DOCS = [{"title": "t", "text": words(20, 7)}]
_MSGS = [{"role": "system", "content": words(40, 1)}, {"role": "user", "content": "hi"}]

# (path, endpoint, the conversation field and value)
_FORMS: list[tuple[str, str, dict[str, Any]]] = [
    ("/v1/embeddings", "embeddings", {"messages": _MSGS}),
    ("/v1/embeddings", "embeddings", {"input": _MSGS}),
    ("/v1/embeddings", "embeddings", {"messages": [_MSGS, _MSGS[1:]]}),
    ("/v1/embeddings", "embeddings", {"input": [_MSGS, _MSGS[1:]]}),
    ("/pooling", "pooling", {"messages": _MSGS}),
    ("/classify", "classify", {"messages": _MSGS}),
]


async def test_tools_and_documents_of_a_pooling_chat_are_not_rendered(tmp_path: Path) -> None:
    """Each pooling chat form with top-level ``tools`` / ``documents`` (well-formed, or
    of a type a chat completion refuses): the replica runs the tokens of the chat without
    them and the gateway charges exactly that."""
    model = template_model(tmp_path, _HEAD)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    extras: list[dict[str, Any]] = [
        {"tools": _TOOLS},
        {"documents": _DOCS},
        {"tools": _TOOLS, "documents": _DOCS, "reasoning_effort": "high"},
        {"tools": "x", "documents": {"a": 1}},
    ]
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for path, ep, form in _FORMS:
            plain = await h.post(path, json=form)
            assert plain.status_code == 200, (path, form, plain.text)
            runs = plain.json()["usage"]["prompt_tokens"]
            for extra in extras:
                body = {**form, **extra}
                r = await h.post(path, json=body)
                assert r.status_code == 200, (path, extra, r.text)
                assert r.json()["usage"]["prompt_tokens"] == runs, (path, form, extra)
                d = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
                assert d.prompt_tokens == runs, (path, form, extra, d.prompt_tokens)


async def test_a_pooling_chats_template_kwargs_set_tools_and_documents(tmp_path: Path) -> None:
    """``chat_template_kwargs`` ``tools`` / ``documents`` reach the template (vLLM's
    ``apply_chat_template`` keywords), a None or "auto" kwarg is no variable, and the
    request's ``continue_final_message`` (false) overrides the kwargs' one: the replica
    runs the tools' and documents' text too, the gateway charges exactly what it runs."""
    model = template_model(tmp_path, _HEAD)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for path, ep, form in _FORMS:
            plain = await h.post(path, json=form)
            assert plain.status_code == 200, (path, form, plain.text)
            runs = plain.json()["usage"]["prompt_tokens"]
            unset = {**form, "chat_template_kwargs": {"flag": None, "tools": "auto"}}
            kw = {"tools": _TOOLS, "documents": _DOCS, "continue_final_message": True}
            shown = {**form, "chat_template_kwargs": kw}
            for body, more in ((unset, False), (shown, True)):
                r = await h.post(path, json=body)
                assert r.status_code == 200, (path, body, r.text)
                got = r.json()["usage"]["prompt_tokens"]
                assert (got > runs + 20) if more else (got == runs), (path, body, got, runs)
                d = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
                assert d.prompt_tokens == got, (path, body, d.prompt_tokens, got)
