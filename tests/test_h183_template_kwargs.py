"""Which of a request's ``tools``, ``documents`` and ``chat_template_kwargs`` reach the
chat template, per vLLM 0.33 endpoint (H183). vLLM hands ``apply_chat_template`` one dict
of keywords built by ``merge_kwargs`` (``vllm/renderers/params.py``: an override whose
value is None or "auto" is dropped): ``build_chat_params`` lays the request's own fields
over its ``chat_template_kwargs``, then ``preprocess_chat``'s ``with_defaults`` lays that
over ``{tools: <request tools>, tokenize: False}``. So the kwargs' ``tools`` win over the
request's, a chat completion's ``documents`` win over the kwargs' (``/tokenize`` has no
``documents`` field: only the kwargs' render), and a None / "auto" kwarg is no variable,
in a Responses request too: its first ``with_defaults`` is over the server's default
kwargs, never empty (``resolve_default_chat_template_kwargs`` sets ``--cohere-format``'s
``cmd4``; H197). The gateway and the simulated replica rendered the top-level fields over
the kwargs and kept None / "auto" kwargs as variables. Here vLLM's merges are rebuilt from
its code and the template is rendered with what they pass; the replica runs, and the
gateway charges, exactly that."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from cachecore.tokenizer import ChatOptions, HFTokenizer, chat_completion_tools
from tests.test_gateway_support import FAST, stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(120)

_HEAD = (
    "{% if tools is not none %}<tools {{ tools | tojson }}>{% endif %}"
    "{% if documents is not none %}<docs {{ documents | tojson }}>{% endif %}"
    "{% if flag is defined %}<flag {{ flag }}>{% endif %}"
    "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}\n"
)
_T1 = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
_T2 = [{"type": "function", "function": {"name": words(6, 3), "parameters": {}}}]
_D1 = [{"title": "t", "text": words(20, 7)}]
_D2 = [{"title": "u", "text": words(9, 8)}]
_MSGS = [{"role": "system", "content": words(30, 1)}, {"role": "user", "content": "hi"}]

# (top-level fields, chat_template_kwargs)
_CASES: list[tuple[dict[str, Any], dict[str, Any] | None]] = [
    ({"tools": _T1}, {"tools": _T2}),  # the kwargs' tools win
    ({}, {"tools": _T2}),
    ({"tools": _T1}, {"tools": None}),
    ({"tools": _T1}, {"tools": "auto"}),
    ({}, {"documents": _D2}),  # a chat's documents: the request's, else the kwargs'
    ({"documents": _D1}, {"documents": _D2}),
    ({"documents": _D1}, None),
    ({}, {"documents": None, "flag": None}),  # no variables
    ({}, {"flag": "auto"}),
    ({}, {"flag": "x", "continue_final_message": True}),  # the request's flag stands
    ({"reasoning_effort": "high"}, {"reasoning_effort": "low"}),
    ({}, {"reasoning_effort": "low", "enable_thinking": None}),
]


def _merge(
    defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None
) -> dict[str, Any]:
    """vLLM 0.33's ``merge_kwargs``, as written."""
    return {
        **(defaults or {}),
        **{k: v for k, v in (overrides or {}).items() if v not in (None, "auto")},
    }


