"""A chat's ``chat_template_kwargs`` ``tokenize`` and transformers' other tokenization
parameters as vLLM 0.33 runs them (H186 review): ``render_messages`` splats the kwargs
into ``safe_apply_chat_template``, so a kwargs ``tokenize`` is transformers' own
``tokenize`` (the rendered text's ids, ``add_special_tokens=False``, with the kwargs'
``padding``/``truncation``/``max_length``/``tokenizer_kwargs``), never a template
variable. kvgate rendered them as variables and charged the unpadded prompt: a
``{"tokenize": true, "padding": "max_length", "max_length": 8000}`` chat would prefill
8,000 tokens charged as a few dozen. Now a plain truthy ``tokenize`` is charged and run
as vLLM runs it, and what the gateway cannot count (padding, truncation, tokenizer
kwargs, tensors, sanitizing, the request's special tokens) is a 400 naming
``chat_template_kwargs`` before any charge, at the gateway and the simulated replica."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import (
    ChatForm,
    ChatOptions,
    HFTokenizer,
    ServerChatDefaults,
    TokenizerError,
    UnnamedFieldError,
)
from tests.test_gateway_support import stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(90)

# a template that would print transformers' tokenization parameters were they variables
_HEAD = (
    "{% if tokenize is defined %}<tok {{ tokenize }}>{% endif %}"
    "{% if max_length is defined %}<max {{ max_length }}>{% endif %}"
    "{% if padding is defined %}<pad {{ padding }}>{% endif %}\n"
)
_PADDED = {"tokenize": True, "padding": "max_length", "max_length": 8000}


def test_tokenization_parameters_are_no_variables_and_uncountable_ones_refused() -> None:
    forms: tuple[ChatForm, ...] = ("chat", "tokenize", "responses", "pooling")
    for form in forms:
        opts = ChatOptions.from_body(
            {"chat_template_kwargs": {"tokenize": 1, "max_length": 9}}, form
        )
        assert opts is None, (form, opts)  # nothing left for the template
        for kw, body in (
            (_PADDED, {}),
            ({"tokenize": True, "truncation": True, "max_length": 4}, {}),
            ({"tokenize": "yes", "tokenizer_kwargs": {"padding_side": "left"}}, {}),
            ({"tokenize": True, "return_tensors": "pt"}, {}),
            ({"tokenize": True}, {"add_special_tokens": True}),
        ):
            with pytest.raises(TokenizerError, match=r"^'chat_template_kwargs' tokenize"):
                ChatOptions.from_body({**body, "chat_template_kwargs": kw}, form)
        ok = ChatOptions.from_body(
            {"add_special_tokens": "false", "chat_template_kwargs": {"tokenize": True, "x": 1}},
            form,
        )
        assert ok is not None and dict(ok.template_kwargs or {}) == {"x": 1}
        with pytest.raises(UnnamedFieldError, match="return_assistant_tokens_mask"):
            ChatOptions.from_body(
                {"chat_template_kwargs": {"return_assistant_tokens_mask": 1}}, form
            )
        for key, text in (
            ("conversation", "safe_apply_chat_template() got multiple values"),
            ("messages", "got multiple values for keyword argument 'messages'"),
            ("self", "multiple values for argument 'self'"),
        ):
            with pytest.raises(UnnamedFieldError, match=re.escape(text)):
                ChatOptions.from_body({"chat_template_kwargs": {key: []}}, form)
        # padding without tokenize: transformers returns text, the padding unused
        opts = ChatOptions.from_body({"chat_template_kwargs": {"padding": "max_length"}}, form)
        assert opts is None


async def test_gateway_charge_equals_replica_and_engine_rule(tmp_path: Path) -> None:
    model = str(template_model(tmp_path, _HEAD))
    tok = HFTokenizer.from_dir(Path(model))
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    msgs = [{"role": "system", "content": words(60, 5)}, {"role": "user", "content": "q"}]
    # vLLM's rule rebuilt: transformers renders with no tokenization parameter as a
    # variable and encodes the text without special tokens
    text = tok.apply_chat_template(msgs, True)
    assert "<tok" not in text and "<max" not in text
    vllm = len(tok.encode(text))
    async with stack(count=1, replica=replica, policy=policy) as st:
        url = st.fleet.endpoints[0].url
        async with httpx.AsyncClient(base_url=st.url, timeout=30.0) as h:
            kw = {"tokenize": True, "max_length": 8000}
            chat = {"model": st.model, "messages": msgs, "max_tokens": 1,
                    "chat_template_kwargs": kw}  # fmt: skip
            r = await h.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == vllm
            d = await st.gw.prepare("chat", "anonymous", dict(chat), {}, "x", True)
            assert d.prompt_tokens == vllm
            bad: dict[str, Any] = {**chat, "chat_template_kwargs": _PADDED}
            r = await h.post("/v1/chat/completions", json=bad)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "chat_template_kwargs", r.text
            r = await h.post(url + "/v1/chat/completions", json=bad)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "chat_template_kwargs", r.text
            conv = {**chat, "chat_template_kwargs": {"conversation": []}}
            for where in (st.url, url):  # vLLM's TypeError: a 400 with no param
                r = await h.post(where + "/v1/chat/completions", json=conv)
                assert r.status_code == 400 and r.json()["error"]["param"] is None, r.text
            tk = {"model": st.model, "messages": msgs, "chat_template_kwargs": _PADDED}
            r = await h.post(url + "/tokenize", json=tk)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_null_truncation_with_max_length_is_refused() -> None:
    """A server's default kwarg ``truncation: null`` reaches transformers (a request's None
    is dropped, a Responses request's too: H197): with a request's ``tokenize`` and
    ``max_length`` and padding off, its ``_get_padding_truncation_strategies`` truncates
    longest_first, and the engine runs the prompt cut at ``max_length`` where the gateway
    charged and keyed it whole (H191)."""
    server = ServerChatDefaults.of({"truncation": None})
    kw: dict[str, Any] = {"tokenize": True, "max_length": 5}
    forms: tuple[ChatForm, ...] = ("chat", "tokenize", "responses")
    for form in forms:
        with pytest.raises(TokenizerError, match=r"^'chat_template_kwargs' tokenize with trunc"):
            ChatOptions.from_body({"chat_template_kwargs": kw}, form, server)
        # no max_length, or padding on ("do_not_pad" is not False): transformers does not cut
        for other in ({"max_length": None}, {"padding": "do_not_pad"}):
            body = {"chat_template_kwargs": {**kw, **other}}
            assert ChatOptions.from_body(body, form, server) is None  # nothing to render
        # a request's None is dropped before transformers (merge_kwargs' unset values)
        body = {"chat_template_kwargs": {**kw, "truncation": None}}
        assert ChatOptions.from_body(body, form) is None
    # a pooling request gets no server defaults
    assert ChatOptions.from_body({"chat_template_kwargs": kw}, "pooling", server) is None
