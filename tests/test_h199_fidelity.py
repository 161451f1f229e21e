"""H199: templates whose compiled code Python refuses, the shared lax-bool reader, /tokenize
and Responses tools: [] over a pool's default tools, and a Responses stream whose engine
request fails (vLLM 0.33 ends the body without a terminal event)."""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import TypeAdapter

from cachecore.laxbool import lax_bool
from cachecore.replica.settings import load_score_template
from cachecore.tokenizer import (
    ChatOptions,
    HFTokenizer,
    ScoreTemplate,
    TokenizerError,
    export_builtin,
    option_param,
)
from gateway.errors import GatewayError
from gateway.tokenization import TokenizerPools, add_generation_prompt, continue_final_message
from policies.schema import PolicyError, parse_policy_text

pytestmark = pytest.mark.timeout(90)

# jinja2 parses these, then Python's compile() refuses the code it generates: a bare
# SyntaxError, not a TemplateSyntaxError (its line the generated code's)
_PYTHON_REFUSED = {
    "{% break %}": "'break' outside loop",
    "{% if x %}{% continue %}{% endif %}": "'continue' not properly in loop",
    "{% macro f(a, a) %}{% endmacro %}": "duplicate argument 'l_1_a' in function definition",
}


@pytest.mark.parametrize("source", sorted(_PYTHON_REFUSED))
def test_a_score_template_python_refuses_is_refused_as_one_that_does_not_parse(
    source: str, tmp_path: Path
) -> None:
    why = _PYTHON_REFUSED[source]
    with pytest.raises(
        TokenizerError, match=f"^score template does not compile: {re.escape(why)}$"
    ):
        ScoreTemplate(source)
    with pytest.raises(PolicyError, match=r"models\.default\.score_template") as exc:
        parse_policy_text(f"models:\n  default:\n    score_template: '{source}'\n")
    assert f"score template does not compile: {why}" in str(exc.value)
    path = tmp_path / "score.jinja"
    path.write_text(source)
    with pytest.raises(ValueError, match=re.escape(f"score template does not compile: {why}")):
        load_score_template(str(path))


@pytest.mark.parametrize("source", sorted(_PYTHON_REFUSED))
async def test_a_chat_template_python_refuses_refuses_the_tokenizer(
    source: str, tmp_path: Path
) -> None:
    why = _PYTHON_REFUSED[source]
    export_builtin(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(source)
    with pytest.raises(TokenizerError, match=f"^chat template does not compile: {re.escape(why)}$"):
        HFTokenizer.from_dir(tmp_path)
    policy = parse_policy_text(
        f"models:\n  default:\n    tokenizer: hf\n    tokenizer_dir: '{tmp_path}'\n"
    )
    async with httpx.AsyncClient() as client:
        problems = await TokenizerPools(client, lambda _m, _t: None).load_hf(policy.models)
    message = f"{str(tmp_path)!r} does not load: chat template does not compile: {why}"
    assert problems == [("models.default.tokenizer_dir", message)]


_LAX_WORDS = ("true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0")


def _lax_values() -> list[object]:
    values: list[object] = [None, True, False, 0, 1, 2, -1, 0.0, 1.0, 0.5, float("nan")]
    values += [b"yes", b"0", "", " ", "1.0", "２", [], {}]
    for word in _LAX_WORDS:
        for case in itertools.product(*[(c.lower(), c.upper()) for c in word]):
            text = "".join(case)
            values += [text, f" {text}", f"{text} ", f"\t{text}\n"]
    rng = random.Random(199)
    alphabet = "truefalsyonTRUEFALSYON01-+. \t"
    values += ["".join(rng.choices(alphabet, k=rng.randint(0, 5))) for _ in range(5000)]
    return values


def _read(reader: Callable[[object], object], value: object) -> tuple[object, ...]:
    try:
        return ("ok", reader(value))
    except (ValueError, GatewayError):  # pydantic's refusal, the gateway's 400
        return ("refused",)


def test_the_shared_lax_bool_reads_as_pydantic_and_the_gateway_readers_with_it() -> None:
    optional, required = TypeAdapter(bool | None), TypeAdapter(bool)
    for value in _lax_values():
        assert _read(lax_bool, value) == _read(optional.validate_python, value), value
        want = _read(required.validate_python, value)
        got = _read(lambda v: add_generation_prompt({"add_generation_prompt": v}), value)
        assert got == want, value
        assert _read(lambda v: continue_final_message({"continue_final_message": v}), value) == (
            want
        )


@pytest.mark.parametrize("flag", [" yes", " no", "no ", 2, "2", "none"])
def test_kwargs_tokenize_reads_add_special_tokens_as_vllms_request_model(flag: object) -> None:
    """vLLM 0.33's chat and /tokenize request models type ``add_special_tokens`` as a bool
    (pydantic, lax): a value it refuses is a 400 naming it before anything renders, where
    the kwargs-tokenize reading stripped whitespace (" no" off, " yes" on) and took any
    other value as on, refusing it as "tokenize with add_special_tokens" instead."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"tokenize": True},
        "add_special_tokens": flag,
    }
    for form in ("chat", "tokenize"):
        with pytest.raises(TokenizerError) as exc:
            ChatOptions.from_body(body, form)
        assert option_param(exc.value) == "add_special_tokens", str(exc.value)
    for ok, on in (("no", False), ("OFF", False), (0, False), (None, False), ("Yes", True)):
        body["add_special_tokens"] = ok
        if on:
            with pytest.raises(TokenizerError, match="tokenize with add_special_tokens"):
                ChatOptions.from_body(body, "chat")
        else:
            ChatOptions.from_body(body, "chat")  # no refusal: a tokenized chat, charged
