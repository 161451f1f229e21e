"""H199: templates whose compiled code Python refuses, the shared lax-bool reader, /tokenize
and Responses tools: [] over a pool's default tools, and a Responses stream whose engine
request fails (vLLM 0.33 ends the body without a terminal event)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from cachecore.replica.settings import load_score_template
from cachecore.tokenizer import HFTokenizer, ScoreTemplate, TokenizerError, export_builtin
from gateway.tokenization import TokenizerPools
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
