"""/score and /rerank fields kvgate ignored where vLLM 0.33 acts on them (H187).

``max_tokens_per_query`` / ``max_tokens_per_doc`` (``pooling/scoring/protocol.py``
``ScoringRequestMixin``): ``CrossEncoderIOProcessor.get_score_prompt`` cuts the query and
each document to that many tokens (``scoring/utils.py`` ``truncate_text_to_tokens``, by
the tokens' character offsets) before pairing or templating, and with a document limit
asks the tokenizer for ``truncation="only_second"`` at ``min(query + limit + the pair's
special tokens, truncate_prompt_tokens)``; an embedding model's scoring cuts each text
alike (``_truncate_scoring_data``); a negative limit or one at the context is a 400 with
no param (``_validate_token_limit``). kvgate read neither: it charged and ran the whole
texts.

A score template's ``chat_template_kwargs`` that transformers 5 refuses (vLLM 0.33's
``safe_apply_chat_template`` passes those ``resolve_chat_template_kwargs`` lets through:
apply_chat_template's parameters and what the template reads): ``messages`` collides
with the conversation the template is rendered with, ``conversation`` with
apply_chat_template's own argument, an assistant mask needs tokenizing, documents must
be objects. vLLM answers each a 400 with the exception's text and no param; kvgate
rendered them. Here vLLM's rules are rebuilt from its code with HF ``tokenizers``
itself, not through kvgate's functions."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizerModel

from cachecore.engine.core import DEFAULT_MAX_MODEL_LEN
from cachecore.replica.protocol import pair_score
from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import builtin_tokenizer
from gateway.errors import GatewayError
from tests.test_gateway_support import FAST, stack, words
from tests.test_h175_score_template import QWEN3_RERANKER, _policy, _qwen3_prompt
from tests.test_pooling_options import _bert_pairs_model

pytestmark = pytest.mark.timeout(120)

# route, endpoint, body, its pairs, its texts one by one, each text's limit
_Case = tuple[str, str, dict[str, Any], list[tuple[str, str]], list[str], list[int]]


def _vllm_truncate_text(hf: HFTokenizerModel, text: str, max_tokens: int) -> str:
    """vLLM 0.33's ``truncate_text_to_tokens``, on HF ``tokenizers`` directly."""
    if max_tokens <= 0:
        return ""
    while text:
        enc = hf.encode(text, add_special_tokens=False)
        if len(enc.ids) <= max_tokens:
            break
        char_end = min(enc.offsets[max_tokens - 1][1], enc.offsets[max_tokens][0])
        if char_end >= len(text):
            char_end = len(text) - 1
        text = text[:char_end]
    return text


def _vllm_pair(
    hf_path: Path, q: str, d: str, per_query: int, per_doc: int, keep: int | None
) -> list[int]:
    """The ids vLLM 0.33's cross-encoder runs for one pair (``get_score_prompt`` then
    ``apply_post_tokenization``), a pooling tokenizer truncating from the right."""
    hf = HFTokenizerModel.from_file(str(hf_path))
    if per_query > 0:
        q = _vllm_truncate_text(hf, q, per_query)
    if per_doc > 0:
        d = _vllm_truncate_text(hf, d, per_doc)
    if keep is not None:
        strategy, length = "longest_first", keep
        if per_doc > 0:
            special = hf.post_processor.num_special_tokens_to_add(True)
            qt = len(hf.encode(q, add_special_tokens=False).ids)
            effective = min(qt + per_doc + special, keep)
            if qt + special < effective:
                strategy, length = "only_second", effective
        hf.enable_truncation(length, strategy=strategy, direction="right")
    ids = hf.encode(q, d, add_special_tokens=True).ids
    return ids if keep is None else ids[:keep]


def _vllm_texts(hf_path: Path, texts: list[str], limits: list[int], keep: int | None) -> int:
    """What vLLM 0.33's embedding-model scoring runs: each text cut by its side's limit,
    then its own prompt with the special tokens, truncated alone."""
    hf = HFTokenizerModel.from_file(str(hf_path))
    total = 0
    for text, limit in zip(texts, limits, strict=True):
        if limit > 0:
            text = _vllm_truncate_text(hf, text, limit)
        n = len(hf.encode(text, add_special_tokens=True).ids)
        total += n if keep is None else min(n, keep)
    return total


def test_a_text_is_cut_as_vllms_truncate_text_to_tokens() -> None:
    from cachecore.tokenizer import truncate_text_to_tokens  # new: the others run without

    tok = builtin_tokenizer()
    hf = HFTokenizerModel.from_file(
        str(Path(__file__).parents[1] / "cachecore/data/tokenizer.json")
    )
    rng = random.Random(7)
    alphabet = "ab cdé,.'!?-é日本 \n12"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(60)]
    texts += [words(25, 3), "Qu'est-ce que c'est? naïve café 123456"]
    for text in texts:
        for k in range(0, 14):
            assert truncate_text_to_tokens(tok, text, k) == _vllm_truncate_text(hf, text, k)


