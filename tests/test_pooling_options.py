"""Pooling request options the gateway must read as vLLM does before it charges the
budget (review of D29, vLLM 0.33's ``vllm/entrypoints/pooling``): a rerank's ``top_n``
(``RerankRequest.top_n: Field(default=0, ge=0)``), ``padding: "max_length"`` (each engine
request padded to the model's context by ``TokenizeParams.with_kwargs`` /
``_token_padding``), and which form runs when an embeddings body holds both ``input`` and
``messages``. Real simulated replicas and a real gateway on free loopback ports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizerModel

from cachecore.replica.protocol import pair_score
from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import (
    PROBE_PROMPT,
    HFTokenizer,
    builtin_tokenizer,
    truncated_pair,
    with_pair_special_tokens,
)
from tests.test_agent_helpers import counter_total
from tests.test_gateway_support import stack, words
from tests.test_special_tokens import bos_model

CONTEXT = 256
SMALL = ReplicaSettings(time_scale=0.05, max_model_len=CONTEXT)

pytestmark = pytest.mark.timeout(90)


async def test_a_negative_or_malformed_top_n_is_the_gateways_400_before_any_work() -> None:
    """vLLM refuses ``top_n`` < 0 (and what no int is) with a 400 naming it. The gateway
    charged the request's pairs, routed it and relayed the replica's 400 (the charge
    refunded): now it refuses first, naming ``top_n``, with no budget spent or replica
    trip. 0 (every document) and lax ints as vLLM reads them pass."""
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 500}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        docs = [words(20, i) for i in range(3)]
        for top_n in (-1, -100, 1.5, "x", None, [1]):
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                r = await h.post(path, json={"query": "q", "documents": docs, "top_n": top_n})
                assert r.status_code == 400, (top_n, path, r.text)
                assert r.json()["error"]["param"] == "top_n", r.text
        assert counter_total(st.gw.metrics.decisions) == 0  # nothing routed
        for top_n in (0, 2, "2", 2.0, 10):
            r = await h.post("/rerank", json={"query": "q", "documents": docs, "top_n": top_n})
            assert r.status_code == 200, (top_n, r.text)
            want = 3 if top_n in (0, 10) else 2
            assert len(r.json()["results"]) == want, top_n
        assert counter_total(st.gw.metrics.decisions) == 5


async def test_with_both_input_and_messages_the_replica_runs_what_vllm_runs() -> None:
    """vLLM's embeddings, /pooling and /classify requests are unions of a completion form
    (``input``) and a chat form (``messages``), and pydantic's smart union runs the member
    with the most fields set, the keys of each message counting for the chat form: with
    both, the messages run, unless they are empty with no chat-only field set (a tie: the
    first member, the input) or are not chat messages (the chat form fails). The simulated
    replica ran the input whenever one was given. The gateway charges the larger form."""
    msgs = [{"role": "system", "content": words(40, 1)}, {"role": "user", "content": "hi"}]
    async with stack(count=1) as st, st.http() as h:
        replica = st.fleet.endpoints[0].url
        for path in ("/v1/embeddings", "/pooling", "/classify"):
            chat = (await h.post(f"{replica}{path}", json={"messages": msgs})).json()
            text = (await h.post(f"{replica}{path}", json={"input": "a b"})).json()
            assert chat["usage"]["prompt_tokens"] > 40 and text["usage"]["prompt_tokens"] == 2
            cases = [
                ({"input": "a b", "messages": msgs}, chat),
                ({"input": [1, 2], "messages": msgs, "add_generation_prompt": False}, chat),
                ({"input": "a b", "messages": []}, text),
                ({"input": "a b", "messages": [{"content": "no role"}]}, text),
            ]
            for body, want in cases:
                r = await h.post(f"{replica}{path}", json=body)
                assert r.status_code == 200, (path, body, r.text)
                assert r.json()["data"] == want["data"], (path, body)
                assert r.json()["usage"] == want["usage"], (path, body)
            # an empty conversation with a chat-only field set: the chat form runs, and the
            # simulated template refuses an empty conversation
            r = await h.post(
                f"{replica}{path}",
                json={"input": "a b", "messages": [], "add_generation_prompt": True},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            # through the gateway: the engine's answer, charged at least what it ran
            body = {"input": "a b", "messages": msgs}
            r = await h.post(path, json=body)
            assert r.status_code == 200 and r.json()["data"] == chat["data"], r.text
            ep = {"/v1/embeddings": "embeddings"}.get(path, path[1:])
            d = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens >= chat["usage"]["prompt_tokens"]


async def test_padding_to_max_length_is_charged_as_the_padded_prompts_the_engine_runs() -> None:
    """``padding: "max_length"`` (vLLM's pooling requests, every endpoint) pads each engine
    request to the model's context, all of which the engine computes: a one-word input cost
    the budget two tokens and the engine a whole context. Now each engine request is charged
    the context the replicas' cards give (a pair: the larger of a cross-encoder's one per
    pair and an embedding model's one per text); with no card's context it is a 400 naming
    ``padding``, as is a value vLLM refuses; ``do_not_pad`` pads nothing."""
    pad = {"padding": "max_length"}
    bodies: dict[str, tuple[str, dict[str, Any], int, int]] = {
        "embeddings": ("/v1/embeddings", {"input": ["a", "b c"]}, 2, 2),
        "pooling": ("/pooling", {"input": "a"}, 1, 1),
        "classify": ("/classify", {"messages": [{"role": "user", "content": "hi"}]}, 1, 1),
        "score": ("/score", {"text_1": "q", "text_2": ["a", "b"]}, 2, 3),
        "score_v1": ("/v1/score", {"text_1": ["q", "r"], "text_2": ["a", "b"]}, 2, 4),
        "rerank_v2": ("/v2/rerank", {"query": "q", "documents": ["a", "b", "c"]}, 3, 4),
    }
    async with stack(count=1, replica=SMALL) as st, st.http() as h:
        for ep, (path, body, engine_runs, charged) in bodies.items():
            r = await h.post(path, json={**body, **pad})
            assert r.status_code == 200, (path, r.text)
            assert r.json()["usage"]["prompt_tokens"] == engine_runs * CONTEXT, path
            d = await st.gw.prepare(ep, "anonymous", {**body, **pad}, {}, "x", True)
            assert d.prompt_tokens == charged * CONTEXT, ep
            plain = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
            off = await st.gw.prepare(
                ep, "anonymous", {**body, "padding": "do_not_pad"}, {}, "x", True
            )
            assert off.prompt_tokens == plain.prompt_tokens < CONTEXT, ep
        routed = counter_total(st.gw.metrics.decisions)
        for bad in ("longest", True, 1, "MAX_LENGTH"):
            r = await h.post("/pooling", json={"input": "a", "padding": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "padding", r.text
        assert st.gw.pool is not None
        for rep in st.gw.pool.all():
            for card in rep.cards.values():
                card.pop("max_model_len", None)
        r = await h.post("/classify", json={"input": "a", **pad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "padding", r.text
        assert counter_total(st.gw.metrics.decisions) == routed  # refused before routing
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 400}"
    async with stack(count=1, replica=SMALL, policy=policy) as st, st.http() as h:
        r = await h.post("/v1/embeddings", json={"input": "a", **pad})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == CONTEXT, r.text
        r = await h.post("/v1/embeddings", json={"input": "a", **pad})
        assert r.status_code == 429 and r.json()["error"]["limit"] == "uncached_tokens", r.text


async def test_a_score_is_charged_as_cross_encoder_pairs_or_embedded_texts_the_larger(
    tmp_path: Path,
) -> None:
    """vLLM 0.33 scores with an embedding model (``BiEncoderIOProcessor``) by embedding
    each text as its own engine request, its special tokens added and truncated alone; a
    cross-encoder runs one prompt per pair. The gateway charged the pair: with
    ``truncate_prompt_tokens`` k, min(a + b, k) for up to min(a, k) + min(b, k) computed,
    and an N:N score one special token per pair short behind a BOS tokenizer. It cannot
    tell the model type: the larger of the two is charged."""
    t = {"truncate_prompt_tokens": 10}
    a, b, c, d = (words(30, i) for i in range(4))
    cases: dict[str, tuple[str, dict[str, Any], int]] = {
        # cross: one pair of 10; embedding: two texts of 10
        "1:1": ("score", {"text_1": a, "text_2": b, **t}, 20),
        "N:N": ("score", {"text_1": [a, b], "text_2": [c, d], **t}, 40),
        "1:N list": ("score", {"text_1": [a], "text_2": [b, c], **t}, 30),
        "rerank": ("rerank", {"query": a, "documents": [b, c], **t}, 30),
        # untruncated 1:N: the cross-encoder's pairs repeat the query, the larger
        "1:N": ("score", {"text_1": words(20, 5), "text_2": [words(5, i) for i in range(3)]}, 75),
    }
    async with stack(count=1, replica=SMALL) as st, st.http() as h:
        for name, (ep, body, charged) in cases.items():
            got = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
            assert got.prompt_tokens == charged, (name, got.prompt_tokens)
            r = await h.post(f"/{ep}", json=body)  # the simulated cross-encoder: within it
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] <= charged, name
    # behind a tokenizer that adds a BOS to each sequence, N:N untruncated: a pair is
    # BOS a b (11 tokens), the embedding model's texts BOS a and BOS b (12)
    model = str(bos_model(tmp_path))
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=model)
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        body = {"text_1": [words(5, 1), words(5, 2)], "text_2": [words(5, 3), words(5, 4)]}
        r = await h.post("/score", json=body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 22, r.text
        got = await st.gw.prepare("score", "anonymous", dict(body), {}, "x", True)
        assert got.prompt_tokens == 24


def roberta_pairs_model(directory: Path) -> Path:
    """The built-in tokenizer as an HF model directory with RoBERTa's templates (``<s>``
    and ``</s>`` both the built-in's id 0 here): one sequence ``<s> A </s>`` (2 special
    tokens), a pair ``<s> A </s></s> B </s>`` (4)."""
    bos_model(directory)
    tj = directory / "tokenizer.json"
    data = json.loads(tj.read_text())
    s = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    a, b = ({"Sequence": {"id": x, "type_id": 0}} for x in "AB")
    data["post_processor"] |= {"single": [s, a, s], "pair": [s, a, s, s, b, s]}
    tj.write_text(json.dumps(data))
    return directory


async def test_a_cross_encoder_pair_is_charged_its_pair_templates_special_tokens(
    tmp_path: Path,
) -> None:
    """vLLM 0.33's cross-encoder scoring tokenizes each pair as ``tokenizer(text_1,
    text_pair=text_2)`` (``scoring/io_processor.py``), which adds the pair template's
    special tokens: RoBERTa's 4 where one sequence gets 2. The gateway added one
    sequence's, 2 tokens short per pair (a 1:N score of three pairs charged 81 for 87)."""
    model = roberta_pairs_model(tmp_path)
    tok = HFTokenizer.from_dir(model)
    assert tok.special_affixes == ((0,), (0,)) and tok.pair_special_tokens == 4
    q, doc = words(20, 5), words(5, 0)
    paired = tok._tok.encode(q, doc, add_special_tokens=True).ids  # what vLLM runs
    assert len(paired) == len(tok.encode(q)) + len(tok.encode(doc)) + 4
    assert builtin_tokenizer().pair_special_tokens == 0
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=str(model))
    docs = [words(5, i) for i in range(3)]
    cases = {
        # pairs 3 x (20 + 5 + 4); embedded texts 22 + 3 x 7 = 43
        "score": {"text_1": q, "text_2": docs},
        "rerank": {"query": q, "documents": docs},
    }
    async with stack(count=1, replica=replica, policy=policy) as st:
        for ep, body in cases.items():
            got = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
            assert got.prompt_tokens == 87, (ep, got.prompt_tokens)