def _with_defaults(defaults: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``ChatParams.with_defaults`` for the chat template kwargs: no defaults, unchanged."""
    return kwargs if not defaults else _merge(defaults, kwargs)


_SERVER = {"cohere_format": "cmd4"}
"""A vLLM 0.33 server's default kwargs with no --default-chat-template-kwargs."""


def _vllm_kwargs(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords vLLM 0.33 calls ``apply_chat_template`` with for ``body`` at
    ``endpoint`` (the server's default kwargs :data:`_SERVER`): ``build_chat_params`` of
    the endpoint's request (``ChatCompletionRequest``, ``TokenizeChatRequest``,
    ``ResponsesRequest``), ``preprocess_chat``'s defaults and ``with_defaults``."""
    user = body.get("chat_template_kwargs")
    extra: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
    }
    effort = body.get("reasoning_effort")
    if endpoint == "chat":
        extra.update(documents=body.get("documents"), reasoning_effort=effort)
    if endpoint == "responses":
        extra.update(reasoning_effort=effort)
    if endpoint != "tokenize" and effort is not None and "enable_thinking" not in (user or {}):
        extra["enable_thinking"] = effort != "none"
    params = _merge(user, extra)
    # OnlineRenderer.render_responses passes its effective kwargs as the defaults
    defaults = _with_defaults(_SERVER, params) if endpoint == "responses" else dict(_SERVER)
    tools = body.get("tools")
    if tools is not None and endpoint != "responses":  # render_chat's tool.model_dump()
        tools = chat_completion_tools(tools)
    defaults = _merge(defaults, {"tools": tools, "tokenize": False})
    return _with_defaults(defaults, params)


def _expected(tok: HFTokenizer, endpoint: str, body: Mapping[str, Any]) -> int:
    """The prompt's tokens as transformers renders ``_vllm_kwargs``: ``tools``,
    ``documents``, ``add_generation_prompt`` and ``continue_final_message`` its own
    parameters, the rest template variables."""
    kw = _vllm_kwargs(endpoint, body)
    add_gen, cont = kw.pop("add_generation_prompt"), kw.pop("continue_final_message")
    tools, docs = kw.pop("tools", None), kw.pop("documents", None)
    kw.pop("tokenize")
    opts = ChatOptions(tools, docs, cont, kw)
    return len(tok.encode(tok.apply_chat_template(body["messages"], add_gen, opts)))


def _body(top: dict[str, Any], kwargs: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": _MSGS, **top}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    return body


async def test_chat_render_and_tokenize_pass_the_template_what_vllm_passes(tmp_path: Path) -> None:
    """Each case: a chat completion runs (and is charged, locally and by an
    ``engine_tokenize`` pool's /tokenize) vLLM's chat rendering, ``/v1/chat/completions/
    render`` answers the same ids, ``/tokenize`` its own rendering; the kwargs' tools
    override the request's, a kwargs None or "auto" is no variable."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    local = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    engine = "models: {default: {tokenizer: engine_tokenize}}\n"
    differs = 0
    async with (
        stack(count=1, replica=replica, policy=local) as st,
        stack(count=1, replica=replica, policy=engine) as est,
        st.http() as h,
    ):
        url = st.fleet.endpoints[0].url
        for top, kwargs in _CASES:
            body = _body(top, kwargs)
            want = _expected(tok, "chat", body)
            chat = {**body, "model": st.model, "max_tokens": 1}
            r = await h.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, (top, kwargs, r.text)
            assert r.json()["usage"]["prompt_tokens"] == want, (top, kwargs, r.json()["usage"])
            d = await st.gw.prepare("chat", "anonymous", dict(chat), {}, "x", True)
            assert d.prompt_tokens == want, (top, kwargs, d.prompt_tokens, want)
            d = await est.gw.prepare("chat", "anonymous", dict(chat), {}, "x", True)
            assert d.prompt_tokens == want, ("engine_tokenize", top, kwargs, d.prompt_tokens)
            r = await h.post(url + "/v1/chat/completions/render", json=chat)
            assert r.status_code == 200, (top, kwargs, r.text)
            assert len(r.json()["token_ids"]) == want, (top, kwargs)
            r = await h.post(url + "/tokenize", json={**body, "model": st.model})
            assert r.status_code == 200, (top, kwargs, r.text)
            tokenized = _expected(tok, "tokenize", body)
            assert r.json()["count"] == tokenized, (top, kwargs, r.json()["count"], tokenized)
            plain = _expected(tok, "chat", {"messages": _MSGS})
            differs += want != plain
    assert differs >= 6  # the cases render something


async def test_a_responses_request_passes_the_template_what_vllm_passes(tmp_path: Path) -> None:
    """A Responses request's kwargs over its function tools and ``reasoning.effort`` as
    vLLM's Responses path renders them (its None / "auto" kwargs no variables, as a chat
    completion's): the replica runs it, the gateway charges it."""
    model = template_model(tmp_path, _HEAD)
    tok = HFTokenizer.from_dir(model)
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    fn = {"type": "function", "name": "lookup", "parameters": {}}
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"tools": [fn]}, {"tools": _T2}),
        ({}, {"tools": _T2, "documents": _D2}),
        ({}, {"flag": None, "documents": None}),
        ({}, {"flag": "auto"}),
        ({"reasoning": {"effort": "high"}}, {"reasoning_effort": "low"}),
    ]
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for top, kwargs in cases:
            body = {"model": st.model, "input": _MSGS, "max_output_tokens": 1, **top}
            body["chat_template_kwargs"] = kwargs
            effort = top.get("reasoning", {}).get("effort")
            # the chat it renders (input messages as they are; tools other than the kwargs'
            # never reach this template)
            view = {"messages": _MSGS, "chat_template_kwargs": kwargs, "reasoning_effort": effort}
            want = _expected(tok, "responses", view)
            r = await h.post("/v1/responses", json=body)
            assert r.status_code == 200, (top, kwargs, r.text)
            assert r.json()["usage"]["input_tokens"] == want, (top, kwargs, r.json()["usage"])
            d = await st.gw.prepare("responses", "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == want, (top, kwargs, d.prompt_tokens, want)
