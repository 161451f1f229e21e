"""Chat template content format (D34): vLLM 0.33 hands a template each message's content
as one string or, for a template that loops over a message's content (Gemma 3, Qwen2-VL,
Llama 4, Qwen3-VL), as a list of text parts (``--chat-template-content-format auto``,
``vllm/renderers/hf.py: _detect_content_format``). kvgate rendered the string format
only: behind such a model its rendered prompt, and so its block keys and the tenant's
uncached-token charge, were not the engine's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest

from cachecore.chatformat import detect_content_format
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import ReplicaSettings
from cachecore.responses import request_messages
from cachecore.tokenizer import ChatOptions, HFTokenizer, builtin_tokenizer
from gateway.tokenization import LocalPromptTokenizer, TokenizerPools
from policies.schema import ModelPool, parse_policy_text
from tests.test_gateway_support import FAST, stack, words
from tests.test_responses_replica import template_model

pytestmark = pytest.mark.timeout(60)

# google/gemma-3-4b-it's chat template (tokenizer_config.json), verbatim
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# Qwen/Qwen2-VL-7B-Instruct's (and Qwen2.5-VL's) chat template, verbatim
QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# meta-llama/Llama-4-Scout-17B-16E-Instruct's template, abridged to its message loop
# (tools dropped): the system message sliced off `messages`, content parts looped
LLAMA4 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
    {{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for content in message['content'] %}
            {%- if content['type'] == 'image' %}
                {{- '<|image|>' }}
            {%- elif content['type'] == 'text' %}
                {{- content['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}
"""

