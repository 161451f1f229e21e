"""A /score or /rerank request's ``chat_template_kwargs`` that name apply_chat_template's
own parameters (H179 review of H175's score templates): vLLM 0.33's ``get_score_prompt``
passes the kwargs to ``safe_apply_chat_template`` as keywords, so transformers'
``apply_chat_template`` takes ``add_generation_prompt``, ``documents`` and
``continue_final_message`` from them (the scorer sets none of them itself). kvgate set the
first two after the kwargs (False, None) and rendered the third as a variable: such a
pair was charged, and the simulated replica ran it, without the generation prompt or the
documents, and uncut."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cachecore.tokenizer import builtin_tokenizer
from tests.test_gateway_support import FAST, stack, words

pytestmark = pytest.mark.timeout(90)

TEMPLATE = (
    "<|im_start|>user\n{{ messages[0].content }}\n{{ messages[1].content }}<|im_end|>\n"
    "{% if documents %}{{ documents | length }} documents\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_Q, _D = words(12, 3), words(16, 4)
_HEAD = f"<|im_start|>user\n{_Q}\n{_D}"


async def test_apply_chat_templates_parameters_in_the_kwargs_render_as_vllm_renders_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "score.jinja"
    path.write_text(TEMPLATE)
    replica = FAST.model_copy(update={"score_template": str(path)})
    policy = "models:\n  default:\n    score_template: " + json.dumps(TEMPLATE) + "\n"
    tok = builtin_tokenizer()
    cases: list[tuple[dict[str, Any], str]] = [
        ({}, f"{_HEAD}<|im_end|>\n"),
        ({"add_generation_prompt": True}, f"{_HEAD}<|im_end|>\n<|im_start|>assistant\n"),
        ({"documents": [{"text": "a"}, {"text": "b"}]}, f"{_HEAD}<|im_end|>\n2 documents\n"),
        ({"continue_final_message": True}, _HEAD),  # cut after the document's text
    ]
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for kwargs, text in cases:
            body = {"query": _Q, "documents": [_D], "chat_template_kwargs": kwargs}
            r = await h.post("/rerank", json=body)
            assert r.status_code == 200, (kwargs, r.text)
            used = r.json()["usage"]["prompt_tokens"]
            d = await st.gw.prepare("rerank", "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == used == len(tok.encode(text)), (kwargs, used)
        # both: transformers' ValueError, vLLM's 400
        both = {"add_generation_prompt": True, "continue_final_message": True}
        body = {"query": _Q, "documents": [_D], "chat_template_kwargs": both}
        r = await h.post("/rerank", json=body)
        assert r.status_code == 400 and "not compatible" in r.text, r.text
        direct = await h.post(f"{st.fleet.endpoints[0].url}/rerank", json=body)
        assert direct.status_code == 400 and "not compatible" in direct.text, direct.text