def _bert_pairs_model(directory: Path) -> Path:
    """The built-in tokenizer as an HF model directory with BERT's templates, ``[CLS]``
    and ``[SEP]`` distinct ids (the built-in's ``<|im_start|>`` and ``<|im_end|>``): one
    sequence ``[CLS] A [SEP]``, a pair ``[CLS] A [SEP] B [SEP]``."""
    roberta_pairs_model(directory)
    tj = directory / "tokenizer.json"
    data = json.loads(tj.read_text())
    cls, sep = ({"SpecialToken": {"id": x, "type_id": 0}} for x in ("[CLS]", "[SEP]"))
    a, b = ({"Sequence": {"id": x, "type_id": 0}} for x in "AB")
    data["post_processor"] |= {
        "single": [cls, a, sep],
        "pair": [cls, a, sep, b, sep],
        "special_tokens": {
            "[CLS]": {"id": "[CLS]", "ids": [1], "tokens": ["<|im_start|>"]},
            "[SEP]": {"id": "[SEP]", "ids": [2], "tokens": ["<|im_end|>"]},
        },
    }
    tj.write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize("layout", ["roberta", "bert"])
def test_a_pair_is_laid_out_as_the_tokenizers_pair_template(tmp_path: Path, layout: str) -> None:
    """The replica's pair prompt is the ids vLLM 0.33's ``tokenizer(text_1,
    text_pair=text_2)`` gives (``get_score_prompt``): the pair template's special tokens
    before, between and after the texts, in its order."""
    make = roberta_pairs_model if layout == "roberta" else _bert_pairs_model
    tok = HFTokenizer.from_dir(make(tmp_path))
    want = {"roberta": ((0,), (0, 0), (0,)), "bert": ((1,), (2,), (2,))}[layout]
    assert tok.pair_affixes == want and tok.pair_special_tokens == sum(map(len, want))
    for q, doc in ((words(20, 5), words(5, 0)), ("a", "b"), (PROBE_PROMPT, "")):
        paired = tok._tok.encode(q, doc, add_special_tokens=True).ids  # what vLLM runs
        assert with_pair_special_tokens(tok, tok.encode(q), tok.encode(doc)) == paired
    assert builtin_tokenizer().pair_affixes == ((), (), ())


