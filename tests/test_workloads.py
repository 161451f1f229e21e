from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from cachecore.tokenizer import HFTokenizer, builtin_tokenizer
from loadtest.simulate import scaled_workload
from loadtest.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    WORKLOADS,
    TextSource,
    TraceError,
    azure_rows,
    build,
)

_MC_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
_AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return builtin_tokenizer()


@pytest.fixture(scope="module")
def text(tok: HFTokenizer) -> TextSource:
    return TextSource(tok.word_vocabulary)


def test_text_blocks_have_exact_token_counts_and_are_deterministic(
    tok: HFTokenizer, text: TextSource
) -> None:
    for n in (1, 17, 512, 2048):
        block = text.block(f"b{n}", n)
        assert len(tok.encode(block)) == n
        assert TextSource(tok.word_vocabulary).block(f"b{n}", n) == block
    assert text.block("x", 64) != text.block("y", 64)


def test_shared_prefix_groups_share_exact_prefixes(tok: HFTokenizer, text: TextSource) -> None:
    w = build(
        "shared-prefix", text, groups=3, prompts_per_group=4, system_tokens=256, question_tokens=16
    )
    assert len(w.items) == 12
    assert [it.t for it in w.items] == sorted(it.t for it in w.items)
    by_group: dict[str, list[list[int]]] = {}
    for it in w.items:
        assert it.messages is not None
        by_group.setdefault(it.group or "", []).append(tok.encode_chat(list(it.messages)))
    for prompts in by_group.values():
        head = prompts[0][:256]
        assert all(p[:256] == head for p in prompts)
    heads = {tuple(p[0][:256]) for p in by_group.values()}
    assert len(heads) == 3


def test_mooncake_lengths_and_hash_id_sharing(tok: HFTokenizer, text: TextSource) -> None:
    w = build("mooncake", text, max_requests=40)
    rows = w.items
    assert len(rows) == 40
    first = tok.encode(rows[0].prompt or "")
    assert len(first) == 40160  # the trace's input_length
    # equal first hash ids -> equal first 512 tokens
    groups: dict[str, list[int]] = {}
    for it in rows:
        ids = tok.encode(it.prompt or "")[:MOONCAKE_BLOCK_TOKENS]
        if it.group in groups:
            assert groups[it.group] == ids
        groups.setdefault(it.group or "", ids)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_builds(name: str, text: TextSource) -> None:
    kw = {"max_requests": 20} if name in ("mooncake", "azure-conv", "azure-code") else {}
    w = build(name, text, **kw)
    assert w.items and w.items[0].t == 0.0
    assert all(a.t <= b.t for a, b in zip(w.items, w.items[1:], strict=False))
    body = w.items[0].body("m", stream=True)
    assert body["stream_options"] == {"include_usage": True}
    assert ("messages" in body) != ("prompt" in body)


def test_unknown_workload() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build("nope")


def test_sample_groups_takes_whole_groups_in_trace_order(text: TextSource) -> None:
    w = build("mooncake", text, max_requests=600, max_input_tokens=1024)
    s = w.sample_groups(60, seed=3)
    assert len(s.items) == 60
    assert [it.t for it in s.items] == sorted(it.t for it in s.items)
    picked = {it.group for it in s.items}
    count = {g: sum(it.group == g for it in w.items) for g in picked}
    kept = {g: sum(it.group == g for it in s.items) for g in picked}
    partial = [g for g in picked if kept[g] < count[g]]
    assert len(partial) <= 1  # only the last group visited may be cut
    for g in partial:  # and it keeps its earliest items
        first = [it for it in w.items if it.group == g][: kept[g]]
        assert [it for it in s.items if it.group == g] == first
    assert w.sample_groups(60, seed=3) == s
    assert {it.group for it in w.sample_groups(60, seed=4).items} != picked
    # items without a group are groups of their own
    lone = replace(w, items=tuple(replace(it, group=None) for it in w.items[:10]))
    assert len(lone.sample_groups(4, seed=0).items) == 4


def test_head_refuses_a_negative_count(text: TextSource) -> None:
    w = build("short-unique", text, n=5)
    assert len(w.head(3).items) == 3 and len(w.head(0).items) == 0
    with pytest.raises(ValueError, match="n must be >= 0"):
        w.head(-2)  # would have sliced from the end: 3 items


