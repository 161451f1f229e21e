from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachecore.traceanalysis import (
    RequestBlocks,
    analyze_events,
    analyze_requests,
    capped_hit_tokens,
    lru_bound,
    percentile,
    read_jsonl,
)


def req(keys: str, bs: int = 4) -> RequestBlocks:
    return RequestBlocks([k.encode() for k in keys], len(keys) * bs, bs)


def test_hit_cap() -> None:
    assert capped_hit_tokens(4, 16, 4) == 12  # block-aligned prompt recomputes its last block
    assert capped_hit_tokens(4, 17, 4) == 16
    assert capped_hit_tokens(0, 0, 4) == 0


def test_infinite_and_lru_bounds() -> None:
    trace = [req("abcd"), req("abce"), req("xyzw"), req("abcd")]
    inf = lru_bound(trace, None)
    # second: abc hit (12 tokens); fourth: abcd matched but capped at 3 blocks = 12
    assert inf.hit_tokens == 24 and inf.prompt_tokens == 64 and inf.evictions == 0
    small = lru_bound(trace, 5)
    # capacity 5 blocks: after xyzw only {e? ...}: abc evicted before the 4th request
    assert small.hit_tokens < inf.hit_tokens and small.evictions > 0


def test_lru_keeps_recently_used_prefix() -> None:
    trace = [req("ab"), req("cd"), req("abx"), req("ef"), req("abx")]
    # capacity 5: ef evicts the older c and d, not the just-touched a and b
    r = lru_bound(trace, 5)
    assert r.hit_tokens == 8 + 8  # 3rd hits ab, 5th hits abx capped at 2 blocks (8 tokens)
    # at 4, ef pushes out the tails x and c (a request's tail goes first, as in vLLM), not
    # a: the 5th still hits ab
    assert lru_bound(trace, 4).hit_tokens == 16


def test_event_analysis_occupancy_lifetimes_duplication() -> None:
    recs = [
        {"ts": 0.0, "replica": "r1", "op": "store", "key": "k1"},
        {"ts": 1.0, "replica": "r2", "op": "store", "key": "k1"},
        {"ts": 2.0, "replica": "r1", "op": "store", "key": "k2"},
        {"ts": 3.0, "replica": "r1", "op": "remove", "key": "k1"},
        {"ts": 4.0, "replica": "r2", "op": "clear"},
        {"ts": 5.0, "replica": "r1", "op": "remove", "key": "zz"},  # unknown: ignored
    ]
    rep = analyze_events(recs)
    assert sorted(rep.lifetimes_s) == [3.0, 3.0]  # k1@r1 0->3, k1@r2 1->4
    assert rep.censored_lifetimes_s == [3.0]  # k2@r1 alive 2->5
    assert rep.occupancy["r1"].peak == 2 and rep.occupancy["r2"].clears == 1
    assert rep.peak_duplicated_keys == 1
    # cached block-seconds 1+2+3+2+1 over [0,5), duplicated 1 in [1,3)
    assert rep.duplication == pytest.approx(2 / 9)


def test_request_analysis_and_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    lines = [
        {
            "ts": 0,
            "replica": "a",
            "prompt_tokens": 100,
            "cached_tokens": 0,
            "predicted_cached_tokens": 0,
        },
        {
            "ts": 1,
            "replica": "a",
            "prompt_tokens": 100,
            "cached_tokens": 96,
            "predicted_cached_tokens": 90,
        },
        {"ts": 2, "replica": "r1", "op": "store", "key": "k"},
    ]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    events, requests, bad = read_jsonl([f])
    assert len(events) == 1 and len(requests) == 2 and bad == 1
    rep = analyze_requests(requests)
    assert rep.hit_rate == pytest.approx(0.48) and rep.prediction_error == pytest.approx(0.03)


def test_percentile() -> None:
    assert percentile([5, 1, 3], 50) == 3
    assert percentile([1, 2, 3, 4], 99) == 4


def _analyze_cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """`kvgate trace analyze ARGS` in-process (gateway.cli.main would set a SIGTERM handler
    in the test process)."""
    from cachecore import traceanalysis

    parser = argparse.ArgumentParser(prog="kvgate trace")
    traceanalysis.configure(parser)
    code = traceanalysis.run(parser.parse_args(["analyze", *map(str, args)]))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_unreadable_input_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for target in (tmp_path / "missing.jsonl", tmp_path):
        code, out, err = _analyze_cli(capsys, target)
        assert code == 2 and out == ""
        assert err.startswith("kvgate trace: cannot read ") and err.count("\n") == 1