async def test_the_replica_runs_a_pair_as_the_gateway_charges_it(tmp_path: Path) -> None:
    """The simulated cross-encoder ran a pair with one sequence's special tokens around
    both texts (RoBERTa's ``<s> a b </s>``, 2), where vLLM 0.33 and the gateway's charge
    have the pair template's (``<s> a </s></s> b </s>``, 4): its reported usage was 2
    tokens per pair below the charge (81 for 87). Now the two agree."""
    model = roberta_pairs_model(tmp_path)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=str(model))
    q, docs = words(20, 5), [words(5, i) for i in range(3)]
    cases: dict[str, dict[str, Any]] = {
        "score": {"text_1": q, "text_2": docs},
        "rerank": {"query": q, "documents": docs},
        "score N:N": {"text_1": docs, "text_2": [q] * 3},
    }
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        for name, body in cases.items():
            ep = name.split()[0]
            got = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
            r = await h.post(f"/{ep}", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == got.prompt_tokens == 87, name


def _hf_pair_truncation(model: Path, first: str, second: str, keep: int) -> list[int]:
    """What vLLM 0.33 runs for a pair under ``truncate_prompt_tokens`` ``keep``: the HF
    tokenizer's ``longest_first`` truncation from the right (a pooling model's tokenizer),
    then its token truncation, which keeps the first ``keep`` ids when the tokenizer could
    not cut that far (``keep`` below the pair's special tokens)."""
    hf = HFTokenizerModel.from_file(str(model / "tokenizer.json"))
    hf.enable_truncation(keep, strategy="longest_first", direction="right")
    return hf.encode(first, second, add_special_tokens=True).ids[:keep]


@pytest.mark.parametrize("layout", ["roberta", "bert"])
def test_a_truncated_pair_is_laid_out_as_the_tokenizers_longest_first(
    tmp_path: Path, layout: str
) -> None:
    """vLLM 0.33's ``get_score_prompt`` tokenizes a pair with ``truncation=True``: HF's
    ``longest_first``, which shortens the longer text first, each text from its end, the
    special tokens kept. The replica kept the pair's last tokens: the same count, other
    ids (another prefix for the replica's cache). ``truncated_pair`` is the tokenizer's."""
    make = roberta_pairs_model if layout == "roberta" else _bert_pairs_model
    model = make(tmp_path)
    tok = HFTokenizer.from_dir(model)
    texts = [words(n, n) for n in (0, 1, 3, 7, 12)]
    for a in texts:
        for b in texts:
            ids_a, ids_b = tok.encode(a), tok.encode(b)
            for keep in range(1, len(ids_a) + len(ids_b) + 7):
                got = truncated_pair(tok, ids_a, ids_b, keep)
                assert got == _hf_pair_truncation(model, a, b, keep), (a, b, keep)
                assert len(got) == min(len(ids_a) + len(ids_b) + tok.pair_special_tokens, keep)


async def test_the_replica_scores_a_truncated_pair_as_the_engine_tokenizes_it(
    tmp_path: Path,
) -> None:
    """The replica runs a truncated pair as vLLM's tokenizer lays it out (its score is a
    digest of the ids it ran), a rerank's and a score's alike."""
    model = _bert_pairs_model(tmp_path)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=str(model))
    q, docs = words(12, 5), [words(4, 1), words(30, 2)]
    keep = 20
    ran = [_hf_pair_truncation(model, q, d, keep) for d in docs]
    want = [pair_score(ids) for ids in ran]
    async with stack(count=1, replica=replica, policy=policy) as st, st.http() as h:
        body = {"text_1": q, "text_2": docs, "truncate_prompt_tokens": keep}
        r = await h.post("/score", json=body)
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == want
        assert r.json()["usage"]["prompt_tokens"] == sum(map(len, ran))
        assert len(ran[1]) == keep  # the long document's pair truncated
        body = {"query": q, "documents": docs, "truncate_prompt_tokens": keep}
        r = await h.post("/rerank", json=body)
        assert r.status_code == 200, r.text
        assert {d["index"]: d["relevance_score"] for d in r.json()["results"]} == dict(
            enumerate(want)
        )