def test_a_missing_trace_names_the_file_and_the_variable(
    tmp_path: Path, text: TextSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_TRACE_DIR", str(tmp_path))
    with pytest.raises(TraceError, match="KVGATE_TRACE_DIR") as exc:
        build("mooncake", text)
    assert str(tmp_path / "mooncake_synthetic_trace.jsonl") in str(exc.value)
    with pytest.raises(TraceError, match=r"AzureLLMInferenceTrace_conv\.csv"):
        build("azure-conv", text)


def assert_trace_error(
    path: Path, content: bytes, workload: str, text: TextSource, where: str
) -> None:
    """Loading ``workload`` from a file holding ``content`` raises a TraceError that starts
    with the file's path and ``where`` (the line and what is wrong)."""
    path.write_bytes(content)
    with pytest.raises(TraceError) as exc:
        build(workload, text, path=path)
    assert str(exc.value).startswith(f"{path}{where}"), str(exc.value)


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("", ": no rows"),
        ("\n\n", ": no rows"),
        (_MC_ROW + "\n{not json\n", ":2: not JSON"),
        (
            _MC_ROW + "\n\n" + '{"timestamp": 1, "input_length": 10}\n',
            ":3: no field 'hash_ids'",
        ),
        ('{"timestamp": 1, "input_length": "x", "output_length": 1, "hash_ids": [1]}', ":1: bad"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 7}', ":1: bad"),
        # accepted before: NaN hung the simulator's clock; the others made prompts shorter
        # than input_length (down to empty ones every engine refuses), or "abc" 3 hash ids
        ('{"timestamp": NaN, "input_length": 5, "output_length": 1, "hash_ids": [1]}', ":1: bad"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": []}', ":1: bad"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": [1]}', ":1: bad"),
        ('{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}', ":1: bad"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": "abc"}', ":1: bad"),
        ("[1, 2]", ":1: bad value: a row is a JSON object"),
    ],
)
def test_a_malformed_mooncake_trace_names_the_file_and_line(
    tmp_path: Path, text: TextSource, content: str, where: str
) -> None:
    assert_trace_error(tmp_path / "trace.jsonl", content.encode(), "mooncake", text, where)


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("", ": no rows"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", ": no rows"),
        (_AZ_HEAD + "2023-11-16 18:15:46.6805900,374,44\nyesterday,1,2\n", ":3: bad value"),
        (_AZ_HEAD + "2023-11-16 18:15:46.6805900,x,44\n", ":2: bad value"),
        ("TIMESTAMP,Tokens\n2023-11-16 18:15:46.6805900,4\n", ":2: no column 'ContextTokens'"),
    ],
)
def test_a_malformed_azure_trace_names_the_file_and_line(
    tmp_path: Path, text: TextSource, content: str, where: str
) -> None:
    assert_trace_error(tmp_path / "trace.csv", content.encode(), "azure-conv", text, where)


def test_a_well_formed_small_trace_still_loads(tmp_path: Path, text: TextSource) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(_MC_ROW + "\n")
    w = build("mooncake", text, path=path)
    assert len(w.items) == 1 and w.items[0].max_tokens == 3
    csv_path = tmp_path / "trace.csv"
    csv_path.write_text(_AZ_HEAD + "2023-11-16 18:15:46.6805900,374,44\n")
    assert len(build("azure-code", text, path=csv_path).items) == 1


def test_azure_windows_and_multi_turn_at_a_rate(text: TextSource) -> None:
    """The CLI's Azure workloads: seed k is the k-th window of consecutive rows, arrivals
    rescaled to the wanted mean rate, every prompt unique; multi-turn resends history."""
    full = build("azure-conv", text, max_requests=80)
    for seed in (0, 1):
        w = scaled_workload("azure-conv", 40, 4, 5.0, seed, text)
        assert len(w.items) == 40 and w.items[0].t == 0.0
        assert 40 / w.items[-1].t == pytest.approx(5.0)  # the mean rate asked for
        assert len({it.prompt for it in w.items}) == 40  # nothing shared
        window = full.items[40 * seed : 40 * seed + 40]
        assert [it.max_tokens for it in w.items] == [it.max_tokens for it in window]
    assert azure_rows("conv") > 10_000
    mt = scaled_workload("multi-turn", 30, 4, 2.0, 0, text)
    assert len(mt.items) == 30 and mt.items[0].messages is not None
    longest = max(len(it.messages or []) for it in mt.items)
    assert longest >= 7  # system + turns of history


def test_undecodable_bytes_in_a_trace_name_the_file_and_line(
    tmp_path: Path, text: TextSource
) -> None:
    content = _MC_ROW.encode() + b'\n{"timestamp": \xff\xfe}\n'
    assert_trace_error(tmp_path / "trace.jsonl", content, "mooncake", text, ":2: not JSON")


def test_word_text_draws_the_words_randrange_draws() -> None:
    """``WordVocabulary.text`` inlines ``randrange``'s draw: every workload's text (and so
    every recorded benchmark's requests) must stay what the seed gave before."""
    import random

    vocab = builtin_tokenizer().word_vocabulary
    words = vocab.words
    for seed in range(40):
        for n in (0, 1, 2, 17, 300):
            want = "".join(
                " " + words[r.randrange(len(words))]
                for r in (random.Random(seed),)
                for _ in range(n)
            )
            rng = random.Random(seed)
            assert vocab.text(n, rng) == want
            # the generator is left where randrange's draws leave it
            ref = random.Random(seed)
            for _ in range(n):
                ref.randrange(len(words))
            assert rng.getstate() == ref.getstate()


def test_text_source_once_is_block_without_caching_it() -> None:
    src = TextSource(cache_blocks=4)
    shared = src.block("shared", 64)
    for i in range(10):  # one-off blocks do not push the shared one out
        assert src.once(f"q{i}", 8) == TextSource().block(f"q{i}", 8)
    assert ("shared", 64) in src._cache and len(src._cache) == 1
    assert src.once("shared", 64) is shared