def test_malformed_records_are_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = [
        b'{"ts":"abc","replica":"r0","op":"store","key":"a"}',
        b'{"ts":null,"replica":"r0","op":"store","key":"a"}',
        b'{"ts":NaN,"replica":"r0","op":"store","key":"a"}',
        b'{"ts":Infinity,"replica":"r0","op":"clear"}',
        b'{"ts":1,"replica":"r0","op":"store"}',  # no key
        b'{"ts":1,"replica":"r0","op":"evict","key":"a"}',  # unknown op
        b'{"ts":1,"prompt_tokens":"x"}',
        b'{"ts":1,"prompt_tokens":10,"cached_tokens":"y"}',
        b"\xff\xfe not utf-8",
        b"[[[[" * 5000,
        b"[1, 2]",
    ]
    f = tmp_path / "bad.jsonl"
    f.write_bytes(b"\n".join(bad) + b"\n")
    code, out, err = _analyze_cli(capsys, f)
    assert code == 1 and out == ""
    assert (
        err
        == f"kvgate trace: no cache events or request records found ({len(bad)} lines skipped)\n"
    )
    good = [
        b'{"ts":10,"replica":"r0","op":"store","key":"a"}',
        b'{"ts":20,"replica":"r0","op":"remove","key":"a"}',
        b'{"ts":500,"replica":"r0","op":"evict","key":"a"}',  # must not stretch the span
    ]
    f.write_bytes(b"\n".join(bad + good) + b"\n")
    code, out, err = _analyze_cli(capsys, f)
    assert code == 0 and err == ""
    assert "span: 10.0 s" in out and f"skipped {len(bad) + 1} " in out


def test_analyze_events_skips_invalid_records() -> None:
    rep = analyze_events(
        [
            {"ts": 1.0, "replica": "r0", "op": "store", "key": "a"},
            {"ts": 9.0, "replica": "r0", "op": "flush"},
            {"ts": "x", "replica": "r0", "op": "clear"},
        ]
    )
    assert rep.skipped == 2 and rep.end_ts == 1.0 and rep.censored_lifetimes_s == [0.0]


def test_fresh_agent_clear_does_not_wipe_replayed_stores() -> None:
    """A fresh agent writes its start-up clear at its own time and then the engine's
    replayed batches, which carry older engine times: the clear must apply before them."""
    fresh = [
        {"ts": 1000.0, "replica": "r0", "op": "clear"},
        *({"ts": 500.0 + i, "replica": "r0", "op": "store", "key": f"k{i}"} for i in range(5)),
        {"ts": 1001.0, "replica": "r0", "op": "remove", "key": "k0"},
        {"ts": 700.0, "replica": "r1", "op": "store", "key": "k1"},
    ]
    rep = analyze_events(fresh)
    # k1..k4 still cached on r0 and k1 on r1; the clear takes the first replayed batch's
    # time, so the lifetimes count from the engine's store times
    assert sorted(rep.censored_lifetimes_s) == [301.0, 497.0, 498.0, 499.0, 500.0]
    assert rep.lifetimes_s == [501.0] and rep.start_ts == 500.0
    o = rep.occupancy["r0"]
    assert (o.last_ts, o.last_blocks) == (1001.0, 4)
    # appended to an earlier run's records that are newer than the replay: the clear still
    # applies after them and before the replay, which is placed at the clear's time
    old_run = [{"ts": 600.0 + i, "replica": "r0", "op": "store", "key": f"o{i}"} for i in range(3)]
    rep = analyze_events(old_run + fresh)
    assert sorted(rep.lifetimes_s) == [0.0, 1.0, 2.0, 399.0]  # o2, o1, o0 cleared; k0
    assert sorted(rep.censored_lifetimes_s) == [301.0, 399.0, 399.0, 399.0, 399.0]
    o = rep.occupancy["r0"]
    assert (o.last_ts, o.last_blocks) == (1001.0, 4)


def _store(ts: float, replica: str, key: str) -> dict[str, Any]:
    return {"ts": ts, "replica": replica, "op": "store", "key": key}


def test_duplication_is_block_seconds_weighted() -> None:
    clears = [{"ts": 0.0, "replica": r, "op": "clear"} for r in ("r0", "r1")]
    shared = [_store(100.0, r, k) for r in ("r0", "r1") for k in "abcd"]
    # the same 4 blocks on two replicas: half the cached blocks are second copies, however
    # long the caches were empty before and although nothing lasted after
    assert analyze_events(clears + shared).duplication == pytest.approx(0.5)
    assert analyze_events(shared).duplication == pytest.approx(0.5)
    # one more r0 block at 200: [100,200) 4 of 8 duplicated; the end state has no weight
    recs = [*clears, *shared, _store(200.0, "r0", "e")]
    rep = analyze_events(recs)
    assert rep.duplication == pytest.approx(0.5)
    assert rep.cached_block_s == 800.0 and rep.duplicated_block_s == 400.0
    # --end 300 weighs the final state (4 of 9) for 100 s
    rep = analyze_events(recs, end_ts=300.0)
    assert rep.duplication == pytest.approx((400 + 400) / (800 + 900))
    assert rep.end_ts == 300.0 and sorted(rep.censored_lifetimes_s) == [100.0] + [200.0] * 8
    # occupancy over the same window: r0 holds 0 for 100 s, 4 for 100 s, 5 for 100 s
    assert rep.occupancy["r0"].time_weighted_mean(rep.end_ts) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="before the last record"):
        analyze_events(recs, end_ts=199.0)


