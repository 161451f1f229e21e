"""vLLM 0.33's chat parsing steps between a request's messages and the template, beside
the content format (H179 review of D34):

- ``parse_chat_message_content`` drops Claude Code's ``x-anthropic-billing-header`` line
  from a system message's text (``_strip_claude_code_billing_header``): its ``cch``
  value changes on every request, so kept, no block of one request keyed as another's
  where the engine caches them alike;
- ``safe_apply_chat_template`` renders developer messages as system ones, merged into
  one first system message, for a template that never names the role
  (``_convert_developer_to_system``, ``_consolidate_system_messages``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from cachecore.tokenizer import HFTokenizer, builtin_tokenizer
from tests.test_gateway_support import stack, words
from tests.test_h173_content_format import QWEN2_VL

pytestmark = pytest.mark.timeout(60)

HEADER = "x-anthropic-billing-header: cc_version=2.1.3; cch={};"


def _chatml(*turns: tuple[str, str]) -> str:
    """The built-in ChatML template's text for ``turns`` with a generation prompt."""
    body = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return body + "<|im_start|>assistant\n"


def test_the_billing_header_line_is_dropped_from_a_system_message() -> None:
    tok = builtin_tokenizer()
    said = [{"role": "user", "content": "hi"}]
    plain = [{"role": "system", "content": f"{HEADER.format(1)}\nYou are Claude."}, *said]
    assert tok.apply_chat_template(plain) == _chatml(("system", "You are Claude."), ("user", "hi"))
    # a text part losing its first line; a part that is the header alone dropped; a user
    # message's header and an input_text part are not vLLM's to strip
    parts: list[dict[str, Any]] = [
        {"type": "text", "text": HEADER.format(2)},
        {"type": "text", "text": f"{HEADER.format(3)}\nSystem text"},
        {"type": "input_text", "text": HEADER.format(4)},
    ]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": parts}]
    msgs += [{"role": "user", "content": HEADER.format(5)}]
    want = _chatml(("system", f"System text\n{HEADER.format(4)}"), ("user", HEADER.format(5)))
    assert tok.apply_chat_template(msgs) == want
    # the openai format: the kept parts as parts, the header alone an empty list
    qwen = HFTokenizer(tok._tok, QWEN2_VL, "q")
    assert qwen.content_format == "openai"
    assert qwen.apply_chat_template(plain) == qwen.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": "You are Claude."}]}, *said]
    )
    alone = [{"role": "system", "content": HEADER.format(6)}, *said]
    assert qwen.apply_chat_template(alone) == qwen.apply_chat_template(
        [{"role": "system", "content": []}, *said]
    )


def test_developer_messages_render_as_one_system_message_where_the_template_has_none() -> None:
    tok = builtin_tokenizer()  # ChatML: never names the developer role
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": [{"type": "text", "text": "Dev."}], "tools": tools},
        {"role": "system", "content": ""},
    ]
    want = _chatml(("system", "Sys.\n\nDev."), ("user", "hi"))
    assert tok.apply_chat_template(msgs) == want
    # one developer message first: renamed, nothing to merge
    first = [{"role": "developer", "content": "Dev."}, {"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(first) == _chatml(("system", "Dev."), ("user", "hi"))
    # a template that names the role sees the developer message as it is
    named = "{% if messages[0].role == 'developer' %}D{% endif %}" + tok.chat_template_source
    dev = HFTokenizer(tok._tok, named, "d")
    assert dev.apply_chat_template(first) == "D" + _chatml(("developer", "Dev."), ("user", "hi"))


async def test_a_billing_header_that_changes_per_request_keeps_the_cache_predicted() -> None:
    """Two chat completions whose system prompts differ only in the header's cch value:
    the replica (vLLM's parsing) caches the second's prompt from the first's, and the
    gateway predicts the tokens it reports cached. Keeping the line, both miss at its
    first block (0 cached)."""
    system = words(300, 7)
    got: list[tuple[int, int]] = []
    policy = "index: {pending_ttl_ms: 1}\n"
    async with (
        stack(count=1, policy=policy, agents=True) as st,
        httpx.AsyncClient(base_url=st.url, timeout=30.0) as h,
    ):
        for i in range(40):  # bounded: the agent indexes the first request's blocks
            msgs = [
                {"role": "system", "content": f"{HEADER.format(1000 + i)}\n{system}"},
                {"role": "user", "content": words(8, 100 + i)},
            ]
            body = {"model": st.model, "messages": msgs, "max_tokens": 1}
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            want = builtin_tokenizer().encode(
                _chatml(("system", system), ("user", words(8, 100 + i)))
            )
            usage = r.json()["usage"]
            assert usage["prompt_tokens"] == len(want)
            predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
            got.append((predicted, usage["prompt_tokens_details"]["cached_tokens"]))
            if i and predicted > 0:
                break
            await asyncio.sleep(0.1)
    predicted, actual = got[-1]
    assert actual >= 288, got  # the system prompt's blocks
    assert predicted == actual, got