async def test_the_limits_cut_what_is_charged_and_run_as_vllm_cuts_them(tmp_path: Path) -> None:
    """A BERT-style cross-encoder (3 pair special tokens): each endpoint, with each
    limit, and with ``truncate_prompt_tokens`` both where the document alone is cut
    (``only_second``) and where the query fills it (``longest_first``). The replica's
    scores are digests of the ids vLLM runs, its usage their count; the gateway charges
    the larger of that and the embedding model's per-text reading, both vLLM's."""
    model = _bert_pairs_model(tmp_path)
    hf_path = model / "tokenizer.json"
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=str(model))
    q, docs = words(20, 5), [words(30, 1), words(4, 2), words(12, 3)]
    limits: list[tuple[int, int, int | None]] = [
        (6, 8, None), (6, 0, None), (0, 8, None), (6, 8, 15), (6, 8, 8), (0, 5, 40), (25, 40, None),
    ]  # fmt: skip
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for mq, md, keep in limits:
            opts: dict[str, Any] = {"max_tokens_per_query": mq, "max_tokens_per_doc": md}
            if keep is not None:
                opts["truncate_prompt_tokens"] = keep
            cases: list[_Case] = [
                ("/score", "score", {"text_1": q, "text_2": docs}, [(q, d) for d in docs],
                 [q, *docs], [mq] + [md] * 3),
                ("/v1/rerank", "rerank_v1", {"query": q, "documents": docs},
                 [(q, d) for d in docs], [q, *docs], [mq] + [md] * 3),
                ("/v1/score", "score_v1", {"text_1": docs[:2], "text_2": [q, docs[2]]},
                 [(docs[0], q), (docs[1], docs[2])], [*docs[:2], q, docs[2]], [mq, mq, md, md]),
            ]  # fmt: skip
            for route, name, body, pairs, texts, sides in cases:
                body = {**body, **opts}
                ran = [_vllm_pair(hf_path, a, b, mq, md, keep) for a, b in pairs]
                cross = sum(map(len, ran))
                per_text = _vllm_texts(hf_path, texts, sides, keep)
                r = await h.post(route, json=body)
                assert r.status_code == 200, (route, r.text)
                got = r.json()
                assert got["usage"]["prompt_tokens"] == cross, (route, mq, md, keep)
                if "data" in got:
                    assert [x["score"] for x in got["data"]] == [pair_score(i) for i in ran]
                else:
                    scores = {x["index"]: x["relevance_score"] for x in got["results"]}
                    assert scores == {i: pair_score(ids) for i, ids in enumerate(ran)}
                d = await st.gw.prepare(name, "anonymous", dict(body), {}, "x", True)
                assert d.prompt_tokens == max(cross, per_text), (route, mq, md, keep)
                if cross >= per_text:
                    assert d.prompt_tokens == got["usage"]["prompt_tokens"]