def test_cli_end_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.jsonl"
    recs = [_store(100.0, r, k) for r in ("r0", "r1") for k in "abcd"] + [_store(200, "r0", "e")]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    code, out, _ = _analyze_cli(capsys, f, "--end", "300")
    assert code == 0 and "span: 200.0 s" in out and ": 47.1%;" in out
    for bad, why in (("150", "--end 150 is before the last record (200)"), ("nan", "finite")):
        code, out, err = _analyze_cli(capsys, f, "--end", bad)
        assert code == 2 and out == "" and why in err and err.count("\n") == 1


def test_tier_change_re_emission_is_not_a_store() -> None:
    # the agent writes a store record again when a cached key's tier set changes
    recs = [
        {**_store(1.0, "r0", "a"), "tier": "GPU"},
        {**_store(2.0, "r0", "a"), "tier": "GPU|CPU"},
        {**_store(3.0, "r0", "a"), "tier": "CPU"},
        {"ts": 4.0, "replica": "r0", "op": "remove", "key": "a", "tier": ""},
        {**_store(5.0, "r0", "a"), "tier": "GPU"},
    ]
    o = analyze_events(recs).occupancy["r0"]
    assert (o.stores, o.tier_changes, o.removes) == (2, 2, 1)


def test_request_counts_only_from_records_that_carry_them() -> None:
    base = {"ts": 0, "replica": "a"}
    rep = analyze_requests(
        [
            {**base, "prompt_tokens": 100, "cached_tokens": 50, "predicted_cached_tokens": 40},
            {**base, "prompt_tokens": 300, "cached_tokens": 0},  # no prediction
            {**base, "prompt_tokens": 500, "predicted_cached_tokens": 500},  # no actual
            {**base, "prompt_tokens": 700, "cached_tokens": None},
        ]
    )
    assert rep.requests == 4 and rep.prompt_tokens == 1600
    assert rep.prediction_error == pytest.approx(10 / 100)  # the gateway's metric: 10 / 100
    assert rep.hit_rate == pytest.approx(50 / 400)
    assert rep.by_replica["a"] == (4, 1600, 400, 50)


def test_failed_answers_count_in_neither_rate() -> None:
    # the gateway's --trace-out writes a record for every answered request, errors included
    rep = analyze_requests(
        [
            {"ts": 0, "replica": "a", "status": 200, "prompt_tokens": 100, "cached_tokens": 50,
             "predicted_cached_tokens": 50},
            {"ts": 1, "replica": "a", "status": 500, "prompt_tokens": 900, "cached_tokens": 0,
             "predicted_cached_tokens": 800},
        ]
    )  # fmt: skip
    assert rep.hit_rate == pytest.approx(0.5) and rep.prediction_error == 0.0


def test_replica_without_cached_counts_shows_no_hit_rate() -> None:
    from cachecore.traceanalysis import format_request_report

    rep = analyze_requests([{"ts": 0, "replica": "r1", "prompt_tokens": 100}])
    assert "| r1 | 1 | 100 | 0 | - |" in format_request_report(rep)


def test_a_reader_that_leaves_early_stops_the_command_quietly(tmp_path: Path) -> None:
    """`kvgate trace analyze ... | head`: the closed pipe ends the command without a
    traceback (exit 141, as a shell reports SIGPIPE)."""
    f = tmp_path / "t.jsonl"
    lines = [
        json.dumps({"ts": 1.0, "replica": f"r{i}", "op": "store", "key": f"{i:032x}"})
        for i in range(20_000)  # a table far larger than a pipe's buffer
    ]
    f.write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "trace", "analyze", str(f)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(100)
    proc.stdout.close()  # the reader leaves
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err


def test_cli_a_file_given_twice_is_read_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvgate trace analyze a.jsonl ./a.jsonl` (or two overlapping globs) read the file
    twice without a word: every request counted twice, every store a tier change, every
    clear doubled. And a requests-only report began with an empty line."""
    f = tmp_path / "a.jsonl"
    f.write_text(
        '{"ts":10,"replica":"r0","op":"store","key":"a"}\n'
        '{"ts":20,"replica":"r0","op":"clear"}\n'
        '{"ts":21,"replica":"r0","prompt_tokens":100,"cached_tokens":50}\n'
    )
    monkeypatch.chdir(tmp_path)
    code, out, err = _analyze_cli(capsys, f, "./a.jsonl")
    assert code == 0
    assert err == "kvgate trace: a.jsonl names a file already given: read once\n"
    assert "| r0 | 1 | 0 | 0 | 1 |" in out and "requests: 1," in out, out
    g = tmp_path / "requests.jsonl"
    g.write_text('{"ts":21,"replica":"r0","prompt_tokens":100,"cached_tokens":50}\n')
    code, out, _ = _analyze_cli(capsys, g)
    assert code == 0 and out.startswith("requests: 1,"), out