async def test_a_truncated_pooling_prompt_keeps_what_vllms_pooling_tokenizer_keeps(
    tmp_path: Path,
) -> None:
    """vLLM 0.33 truncates a pooling prompt with its tokenizer, which it loads for a
    pooling model with ``truncation_side="right"``: an input's *first* k tokens, the
    special tokens added around a text kept; with a request's ``truncation_side`` it
    slices the whole prompt from that side (special tokens included), a pair too. The
    replica kept the last tokens and read no ``truncation_side``. Each truncated request
    embeds (scores) as the untruncated ids vLLM runs."""
    model = _bert_pairs_model(tmp_path)
    hf = HFTokenizerModel.from_file(str(model / "tokenizer.json"))
    replica = ReplicaSettings(time_scale=0.05, tokenizer_dir=str(model))
    text, keep = words(12, 7), 6
    whole = hf.encode(text).ids
    hf.enable_truncation(keep, direction="right")
    first = hf.encode(text).ids  # [CLS] ... [SEP]: the tokenizer keeps its special tokens
    assert first[-1] == whole[-1] and first[:-1] == whole[: keep - 1]
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    cases: list[tuple[dict[str, Any], list[int]]] = [
        ({"input": text}, first),
        ({"input": text, "truncation_side": "right"}, whole[:keep]),
        ({"input": text, "truncation_side": "left"}, whole[-keep:]),
        ({"input": ids}, ids[:keep]),
        ({"input": ids, "truncation_side": "left"}, ids[-keep:]),
    ]
    async with stack(count=1, replica=replica) as st, st.http() as h:

        async def embedding(body: dict[str, Any]) -> Any:
            r = await h.post("/v1/embeddings", json={"model": st.model, **body})
            assert r.status_code == 200, r.text
            return r.json()["data"][0]["embedding"]

        for body, want in cases:
            got = await embedding({**body, "truncate_prompt_tokens": keep})
            assert got == await embedding({"input": want}), body
        # a pair with a truncation_side: the whole pair sliced from that side
        q, doc = words(5, 1), words(9, 2)
        hf.no_truncation()
        paired_ids = hf.encode(q, doc).ids
        for side, want in (("left", paired_ids[-keep:]), ("right", paired_ids[:keep])):
            body = {"text_1": q, "text_2": doc, "truncate_prompt_tokens": keep}
            r = await h.post("/score", json={**body, "truncation_side": side})
            assert r.status_code == 200, r.text
            assert r.json()["data"][0]["score"] == pair_score(want), side
        r = await h.post("/v1/embeddings", json={"input": "a", "truncation_side": "up"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"
