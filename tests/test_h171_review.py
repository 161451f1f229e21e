"""H171's review of 3087669 (Responses tool_choice refusals, lax tool flags, empty tool
names), e4c8f04 and 91b8a15 (the replica's pooling truncation): the order of vLLM 0.33's
refusals, the keys of lax tools, and ``truncation_side`` refused before a charge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cachecore.replica.settings import ReplicaSettings
from gateway.core import _responses_chat
from gateway.errors import GatewayError
from tests.test_gateway_support import FAST, stack, words
from tests.test_pooling_options import roberta_pairs_model
from tests.test_responses_gateway import (
    _engine_requests,
    _every_request_keyed_no_claim_failed,
    _repeated_on_one_replica,
)
from tests.test_responses_replica import tools_model

pytestmark = pytest.mark.timeout(90)

_NAMED = {"type": "function", "name": "nope"}


@pytest.mark.parametrize(
    "extra",
    [
        # vLLM's check_tool_usage is its request model's first before-validator: a bad
        # tool_choice is named ahead of a bad input...
        {"input": 5, "tools": [{"type": "function", "name": "f"}], "tool_choice": _NAMED},
        {"input": [{"role": "nobody", "content": "x"}], "tool_choice": "required"},
        # ...and ahead of a malformed tools: an empty one is no tools, a non-empty string
        # or object has no tool of that name (vLLM iterates it)
        {"input": "x", "tools": "", "tool_choice": "required"},
        {"input": "x", "tools": {}, "tool_choice": _NAMED},
        {"input": "x", "tools": "abc", "tool_choice": _NAMED},
        {"input": "x", "tools": {"name": "nope"}, "tool_choice": _NAMED},
    ],
)
def test_a_bad_tool_choice_is_named_first_as_vllm_names_it(extra: dict[str, Any]) -> None:
    with pytest.raises(GatewayError) as got:
        _responses_chat(extra, "m")
    assert got.value.param == "tool_choice", got.value


@pytest.mark.parametrize(
    "extra",
    [
        # vLLM's check_custom_tool_format runs next, still ahead of the input's parsing
        {
            "input": 5,
            "tools": [
                {
                    "type": "custom",
                    "name": "c",
                    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /x/"},
                }
            ],
        },
        # a non-empty malformed tools with no named choice: vLLM's field validation
        {"input": "x", "tools": "abc", "tool_choice": "required"},
        {"input": "x", "tools": [5, {"type": "custom", "name": "c"}], "tool_choice": "auto"},
    ],
)
def test_what_vllm_names_tools_is_named_tools(extra: dict[str, Any]) -> None:
    with pytest.raises(GatewayError) as got:
        _responses_chat(extra, "m")
    assert got.value.param == "tools", got.value


async def test_the_replica_names_a_bad_tool_choice_first_as_vllm_does() -> None:
    async with stack(count=1) as st, st.http() as h:
        url = st.fleet.endpoints[0].url + "/v1/responses"
        for extra in (
            {"input": 5, "tool_choice": "required"},
            {"input": [{"role": "nobody", "content": "x"}], "tool_choice": _NAMED},
            {"input": "x", "tools": "", "tool_choice": "required"},
        ):
            r = await h.post(url, json={"model": st.model, **extra})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "tool_choice", r.text


async def test_lax_tool_flags_and_empty_names_are_predicted_as_the_engine_caches_them(
    tmp_path: Path,
) -> None:
    # strict / defer_loading as pydantic's lax booleans and an empty tool name: the gateway
    # keys the prompt the replica renders, so a repeat's predicted cached tokens are the
    # engine's reported ones
    model = tools_model(tmp_path)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        tools = [
            {"type": "function", "name": "", "parameters": {"type": "object"}, "strict": "YES"},
            {"type": "function", "name": "g", "strict": 0, "defer_loading": "off"},
            {"type": "function", "name": "h", "strict": 1.0, "defer_loading": "t"},
            {"type": "custom", "name": "", "strict": "whatever"},
        ]
        body = {
            "model": st.model, "instructions": words(64, 21), "input": words(40, 22),
            "tools": tools, "tool_choice": {"type": "function", "name": "g"},
            "max_output_tokens": 2,
        }  # fmt: skip
        await _repeated_on_one_replica(h, body)
        _every_request_keyed_no_claim_failed(st)


async def test_a_pooling_truncation_side_vllm_refuses_is_a_400_before_any_work() -> None:
    async with stack(count=1) as st, st.http() as h:
        ran = await _engine_requests(st)
        body = {"model": st.model, "input": "a b c", "truncate_prompt_tokens": 2}
        side: Any
        for side in ("middle", 1, ""):
            # the gateway's own 400, before routing or a charge (as for padding)
            with pytest.raises(GatewayError) as err:
                await st.gw.prepare(
                    "embeddings", "anonymous", {**body, "truncation_side": side}, {}, "x",
                    explain_only=True,
                )  # fmt: skip
            assert err.value.status == 400 and err.value.param == "truncation_side"
            r = await h.post("/v1/embeddings", json={**body, "truncation_side": side})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "truncation_side", r.text
        assert await _engine_requests(st) == ran
        for side in ("left", "right", None):
            r = await h.post("/v1/embeddings", json={**body, "truncation_side": side})
            assert r.status_code == 200, r.text


async def test_a_truncated_or_special_pooling_prompt_is_charged_what_the_engine_runs(
    tmp_path: Path,
) -> None:
    # checked sound: whatever truncation_side, -1, padding or add_special_tokens (the chat
    # form's too) a pooling request carries, the gateway charges the tokens the replica
    # runs (RoBERTa's special tokens, so add_special_tokens counts)
    model = roberta_pairs_model(tmp_path)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=str(model))
    forms: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": words(6, 31)}]},
        {"input": [words(6, 32), "a"]},
    ]
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for extra in (
            {}, {"add_special_tokens": True}, {"add_special_tokens": False},
            {"add_special_tokens": True, "truncate_prompt_tokens": 3},
            {"add_special_tokens": True, "truncate_prompt_tokens": -1},
            {"add_special_tokens": True, "truncate_prompt_tokens": 1, "truncation_side": "right"},
            {"truncate_prompt_tokens": 4, "truncation_side": "left", "padding": "max_length"},
        ):  # fmt: skip
            for form in forms:
                body = {"model": st.model, **form, **extra}
                got = await st.gw.prepare("embeddings", "anonymous", dict(body), {}, "x", True)
                r = await h.post("/v1/embeddings", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] == got.prompt_tokens, (extra, form)
