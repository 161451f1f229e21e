"""The built-in tokenizer's long-text path: the same ids as the short path, and the Rust
work runs without the GIL, so a worker thread encoding a long prompt leaves the event loop
(the main thread) free. Chat templates from model repositories render as transformers
renders them."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import cachecore
from cachecore.tokenizer import (
    UNLOCKED_ENCODE_CHARS,
    ChatOptions,
    HFTokenizer,
    TokenizerError,
    builtin_tokenizer,
    normalize_messages,
)


def _long_text(words: int) -> str:
    return " ".join(f"word{i} lorem ipsum dolor" for i in range(words))


def test_long_and_short_paths_give_the_same_ids() -> None:
    tok = builtin_tokenizer()
    text = _long_text(400)
    assert len(text) >= UNLOCKED_ENCODE_CHARS
    # the short path on pieces under the threshold, joined, must equal the long path
    # (word boundaries: the pieces split on spaces the tokenizer would split on anyway)
    direct = list(tok._tok.encode(text, add_special_tokens=False).ids)
    assert tok.encode(text) == direct
    short = "hello world, a short one"
    assert tok.encode(short) == list(tok._tok.encode(short, add_special_tokens=False).ids)


def test_a_long_encode_on_a_thread_does_not_hold_the_gil() -> None:
    tok = builtin_tokenizer()
    text = _long_text(4000)
    t0 = time.perf_counter()
    tok.encode(text)
    alone = time.perf_counter() - t0  # tens of ms

    done = threading.Event()

    def work() -> None:
        tok.encode(text)
        done.set()

    worker = threading.Thread(target=work)
    gaps: list[float] = []
    last = time.perf_counter()
    worker.start()
    while not done.is_set():  # the main thread's progress while the worker encodes
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.0005)
    worker.join()
    # holding the GIL, the worker would stall this loop for the whole encode; released, the
    # longest stall is the GIL hand-back at the end (building the id list), a few ms
    assert max(gaps) < 0.5 * alone, (max(gaps), alone)


# A chat template written the way model repositories write them (transformers' rendering
# rules: trim_blocks and lstrip_blocks, bos_token, tojson, raise_exception, loop controls,
# {% generation %}, tools, tool calls, template kwargs). The expected texts are what
# transformers 4.57.6's apply_chat_template rendered for the same template and inputs
# (checked side by side in a separate venv; docs/gateway.md, "Tokens").
HF_TEMPLATE = Path(__file__).parent / "data" / "hf_style_chat_template.jinja"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für <Stadt> & Land",
        "parameters": {"type": "object"},
    },
}


def hf_style_dir(tmp_path: Path) -> Path:
    shutil.copyfile(Path(cachecore.__file__).parent / "data" / "tokenizer.json",
                    tmp_path / "tokenizer.json")  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # an AddedToken dict, as many repositories store it
        "bos_token": {"content": "<|endoftext|>", "lstrip": False, "rstrip": False},
        "eos_token": "<|im_end|>",
        "chat_template": HF_TEMPLATE.read_text(),
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_repository_chat_template_renders_as_transformers_renders_it(tmp_path: Path) -> None:
    tok = HFTokenizer.from_dir(hf_style_dir(tmp_path))
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Zürich <now>?"}]  # fmt: skip
    assert tok.apply_chat_template(chat, True, ChatOptions(tools=[TOOL])) == (
        '<|endoftext|><tool>{"type": "function", "function": {"name": "get_weather", '
        '"description": "Wetter für <Stadt> & Land", "parameters": {"type": "object"}}}'
        "</tool><|im_start|>system\nBe brief.<|im_end|><|im_start|>user\nWeather in Zürich "
        "<now>?<|im_end|><|im_start|>assistant"
    )
    calls = [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "x", "arguments": '{"city": "Rome"}'}},
    ]  # fmt: skip
    turns: list[dict[str, Any]] = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "calling", "tool_calls": calls},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    opts = ChatOptions(template_kwargs={"enable_thinking": False})
    assert tok.apply_chat_template(turns, True, opts) == (
        "<|endoftext|><|im_start|>user\nhi<|im_end|><|im_start|>assistant\ncalling"
        '<call name="get_weather" city="Paris"/><|im_end|><|im_start|>tool c1\nsunny'
        "<|im_end|><|im_start|>assistant /no_think"
    )
    poem = [{"role": "user", "content": "write a poem"},
            {"role": "assistant", "content": "Roses are red,  "}]  # fmt: skip
    cont = ChatOptions(continue_final_message=True)
    assert tok.apply_chat_template(poem, False, cont) == (
        "<|endoftext|><|im_start|>user\nwrite a poem<|im_end|><|im_start|>assistant\n"
        "Roses are red,  "
    )
    with pytest.raises(TokenizerError, match="both"):
        tok.apply_chat_template(poem, True, cont)
    with pytest.raises(TokenizerError, match="system only first"):  # raise_exception
        tok.apply_chat_template([{"role": "user", "content": "a"},
                                 {"role": "system", "content": "late"}])  # fmt: skip
    # arguments that are no JSON object render as {} (vLLM 0.33), not a 400
    bad = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]  # fmt: skip
    assert '<call name="f" city=""/>' in tok.apply_chat_template(bad)


@pytest.mark.parametrize(
    ("arguments", "parsed"),
    [
        ('{"city": "Paris", "n": [1]}', {"city": "Paris", "n": [1]}),
        ("", {}),
        ("{oops", {}),  # no JSON
        ('{"a": 1', {}),  # cut off mid-stream
        ("[1, 2]", {}),  # JSON, but no object
        ("42", {}),
        ("true", {}),
        ('"text"', {}),
        ("null", {}),
        ("{}", {}),
    ],
)
def test_tool_call_arguments_are_the_object_vllm_renders(arguments: str, parsed: Any) -> None:
    # vLLM 0.33 (_postprocess_messages): the JSON object a string holds, else {} (a
    # malformed call in the history must not fail every later turn); kvgate answered 400
    calls: list[dict[str, Any]] = [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    ]
    msgs = [{"role": "assistant", "content": "", "tool_calls": calls}]
    got = normalize_messages(msgs)[0]["tool_calls"]
    assert got == [{"id": "c", "type": "function", "function": {"name": "f", "arguments": parsed}}]
    assert calls[0]["function"]["arguments"] == arguments  # the request is left as it came


@pytest.mark.parametrize("arguments", [None, {"city": "Paris"}, ["x"], 7, True, "absent"])
def test_tool_call_arguments_not_a_string_are_refused(arguments: Any) -> None:
    # vLLM's request model (function.arguments: str) refuses these before rendering
    fn: dict[str, Any] = {"name": "f"}
    if arguments != "absent":
        fn["arguments"] = arguments
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": fn}]}]  # fmt: skip
    with pytest.raises(TokenizerError, match=r"messages\[1\].*function.arguments must be a string"):
        normalize_messages(msgs)


def test_continue_final_message_cuts_as_transformers_does(tmp_path: Path) -> None:
    """transformers' rule, which vLLM renders with: an empty final message (a
    reasoning-only assistant turn, a continued Responses reasoning item) cuts nothing, and
    a content with leading whitespace loses its trailing whitespace (transformers compares
    the rendered text with the whole content). Both were kvgate's own: a 400, and the
    trailing whitespace kept."""
    tok = HFTokenizer.from_dir(hf_style_dir(tmp_path))
    cont = ChatOptions(continue_final_message=True)
    q = {"role": "user", "content": "q"}
    empty = [q, {"role": "assistant", "content": ""}]
    assert tok.apply_chat_template(empty, False, cont) == tok.apply_chat_template(empty, False)
    lead = [q, {"role": "assistant", "content": " hi  "}]
    assert tok.apply_chat_template(lead, False).count(" hi  ") == 1
    assert tok.apply_chat_template(lead, False, cont).endswith("assistant\n hi")


def test_chat_options_come_from_the_request_body() -> None:
    assert ChatOptions.from_body({"messages": []}) is None  # the common case: nothing extra
    got = ChatOptions.from_body(
        {"tools": [TOOL], "continue_final_message": True, "chat_template_kwargs": {"x": 1}}
    )
    assert got == ChatOptions([TOOL], None, True, {"x": 1})
    with pytest.raises(TokenizerError, match="tools"):
        ChatOptions.from_body({"tools": "nope"})


def test_tokenizer_cli_with_nothing_to_do_is_a_usage_error_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`kvgate tokenizer` with no flag printed "nothing to do" on stdout, where a caller
    reading its output (`ids=$(kvgate tokenizer ...)`) took it for the result."""
    from gateway.cli import main

    assert main(["tokenizer"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("kvgate tokenizer: error: nothing to do"), err
