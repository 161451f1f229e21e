"""A cross-encoder whose /score and /rerank pairs a score template wraps (H175). vLLM
0.33's ``CrossEncoderIOProcessor.get_score_prompt`` (``pooling/scoring/io_processor.py``)
renders each pair, with a chat template (the server's ``--chat-template``, or the one a
Sentence Transformers config names), as ``[{role: query}, {role: document}]`` and
tokenizes the text with the special tokens added; Qwen3 rerankers are served so (the
model's prompt: a system prompt and an instruction around the query and the document).
The gateway charged such a pair as the tokenizer's pair template (its special tokens
only), some 110 tokens short per pair here (136 charged for the three pairs of a
/score the replica ran as 466). With the pool's ``score_template`` it charges
the template's rendering, what the simulated replica (``score_template``) runs.

The template below renders Qwen3-Reranker's prompt format, written here from the format
its model card and vLLM's ``examples/pooling/score/template/qwen3_reranker.jinja``
(vllm-project/vllm 5d6a1c2) give: the same text for a query, a document and an
``instruction`` (checked against that file's text while writing this); the expected
prompts are built with an f-string, not the template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cachecore.tokenizer import builtin_tokenizer
from policies.schema import PolicyError, parse_policy_text
from tests.test_gateway_support import FAST, stack, words

pytestmark = pytest.mark.timeout(90)

_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".'
)
_DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_RERANKER = (
    "<|im_start|>system\n" + _SYSTEM + "<|im_end|>\n<|im_start|>user\n"
    '<Instruct>: {{ instruction | default("' + _DEFAULT_INSTRUCTION + '", true) }}\n'
    '{% for m in messages if m.role == "query" %}<Query>: {{ m.content }}\n{% endfor %}'
    '{% for m in messages if m.role == "document" %}<Document>: {{ m.content }}{% endfor %}'
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def _qwen3_prompt(query: str, doc: str, instruction: str = _DEFAULT_INSTRUCTION) -> str:
    """Qwen3-Reranker's prompt for one pair, as its model card formats it and vLLM runs
    it: transformers' Jinja environment (``keep_trailing_newline`` off) drops the
    template's final newline, so the prompt ends ``</think>\n``."""
    return (
        f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n"
        f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n"
    )


def _policy() -> str:
    return "models:\n  default:\n    score_template: " + json.dumps(QWEN3_RERANKER) + "\n"


_Q, _DOCS = words(20, 3), [words(24, 4), words(30, 5), words(22, 6)]
_BODIES: list[tuple[str, str, dict[str, Any], list[tuple[str, str]]]] = [
    ("/score", "score", {"text_1": _Q, "text_2": _DOCS}, [(_Q, d) for d in _DOCS]),
    (
        "/v1/score",
        "score_v1",
        {"text_1": [_Q, _DOCS[2]], "text_2": _DOCS[:2]},
        [(_Q, _DOCS[0]), (_DOCS[2], _DOCS[1])],
    ),
    ("/rerank", "rerank", {"query": _Q, "documents": _DOCS}, [(_Q, d) for d in _DOCS]),
    (
        "/v2/rerank",
        "rerank_v2",
        {"query": _Q, "documents": _DOCS, "instruction": "Find the recipe"},
        [(_Q, d) for d in _DOCS],
    ),
    (
        "/v1/rerank",
        "rerank_v1",
        {"query": _Q, "documents": _DOCS, "chat_template_kwargs": {"instruction": "Rank it"}},
        [(_Q, d) for d in _DOCS],
    ),
]


async def test_a_templated_pair_is_charged_what_the_replica_runs(tmp_path: Path) -> None:
    """Each endpoint's charge is the replica's usage, and both are the Qwen3 prompts'
    tokens (built apart from the template); without the template each pair is ~50
    tokens less (what the gateway charged)."""
    path = tmp_path / "qwen3_reranker.jinja"
    path.write_text(QWEN3_RERANKER)
    replica = FAST.model_copy(update={"score_template": str(path)})
    tok = builtin_tokenizer()
    async with stack(count=1, replica=replica, policy=_policy()) as st, st.http() as h:
        for route, name, body, pairs in _BODIES:
            instruction = body.get("chat_template_kwargs", {}).get("instruction")
            instruction = instruction or body.get("instruction") or _DEFAULT_INSTRUCTION
            want = sum(len(tok.encode(_qwen3_prompt(q, d, instruction))) for q, d in pairs)
            r = await h.post(route, json=body)
            assert r.status_code == 200, (route, r.text)
            used = r.json()["usage"]["prompt_tokens"]
            d = await st.gw.prepare(name, "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == used == want, (route, d.prompt_tokens, used, want)
            plain = sum(len(tok.encode(q)) + len(tok.encode(x)) for q, x in pairs)
            assert used - plain >= 50 * len(pairs), route
            # truncated, each pair keeps its first k tokens: min(size, k) each
            cut = {**body, "truncate_prompt_tokens": 70}
            r = await h.post(route, json=cut)
            assert r.status_code == 200, (route, r.text)
            d = await st.gw.prepare(name, "anonymous", cut, {}, "x", True)
            assert d.prompt_tokens == r.json()["usage"]["prompt_tokens"] == 70 * len(pairs)


async def test_what_vllms_scorer_refuses_is_a_400_naming_the_field(tmp_path: Path) -> None:
    """A reserved ``chat_template_kwargs`` key (vLLM's ``get_score_prompt`` refuses
    ``chat_template``, ``tools``, ``tokenize``) or an ``instruction`` that is no string:
    the gateway's 400 before routing, and the replica's."""
    path = tmp_path / "qwen3_reranker.jinja"
    path.write_text(QWEN3_RERANKER)
    replica = FAST.model_copy(update={"score_template": str(path)})
    async with stack(count=1, replica=replica, policy=_policy()) as st, st.http() as h:
        bad: list[tuple[dict[str, Any], str | None]] = [
            # vLLM's ValueError names no field (H187)
            ({"chat_template_kwargs": {"tokenize": True}}, None),
            ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
            ({"instruction": 3}, "instruction"),
        ]
        for extra, param in bad:
            body = {"query": _Q, "documents": _DOCS, **extra}
            r = await h.post("/rerank", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            url = st.fleet.endpoints[0].url
            direct = await h.post(f"{url}/rerank", json=body)
            assert direct.status_code == 400, direct.text
            assert direct.json()["error"]["param"] == param, direct.text


def test_a_score_template_that_does_not_compile_refuses_the_policy() -> None:
    with pytest.raises(PolicyError, match="score_template"):
        parse_policy_text("models:\n  default:\n    score_template: '{% for %}'\n")
    with pytest.raises(PolicyError, match="score_template"):
        parse_policy_text("models:\n  default:\n    score_template: ' '\n")
    pool = parse_policy_text(_policy()).models.default
    assert pool.score_template == QWEN3_RERANKER