# Qwen/Qwen3-VL-8B-Instruct's template, abridged: the content rendered by a macro that
# a call hands `message.content` (vLLM's macro-parameter rule)
QWEN3_VL = """{%- macro render_content(content, do_vision_count) %}
    {%- if content is string %}
        {{- content }}
    {%- else %}
        {%- for item in content %}
            {%- if 'text' in item %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true) %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# meta-llama/Llama-3.1-8B-Instruct's template, abridged to its message loop: content
# used as a string (trimmed)
LLAMA31 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" + system_message + "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'
        + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen/Qwen3-8B's template, abridged: it reads `message.content` into a variable named
# content, but loops over no content
QWEN3 = """{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# a loop over the messages with a tuple target: vLLM's walk asserts a name, fails, and
# falls back to its default (string), though the template loops over content
TUPLE_LOOP = (
    "{% for role, message in messages %}{% for p in message['content'] %}"
    "{{ p['text'] }}{% endfor %}{% endfor %}"
)

# the format vLLM 0.33's _detect_content_format gives each (checked by running its
# walk, vllm/renderers/hf.py, on these very texts)
DETECTED = {
    "gemma3": (GEMMA3, "openai"),
    "qwen2_vl": (QWEN2_VL, "openai"),
    "llama4": (LLAMA4, "openai"),
    "qwen3_vl": (QWEN3_VL, "openai"),
    "llama31": (LLAMA31, "string"),
    "qwen3": (QWEN3, "string"),
    "tuple_loop": (TUPLE_LOOP, "string"),
}


def _env() -> jinja2.Environment:
    """transformers' template environment (what vLLM renders in)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(jinja2.TemplateError(m))
    return env


def _vllm_openai(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM 0.33's parse_chat_message_content with wrap_dicts (content format openai),
    written out here for text parts: a string content is one text part, None none, each
    text-like part ``{"type": "text", "text": ...}`` (empty ones kept)."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            parts: list[dict[str, Any]] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = [{"type": "text", "text": p["text"]} for p in content]
        out.append({**m, "content": parts})
    return out


def _model(tmp_path: Path, template: str) -> Path:
    """The built-in tokenizer as an HF model directory with ``template`` as its chat
    template (its <|endoftext|> the bos_token)."""
    directory = template_model(tmp_path, "", template)
    cfg = directory / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace('"bos_token": null', '"bos_token": "<|endoftext|>"'))
    return directory


def _engine_ids(tok: HFTokenizer, template: str, messages: list[dict[str, Any]]) -> list[int]:
    """The ids vLLM runs for ``messages`` under an openai-format ``template``."""
    text = (
        _env()
        .from_string(template)
        .render(
            messages=_vllm_openai(messages), add_generation_prompt=True, bos_token="<|endoftext|>"
        )
    )
    return tok.encode(text)


SYSTEM = "You answer in one line."
USER = [{"type": "text", "text": " first part "}, {"type": "text", "text": "second part"}]


@pytest.mark.parametrize("name", sorted(DETECTED))
def test_detection_agrees_with_vllm(name: str) -> None:
    template, expected = DETECTED[name]
    assert detect_content_format(_env(), template) == expected
    assert HFTokenizer(builtin_tokenizer()._tok, template, name).content_format == expected


def test_the_builtin_chatml_template_is_string_format() -> None:
    tok = builtin_tokenizer()
    assert tok.content_format == tok.detected_content_format == "string"


@pytest.mark.parametrize("name", ["gemma3", "qwen2_vl", "llama4"])
def test_openai_format_renders_the_engines_ids(tmp_path: Path, name: str) -> None:
    """A list of parts, a string and an absent content render as vLLM renders them for an
    openai-format template: each part its own item (Gemma trims each and joins them with
    nothing; a string template would see them joined by a newline)."""
    template = DETECTED[name][0]
    tok = HFTokenizer.from_dir(_model(tmp_path, template))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    msgs += [{"role": "user", "content": [*USER, {"type": "input_text", "text": ""}]}]
    msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    want = _engine_ids(tok, template, msgs)
    assert tok.encode_chat(msgs) == want
    assert LocalPromptTokenizer(tok).chat_sync({"messages": msgs}) == want  # the gateway's
    # the string format renders other text: what kvgate keyed before
    assert tok.with_content_format("string").encode_chat(msgs) != want


def test_a_tool_messages_parts_are_joined_and_continue_cuts_at_the_last_part(
    tmp_path: Path,
) -> None:
    """vLLM joins a tool message's text parts back into one string (empty ones kept) in
    the openai format; continue_final_message continues the final message's last text
    part (transformers' rule)."""
    tok = HFTokenizer(builtin_tokenizer()._tok, QWEN2_VL, "q")
    parts = [{"type": "text", "text": t} for t in ("a", "", "b")]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    msgs += [{"role": "tool", "content": parts}]
    assert "<|im_start|>tool\na\n\nb<|im_end|>" in tok.apply_chat_template(msgs)
    final: list[dict[str, Any]] = [{"role": "user", "content": "q"}]
    final += [{"role": "assistant", "content": [{"type": "text", "text": t} for t in ("x", "y")]}]
    text = tok.apply_chat_template(final, False, ChatOptions(continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nxy")


def test_a_responses_inputs_parts_render_as_parts(tmp_path: Path) -> None:
    """vLLM hands a Responses message item to its chat parser whole: under an
    openai-format template its input_text parts stay parts (not one joined string)."""
    tok = HFTokenizer.from_dir(_model(tmp_path, GEMMA3))
    item = {"role": "user", "content": [{"type": "input_text", "text": p["text"]} for p in USER]}
    messages = request_messages(SYSTEM, [], [item])
    want: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    want += [{"role": "user", "content": USER}]
    assert tok.encode_chat(messages) == _engine_ids(tok, GEMMA3, want)


def test_the_operator_override_beside_the_tokenizer(tmp_path: Path) -> None:
    """models.<pool>.chat_template_content_format (the gateway) and the replica's
    chat_template_content_format (KVGATE_REPLICA_ prefix) override the detection as
    vLLM's --chat-template-content-format does; an engine-rendered pool refuses one."""
    model = str(_model(tmp_path, GEMMA3))
    pool = ModelPool(tokenizer="hf", tokenizer_dir=model, chat_template_content_format="string")
    pools = TokenizerPools(httpx.AsyncClient(), lambda m, t: None)
    assert pools.local(pool).tok.content_format == "string"  # type: ignore[attr-defined]
    assert pools.local(ModelPool(tokenizer="hf", tokenizer_dir=model)).tok.content_format == (  # type: ignore[attr-defined]
        "openai"
    )
    with pytest.raises(ValueError, match="chat_template_content_format"):
        parse_policy_text(
            "models: {default: {tokenizer: engine_render, chat_template_content_format: openai}}"
        )
    settings = ReplicaSettings(chat_template_content_format="string")
    assert settings.chat_template_content_format == "string"


async def test_replica_override_renders_in_the_given_format() -> None:
    settings = FAST.model_copy(update={"chat_template_content_format": "openai"})
    async with run_fleet(settings, count=1) as fleet, httpx.AsyncClient() as h:
        body = {"model": settings.model, "messages": [{"role": "user", "content": "hi"}]}
        r = await h.post(fleet.endpoints[0].url + "/tokenize", json=body)
        assert r.status_code == 200, r.text
        text = builtin_tokenizer().decode(r.json()["tokens"])
        assert "[{'type': 'text', 'text': 'hi'}]" in text  # ChatML given the list


async def test_a_two_turn_chat_is_predicted_as_the_engine_caches_it(tmp_path: Path) -> None:
    """Gemma 3's template on the gateway and the replica: the second turn's predicted
    cached tokens (from the index the agents feed) are what the replica reports, and the
    prompt it runs is vLLM's openai-format rendering."""
    directory = _model(tmp_path, GEMMA3)
    model = str(directory)
    tok = HFTokenizer.from_dir(directory)
    policy = (
        f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
        "index: {pending_ttl_ms: 1}\n"
    )
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    system = words(300, 5)
    first: list[dict[str, Any]] = [{"role": "system", "content": system}]
    first += [{"role": "user", "content": USER}]
    got: list[tuple[int, int]] = []
    async with stack(count=1, replica=replica, policy=policy, agents=True) as st:
        assert st.gw.alignment_problems == []
        async with httpx.AsyncClient(base_url=st.url, timeout=30.0) as h:
            r = await h.post(
                "/v1/chat/completions",
                json={"model": st.model, "messages": first, "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == len(_engine_ids(tok, GEMMA3, first))
            for i in range(40):  # bounded: the agent indexes the first turn's blocks
                second: list[dict[str, Any]] = [
                    *first,
                    {"role": "assistant", "content": "An answer."},
                    {"role": "user", "content": [{"type": "text", "text": words(8, 100 + i)}]},
                ]
                body = {"model": st.model, "messages": second, "max_tokens": 1}
                r = await h.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                assert usage["prompt_tokens"] == len(_engine_ids(tok, GEMMA3, second))
                predicted = int(r.headers.get("x-kvgate-predicted-cached-tokens", "0"))
                got.append((predicted, usage["prompt_tokens_details"]["cached_tokens"]))
                if predicted > 0:
                    break
                await asyncio.sleep(0.1)
    predicted, actual = got[-1]
    assert actual >= 304, got  # the first turn's system prompt and more
    assert predicted == actual, got
