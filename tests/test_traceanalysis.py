from __future__ import annotations

import json
from pathlib import Path

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
    assert lru_bound(trace, 4).hit_tokens == 8  # at 4, ef pushes a out: the 5th misses


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
    # duplicated share: t in [1,2): 1/2, [2,3): 1/3, else 0 -> (0.5 + 0.333) / 5
    assert rep.duplication_time_weighted == pytest.approx((0.5 + 1 / 3) / 5)


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
