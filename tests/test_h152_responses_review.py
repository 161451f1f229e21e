"""Review of D31 and the session-bound response ids (H152): what vLLM renders of a
Responses request's input items that the gateway must key and size too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachecore.responses import input_messages
from cachecore.tokenizer import HFTokenizer, export_builtin
from gateway.core import _responses_chat

# a template that renders a message's name and a developer message's tools, as some
# models' templates do (vLLM's chat parser keeps both for them)
_NAMED = (
    "{%- for message in messages -%}\n<|im_start|>{{ message['role'] }}"
    "{% if message.name is defined %} ({{ message.name }}){% endif %}\n"
    "{% if message.tools %}{{ message.tools | tojson }}\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor -%}\n"
    "{%- if add_generation_prompt -%}\n<|im_start|>assistant\n{% endif -%}\n"
)


def _named_model(directory: Path) -> Path:
    export_builtin(directory)
    (directory / "chat_template.jinja").write_text(_NAMED)
    cfg = directory / "tokenizer_config.json"
    config = json.loads(cfg.read_text())
    config["chat_template"] = _NAMED
    cfg.write_text(json.dumps(config))
    return directory


def test_a_message_items_name_and_a_developers_tools_are_read_as_vllm_keeps_them() -> None:
    # vLLM's ResponsesRequest is extra="allow", which the input's TypedDict items inherit,
    # and a user, system or developer item is handed to the chat parser whole: it keeps a
    # string name (any role) and a developer's tools. An assistant item is rebuilt from its
    # text alone (no name), as are calls, their outputs and reasoning.
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": "d", "tools": [{"x": 1}]},
        {"role": "system", "content": "s", "name": "ops"},
        {"role": "user", "content": [{"type": "input_text", "text": "u"}], "name": "ann"},
        {"role": "user", "content": "v", "name": 7},  # not a string: not kept
        {"role": "assistant", "content": "a", "name": "bot"},
    ]
    assert input_messages(items) == [
        {"role": "developer", "content": "d", "tools": [{"x": 1}]},
        {"role": "system", "content": "s", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "u"}], "name": "ann"},
        {"role": "user", "content": "v"},
        {"role": "assistant", "content": "a"},
    ]


def test_a_long_name_is_sized_as_the_engine_renders_it(tmp_path: Path) -> None:
    # budget: a name the template renders is prefilled by the engine, so the gateway's
    # chat view (what it keys and charges) renders it too, as the chat completion's
    tok = HFTokenizer.from_dir(_named_model(tmp_path))
    name = "x" * 4000
    body = {"input": [{"role": "user", "content": "hi", "name": name}]}
    view, exact = _responses_chat(body, "m")
    assert exact
    chat = [{"role": "user", "content": "hi", "name": name}]
    got = tok.encode_chat(view["messages"])
    assert got == tok.encode_chat(chat)
    assert len(got) > len(tok.encode_chat([{"role": "user", "content": "hi"}])) + 100
