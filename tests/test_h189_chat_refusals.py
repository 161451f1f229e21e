"""H189: a chat completion's ``tools: []`` refused as vLLM 0.33 refuses it
(``ChatCompletionRequest.check_tool_usage``: a 400 naming ``tools``, whatever
``tool_choice`` says) by the gateway before any charge and by the simulated replica, while
``/tokenize`` drops it (``to_chat_completion_request``); a Responses request's refused
chat option named as the gateway names it at the replica too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import (
    EMPTY_TOOLS,
    ChatOptions,
    ScoreTemplate,
    TokenizerError,
    UnnamedFieldError,
    builtin_tokenizer,
    option_param,
)
from gateway.errors import GatewayError
from tests.test_gateway_support import stack
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(90)

_MSGS = [{"role": "user", "content": "hello there"}]


def test_empty_tools_refused_for_the_chat_form_only() -> None:
    for choice in (None, "none", "auto", "required"):
        body: dict[str, Any] = {"tools": [], "tool_choice": choice}
        with pytest.raises(TokenizerError) as exc:
            ChatOptions.from_body(body, "chat")
        assert str(exc.value) == EMPTY_TOOLS and option_param(exc.value) == "tools"
    # vLLM's /tokenize renders an empty tools as [] (over a server's default tools: H199,
    # create_tokenize's tool_dicts); pooling ignores it
    assert ChatOptions.from_body({"tools": []}, "tokenize") == ChatOptions(tools=[])
    assert ChatOptions.from_body({"tools": []}, "pooling") is None


async def test_gateway_and_replica_refuse_empty_tools(tmp_path: Path) -> None:
    model = str(template_model(tmp_path, ""))
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    async with stack(count=1, replica=replica, policy=policy) as st:
        url = st.fleet.endpoints[0].url
        chat = {"model": st.model, "messages": _MSGS, "max_tokens": 1, "tools": []}
        async with httpx.AsyncClient(timeout=30.0) as h:
            for where in (st.url, url):
                r = await h.post(where + "/v1/chat/completions", json=chat)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["param"] == "tools" and err["message"] == EMPTY_TOOLS, r.text
            # refused before the decision (no charge, no routing)
            with pytest.raises(GatewayError):
                await st.gw.prepare("chat", "anonymous", dict(chat), {}, "x", True)
            r = await h.post(url + "/tokenize", json={"model": st.model, "messages": _MSGS,
                                                      "tools": []})  # fmt: skip
            assert r.status_code == 200, r.text
            # a Responses request's refused chat option: named as the gateway names it
            for kw, param in (
                ({"tokenize": True, "padding": "max_length"}, "chat_template_kwargs"),
                ({"conversation": []}, None),
            ):
                resp = {"model": st.model, "input": "hi", "max_output_tokens": 1,
                        "chat_template_kwargs": kw}  # fmt: skip
                for where in (st.url, url):
                    r = await h.post(where + "/v1/responses", json=resp)
                    assert r.status_code == 400, (where, r.text)
                    assert r.json()["error"]["param"] == param, (where, r.text)


def test_a_self_kwarg_is_one_message_for_chat_and_score() -> None:
    """Python 3.10+ names a bound method by its qualified name: one text for a chat's and
    a score template's ``self`` kwarg, as vLLM's transformers call raises it."""
    # vLLM 0.33's HfRenderer pools a fast tokenizer (maybe_make_thread_pool): its class is
    # then TokenizerPool, whose apply_chat_template takes the call (H191)
    said = (
        "maybe_make_thread_pool.<locals>.TokenizerPool.apply_chat_template() got multiple "
        "values for argument 'self'"
    )
    with pytest.raises(UnnamedFieldError) as chat:
        ChatOptions.from_body({"chat_template_kwargs": {"self": 1}}, "chat")
    with pytest.raises(UnnamedFieldError) as score:
        ScoreTemplate("{{ q }}").render(builtin_tokenizer(), "a", "b", {"self": 1})
    assert str(chat.value) == str(score.value) == said