async def test_a_templated_pair_is_rendered_from_the_cut_texts(tmp_path: Path) -> None:
    """With a score template the texts are cut before rendering: the charge is the
    replica's usage, the Qwen3 prompts of the cut texts built apart."""
    path = tmp_path / "qwen3_reranker.jinja"
    path.write_text(QWEN3_RERANKER)
    replica = FAST.model_copy(update={"score_template": str(path)})
    tok = builtin_tokenizer()
    hf = HFTokenizerModel.from_file(
        str(Path(__file__).parents[1] / "cachecore/data/tokenizer.json")
    )
    q, docs = words(20, 3), [words(24, 4), words(30, 5), words(3, 6)]
    async with stack(count=1, replica=replica, policy=_policy()) as st, st.http() as h:
        for mq, md in ((5, 7), (0, 10), (9, 0)):
            body = {"query": q, "documents": docs, "max_tokens_per_query": mq,
                    "max_tokens_per_doc": md}  # fmt: skip
            cq = _vllm_truncate_text(hf, q, mq) if mq else q
            want = sum(
                len(tok.encode(_qwen3_prompt(cq, _vllm_truncate_text(hf, d, md) if md else d)))
                for d in docs
            )
            r = await h.post("/v2/rerank", json=body)
            assert r.status_code == 200, r.text
            used = r.json()["usage"]["prompt_tokens"]
            d = await st.gw.prepare("rerank_v2", "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens == used == want, (mq, md, d.prompt_tokens, used, want)


async def test_what_vllm_refuses_is_the_same_400_at_the_gateway_and_the_replica(
    tmp_path: Path,
) -> None:
    """Each refusal: the gateway's 400 from ``prepare`` (before routing or any charge)
    and the replica's, the same message and param (null where vLLM names none)."""
    path = tmp_path / "qwen3_reranker.jinja"
    path.write_text(QWEN3_RERANKER)
    replica = FAST.model_copy(update={"score_template": str(path)})
    mml = DEFAULT_MAX_MODEL_LEN
    render = "jinja2.environment.Template.render() got multiple values for keyword argument"
    # get_score_prompt splats the kwargs into safe_apply_chat_template, whose positional
    # arguments Python binds first (H191): its TypeError, for a key no filter drops
    apply = "safe_apply_chat_template() got multiple values for argument 'conversation'"
    held = "safe_apply_chat_template() got multiple values for argument 'tokenizer'"
    docs_msg = "Documents should be a list of dicts with 'title' and 'text' keys!"
    reserved = "chat_template_kwargs contains reserved keys that conflict with fixed scorer"
    bad: list[tuple[dict[str, Any], str, str | None]] = [
        ({"chat_template_kwargs": {"messages": [{"role": "user", "content": "x"}]}},
         f"{render} 'messages'", None),
        ({"chat_template_kwargs": {"conversation": []}}, apply, None),
        ({"chat_template_kwargs": {"tokenizer": 1}}, held, None),
        ({"chat_template_kwargs": {"return_assistant_tokens_mask": True}},
         "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`",
         None),
        ({"chat_template_kwargs": {"documents": ["a"]}}, docs_msg, None),
        ({"chat_template_kwargs": {"documents": 3}}, "'int' object is not iterable", None),
        ({"chat_template_kwargs": {"tokenize": True}}, f"{reserved} arguments: {{'tokenize'}}",
         None),
        ({"max_tokens_per_query": -1}, "max_tokens_per_query must be a non-negative integer",
         None),
        ({"max_tokens_per_doc": mml},
         f"max_tokens_per_doc ({mml}) must be less than max_model_len ({mml}).", None),
    ]  # fmt: skip
    q, docs = words(8, 1), [words(9, 2), words(5, 3)]
    async with stack(count=1, replica=replica, policy=_policy()) as st, st.http() as h:
        url = st.fleet.endpoints[0].url
        for extra, message, param in bad:
            body = {"query": q, "documents": docs, **extra}
            with pytest.raises(GatewayError) as refused:
                await st.gw.prepare("rerank", "anonymous", dict(body), {}, "x", True)
            assert refused.value.status == 400 and str(refused.value.message) == message, extra
            r = await h.post("/rerank", json=body)
            direct = await h.post(f"{url}/rerank", json=body)
            for got in (r, direct):
                assert got.status_code == 400, (extra, got.text)
                err = got.json()["error"]
                assert (err["message"], err["param"]) == (message, param), (extra, got.text)
        # a key the template does not read and apply_chat_template does not take is
        # dropped (vLLM's resolve_chat_template_kwargs): rendered, charged as run
        body = {"query": q, "documents": docs, "chat_template_kwargs": {"foo": [1]}}
        r = await h.post("/rerank", json=body)
        assert r.status_code == 200, r.text
        d = await st.gw.prepare("rerank", "anonymous", dict(body), {}, "x", True)
        assert d.prompt_tokens == r.json()["usage"]["prompt_tokens"]
        # a limit of another type: pydantic's 400 naming the field, at both
        body = {"query": q, "documents": docs, "max_tokens_per_doc": "many"}
        for target in ("/rerank", f"{url}/rerank"):
            got = await h.post(target, json=body)
            assert got.status_code == 400 and got.json()["error"]["param"] == "max_tokens_per_doc"


async def test_without_a_template_the_fields_are_typed_before_any_charge() -> None:
    """With no score template vLLM renders no kwargs (a reserved key runs), but its
    request model still types ``chat_template_kwargs`` and ``instruction``: the
    gateway's 400 naming the field before routing, as the replica's; the gateway
    charged such a request and refunded it on the engine's 400."""
    q, docs = words(8, 1), [words(9, 2)]
    async with stack(count=1) as st, st.http() as h:
        url = st.fleet.endpoints[0].url
        for extra, param in (({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                             ({"instruction": 3}, "instruction")):  # fmt: skip
            body = {"query": q, "documents": docs, **extra}
            with pytest.raises(GatewayError) as refused:
                await st.gw.prepare("rerank", "anonymous", dict(body), {}, "x", True)
            assert (refused.value.status, refused.value.param) == (400, param)
            direct = await h.post(f"{url}/rerank", json=body)
            assert direct.status_code == 400 and direct.json()["error"]["param"] == param
        body = {"query": q, "documents": docs, "chat_template_kwargs": {"tokenize": True}}
        r = await h.post("/rerank", json=body)
        assert r.status_code == 200, r.text
