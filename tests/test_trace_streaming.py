"""``kvgate trace analyze`` streams: the same report as the in-memory analysis it replaced,
in memory that follows the caches' live state rather than the trace's length.

* golden: the CLI's exit code, stdout and stderr for the inputs of tests/test_traceanalysis.py
  and for generated multi-file traces, against ``tests/data/trace_analyze_golden.json``,
  written by the in-memory code at 5cab821 (before streaming) from these same cases;
* memory: a 300,000-line trace under tracemalloc (the in-memory code peaked at ~300 MB);
* property: on random small traces split into files, the streaming replay agrees exactly
  with a plain in-memory one written out below.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachecore import traceanalysis
from cachecore.traceanalysis import (
    Lifetimes,
    TraceChanged,
    _FileEvents,
    _scan,
    analyze_files,
    percentile,
)

GOLDEN = Path(__file__).parent / "data" / "trace_analyze_golden.json"


def write_trace(directory: Path, lines: int, seed: int = 0, capacity: int = 2000) -> list[Path]:
    """About ``lines`` lines of agent and gateway traces in five files: ``dp.jsonl`` two
    data-parallel ranks of one engine interleaved (one agent's file), ``r1.jsonl`` one
    replica, ``r2-a.jsonl`` / ``r2-b.jsonl`` one replica's trace split at an agent restart
    (the second opens with the fresh agent's clear at its own, later clock, then the
    engine's replay of what it holds in older batches), ``gateway.jsonl`` request records
    with a few malformed lines. Each cache holds ``capacity`` blocks and evicts LRU; prompt
    families are shared across replicas (duplication); 2% of hits re-emit a held key (a
    tier change); a rare clear."""
    rng = random.Random(seed)
    sinks = {"r0@dp0": "dp", "r0@dp1": "dp", "r1": "r1", "r2": "r2-a"}
    out: dict[str, list[str]] = {n: [] for n in ("dp", "r1", "r2-a", "r2-b", "gateway")}
    caches: dict[str, OrderedDict[str, None]] = {r: OrderedDict() for r in sinks}

    def event(ts: float, replica: str, op: str, key: str = "", tier: str = "") -> str:
        if op == "clear":
            return f'{{"ts":{ts!r},"replica":"{replica}","op":"clear"}}'
        return f'{{"ts":{ts!r},"replica":"{replica}","op":"{op}","key":"{key}","tier":"{tier}"}}'

    t = 1_733_500_000.0
    written = 0
    while written < lines:
        t += rng.expovariate(40.0)
        replica = rng.choice(list(sinks))
        cache = caches[replica]
        if replica == "r2" and sinks["r2"] == "r2-a" and written >= lines // 2:
            sinks["r2"] = "r2-b"  # the agent restarts
            out["r2-b"].append(event(t + 3.0, "r2", "clear"))
            for i, key in enumerate(cache):
                out["r2-b"].append(event(t - 1.0 + i * 1e-4, "r2", "store", key, "GPU"))
            written += 1 + len(cache)
        sink = out[sinks[replica]]
        if rng.random() < 1e-4:
            sink.append(event(t, replica, "clear"))
            cache.clear()
            written += 1
            continue
        family = int(rng.paretovariate(1.2)) % 400
        blocks = rng.randint(4, 48)
        hits = 0
        for i in range(blocks):
            key = f"{family:08x}{i:024x}"
            if key in cache:
                cache.move_to_end(key)
                hits += hits == i
                if rng.random() < 0.02:
                    sink.append(event(t, replica, "store", key, "GPU|CPU"))
                    written += 1
            else:
                cache[key] = None
                sink.append(event(t, replica, "store", key, "GPU"))
                written += 1
        while len(cache) > capacity:
            key, _ = cache.popitem(last=False)
            sink.append(event(t, replica, "remove", key))
            written += 1
        prompt = blocks * 16 + rng.randint(0, 15)
        cached = min(hits * 16, prompt - 1) // 16 * 16
        predicted = "null" if rng.random() < 0.05 else str(max(0, cached + rng.randint(-1, 1)))
        status = 500 if rng.random() < 0.01 else 200
        out["gateway"].append(
            f'{{"ts":{t + 0.05!r},"request_id":"q{written}","replica":"{replica[:2]}",'
            f'"tenant":"acme","status":{status},"prompt_tokens":{prompt},'
            f'"cached_tokens":{cached},"predicted_cached_tokens":{predicted}}}'
        )
        written += 1
        if rng.random() < 1e-3:
            out["gateway"].append(rng.choice(['{"ts":1,"prompt_tokens":"x"}', '{"ts":1,"rep']))
            written += 1
    paths = []
    for name, recs in out.items():
        path = directory / f"{name}.jsonl"
        path.write_text("".join(r + "\n" for r in recs))
        paths.append(path)
    return paths


# ------------------------------------------------------------------------------- golden


def _lines(*recs: dict[str, Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def _store(ts: float, replica: str, key: str, **extra: Any) -> dict[str, Any]:
    return {"ts": ts, "replica": replica, "op": "store", "key": key, **extra}


_FRESH = [
    {"ts": 1000.0, "replica": "r0", "op": "clear"},
    *(_store(500.0 + i, "r0", f"k{i}") for i in range(5)),
    {"ts": 1001.0, "replica": "r0", "op": "remove", "key": "k0"},
    {"ts": 700.0, "replica": "r1", "op": "store", "key": "k1"},
]
_OLD_RUN = [_store(600.0 + i, "r0", f"o{i}") for i in range(3)]
_SHARED = [
    *({"ts": 0.0, "replica": r, "op": "clear"} for r in ("r0", "r1")),
    *(_store(100.0, r, k) for r in ("r0", "r1") for k in "abcd"),
    _store(200.0, "r0", "e"),
]
_BAD = (
    b'{"ts":"abc","replica":"r0","op":"store","key":"a"}\n{"ts":NaN,"replica":"r0","op":"clear"}\n'
    b'{"ts":1,"replica":"r0","op":"store"}\n{"ts":1,"replica":"r0","op":"evict","key":"a"}\n'
    b'{"ts":1,"prompt_tokens":10,"cached_tokens":"y"}\n\xff\xfe not utf-8\n[1, 2]\n'
    + b"[[[[" * 5000
    + b"\n\n"
)
_REQUESTS = [
    {"ts": 0, "replica": "a", "prompt_tokens": 100, "cached_tokens": 50,
     "predicted_cached_tokens": 40},
    {"ts": 1, "replica": "a", "prompt_tokens": 300, "cached_tokens": 0},
    {"ts": 2, "replica": "b", "prompt_tokens": 500, "predicted_cached_tokens": 500},
    {"ts": 3, "replica": "b", "status": 500, "prompt_tokens": 900, "cached_tokens": 0},
    {"ts": 4, "replica": "c", "prompt_tokens": 700, "cached_tokens": None},
]  # fmt: skip

# name -> (file contents, the files' order on the command line (a file may repeat), options)
SMALL_CASES: dict[str, tuple[list[bytes], list[int], list[str]]] = {
    "occupancy": (
        [
            _lines(
                _store(0.0, "r1", "k1"),
                _store(1.0, "r2", "k1"),
                _store(2.0, "r1", "k2"),
                {"ts": 3.0, "replica": "r1", "op": "remove", "key": "k1"},
                {"ts": 4.0, "replica": "r2", "op": "clear"},
                {"ts": 5.0, "replica": "r1", "op": "remove", "key": "zz"},
            )
        ],
        [0],
        [],
    ),
    "fresh-agent": ([_lines(*_FRESH)], [0], []),
    "fresh-agent-after-old-run": ([_lines(*_OLD_RUN), _lines(*_FRESH)], [0, 1], []),
    "fresh-agent-files-reversed": ([_lines(*_OLD_RUN), _lines(*_FRESH)], [1, 0], []),
    "duplication": ([_lines(*_SHARED)], [0], []),
    "duplication-end": ([_lines(*_SHARED)], [0], ["--end", "300"]),
    "duplication-end-too-early": ([_lines(*_SHARED)], [0], ["--end", "150"]),
    "tier-changes": (
        [
            _lines(
                _store(1.0, "r0", "a", tier="GPU"),
                _store(2.0, "r0", "a", tier="GPU|CPU"),
                {"ts": 4.0, "replica": "r0", "op": "remove", "key": "a", "tier": ""},
                _store(5.0, "r0", "a", tier="GPU"),
            )
        ],
        [0],
        ["--end", "7.125"],
    ),
    "malformed-only": ([_BAD], [0], []),
    "malformed-and-good": ([_BAD + _lines(*_SHARED)], [0], []),
    "requests": ([_lines(*_REQUESTS)], [0], []),
    "requests-and-events": ([_lines(*_REQUESTS, *_FRESH)], [0], []),
    "given-twice": ([_lines(*_SHARED, *_REQUESTS)], [0, 0], []),
    "no-files-records": ([b"\n"], [0], []),
}

# name -> (lines, seed, the files' order (write_trace's five), options)
GENERATED_CASES: dict[str, tuple[int, int, list[int], list[str]]] = {
    "generated": (20_000, 1, [0, 1, 2, 3, 4], []),
    "generated-end": (20_000, 2, [4, 3, 2, 1, 0], ["--end", "1733500600.5"]),
    "generated-restart-first": (20_000, 3, [3, 2, 0, 1, 4], []),
    "generated-small-caches": (20_000, 4, [0, 1, 2, 3, 4, 0], ["--end", "1733509999"]),
}


def _cases(directory: Path) -> dict[str, tuple[list[Path], list[str]]]:
    """Every case's files, written under ``directory``, and its options."""
    cases: dict[str, tuple[list[Path], list[str]]] = {}
    for name, (contents, order, options) in SMALL_CASES.items():
        paths = []
        for i, data in enumerate(contents):
            path = directory / f"{name}-{i}.jsonl"
            path.write_bytes(data)
            paths.append(path)
        cases[name] = ([paths[i] for i in order], options)
    for name, (lines, seed, order, options) in GENERATED_CASES.items():
        (directory / name).mkdir()
        capacity = 300 if "small" in name else 2000
        paths = write_trace(directory / name, lines, seed, capacity)
        cases[name] = ([paths[i] for i in order], options)
    return cases


def run_cli(module: ModuleType, paths: list[Path], options: list[str]) -> dict[str, Any]:
    """``kvgate trace analyze`` of ``module`` in-process: exit code, stdout, stderr (paths
    under the files' directory written as <dir>)."""
    parser = argparse.ArgumentParser(prog="kvgate trace")
    module.configure(parser)
    args = parser.parse_args(["analyze", *map(str, paths), *options])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = module.run(args)
    root = str(paths[0].parent)
    return {"code": code, "out": out.getvalue(), "err": err.getvalue().replace(root, "<dir>")}


def test_report_is_the_in_memory_analysis_report(tmp_path: Path) -> None:
    golden = json.loads(GOLDEN.read_text())
    cases = _cases(tmp_path)
    assert sorted(cases) == sorted(golden)
    for name, (paths, options) in cases.items():
        assert run_cli(traceanalysis, paths, options) == golden[name], name


# ------------------------------------------------------------------------------- memory


@pytest.mark.slow
def test_memory_follows_the_live_state_not_the_trace_length(tmp_path: Path) -> None:
    """300,000 lines (~1.1 KB each as a parsed record) whose caches hold at most 8,192
    blocks: the in-memory analysis peaked at ~300 MB here, the stream at ~2 MB."""
    paths = write_trace(tmp_path, 300_000)
    tracemalloc.start()
    try:
        result = run_cli(traceanalysis, paths, [])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result["code"] == 0 and "| r0@dp1 |" in result["out"], result
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------ property


def _reference(files: list[list[dict[str, Any]]], end: float | None) -> dict[str, Any]:
    """The analysis written as plainly as possible, every record and sample in lists."""
    streams: dict[str, list[dict[str, Any]]] = {}
    for rec in (r for f in files for r in f):
        streams.setdefault(rec["replica"], []).append(rec)
    timed = []
    for s, recs in enumerate(streams.values()):
        t = -math.inf
        for i, rec in enumerate(recs):
            ts = rec["ts"]
            if rec["op"] == "clear" and i + 1 < len(recs):
                ts = min(ts, recs[i + 1]["ts"])
            t = max(t, ts)
            timed.append((t, s, i, rec))
    timed.sort(key=lambda x: x[:3])
    held: dict[str, dict[str, float]] = {r: {} for r in streams}
    samples: dict[str, list[tuple[float, int]]] = {r: [] for r in streams}
    ops: dict[str, list[int]] = {r: [0, 0, 0, 0] for r in streams}
    ended: list[float] = []
    area = dup = 0.0
    last = timed[0][0]
    peak_dup = 0

    def copies() -> tuple[int, int]:
        total = sum(len(h) for h in held.values())
        return total, total - len(set().union(*held.values()))

    for ts, _, _, rec in timed:
        total, dups = copies()
        area += total * (ts - last)
        dup += dups * (ts - last)
        last = ts
        r, op, h = rec["replica"], rec["op"], held[rec["replica"]]
        if op == "store" and rec["key"] in h:
            ops[r][1] += 1
        elif op == "store":
            h[rec["key"]] = ts
            ops[r][0] += 1
        elif op == "remove":
            if rec["key"] in h:
                ended.append(ts - h.pop(rec["key"]))
            ops[r][2] += 1
        else:
            ended += [ts - t0 for t0 in h.values()]
            h.clear()
            ops[r][3] += 1
        samples[r].append((ts, len(h)))
        peak_dup = max(peak_dup, copies()[1])
    end = last if end is None else end
    total, dups = copies()
    area += total * (end - last)
    dup += dups * (end - last)
    means = {}
    for r, ss in samples.items():
        pairs = zip(ss, [*ss[1:], (end, 0)], strict=True)
        a = sum(n * max(0.0, t1 - t0) for (t0, n), (t1, _) in pairs)
        span = end - ss[0][0]
        means[r] = a / span if span > 0 else float(ss[-1][1])
    return {
        "ops": ops,
        "means": means,
        "peaks": {r: max(n for _, n in ss) for r, ss in samples.items()},
        "ended": sorted(round(v, 2) for v in ended),
        "censored": sorted(round(end - t0, 2) for h in held.values() for t0 in h.values()),
        "duplication": dup / area if area > 0 else (dups / total if total else 0.0),
        "cached_block_s": area,
        "peak_dup": peak_dup,
        "start": timed[0][0],
    }


_event = st.one_of(
    st.fixed_dictionaries(
        {
            "ts": st.integers(0, 400).map(lambda n: n / 4),
            "replica": st.sampled_from(["a", "b", "c"]),
            "op": st.sampled_from(["store", "store", "remove"]),
            "key": st.sampled_from(["w", "x", "y", "z"]),
        }
    ),
    st.fixed_dictionaries(
        {
            "ts": st.integers(0, 400).map(lambda n: n / 4),
            "replica": st.sampled_from(["a", "b", "c"]),
            "op": st.just("clear"),
        }
    ),
)


@settings(max_examples=200, deadline=None)
@given(
    files=st.lists(st.lists(_event, max_size=12), min_size=1, max_size=4).filter(
        lambda fs: any(fs)
    ),
    end=st.one_of(st.none(), st.just(1000.0)),
)
def test_streaming_agrees_with_an_in_memory_replay(
    files: list[list[dict[str, Any]]], end: float | None
) -> None:
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i, recs in enumerate(files):
            paths.append(Path(d) / f"{i}.jsonl")
            paths[-1].write_text("".join(json.dumps(r) + "\n" for r in recs))
        rep = analyze_files(paths, end).events
        with pytest.MonkeyPatch.context() as mp:  # every replica of a file on its own reader
            mp.setattr(traceanalysis, "QUEUE_CAP", 1)
            own = analyze_files(paths, end).events
    assert own is not None and rep is not None
    assert traceanalysis.format_event_report(own) == traceanalysis.format_event_report(rep)
    ref = _reference(files, end)
    assert rep is not None
    assert {
        r: [o.stores, o.tier_changes, o.removes, o.clears] for r, o in rep.occupancy.items()
    } == ref["ops"]
    assert {r: o.time_weighted_mean(rep.end_ts) for r, o in rep.occupancy.items()} == ref["means"]
    assert {r: o.peak for r, o in rep.occupancy.items()} == ref["peaks"]
    assert rep.lifetimes_s == ref["ended"] and rep.censored_lifetimes_s == ref["censored"]
    assert rep.duplication == ref["duplication"] and rep.cached_block_s == ref["cached_block_s"]
    assert rep.peak_duplicated_keys == ref["peak_dup"] and rep.start_ts == ref["start"]


@given(st.floats(0, 1e7), st.floats(-1e7, 0))
def test_rounding_to_hundredths_is_what_the_report_prints(x: float, y: float) -> None:
    for v in (x, y):
        assert f"{round(v, 2):.2f}" == f"{v:.2f}"


@given(st.lists(st.floats(0, 1e5), min_size=1, max_size=50), st.sampled_from([0, 50, 90, 99, 100]))
def test_lifetime_percentiles_print_as_the_exact_ones(values: list[float], q: float) -> None:
    lt = Lifetimes()
    for v in values:
        lt.add(v)
    assert len(lt) == len(values)
    assert f"{lt.percentile(q):.2f}" == f"{percentile(values, q):.2f}"
    assert math.isnan(Lifetimes().percentile(50))


# ---------------------------------------------------------------------- reading twice


def _event_line(ts: float, replica: str, key: str) -> str:
    return json.dumps(_store(ts, replica, key)) + "\n"


def test_replay_stops_where_the_first_read_stopped(tmp_path: Path) -> None:
    """An agent appending while the file is analysed: the replay reads what was counted,
    not the lines written since (nor the rest of a line cut short)."""
    f = tmp_path / "a.jsonl"
    f.write_text(_event_line(1.0, "r0", "a") + _event_line(2.0, "r1", "b"))
    scan, bad = _scan(f, traceanalysis.RequestTally())
    assert bad == 0 and scan.events == {"r0": 1, "r1": 1}
    with f.open("a") as fh:
        fh.write(_event_line(3.0, "r0", "c") + '{"ts":4.0,"replica":"r1","op":"st')
    events = _FileEvents(scan)
    assert [r["key"] for r in events.of("r1")] == ["b"]
    assert [r["key"] for r in events.of("r0")] == ["a"]


def test_a_file_rewritten_between_the_reads_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "a.jsonl"
    f.write_text(_event_line(1.0, "r0", "a") + _event_line(2.0, "r0", "b"))
    scan, _ = _scan(f, traceanalysis.RequestTally())
    f.write_text(_event_line(1.0, "r9", "a"))
    with pytest.raises(TraceChanged, match="changed while it was read"):
        list(_FileEvents(scan).of("r0"))


def test_an_idle_rank_does_not_queue_the_busy_one(tmp_path: Path) -> None:
    """One agent's file for two ranks, one idle between its first record and its last:
    the replay waits for the idle rank's next record, far ahead in the file, and queues
    the busy rank's records it reads past only up to QUEUE_CAP; then the busy rank reads
    the file on its own (without the cap the peak was 80 MiB here)."""
    f = tmp_path / "dp.jsonl"
    with f.open("w") as fh:
        fh.write(_event_line(0.0, "r0@dp1", "idle-a"))
        for i in range(60_000):
            key = f"{i:032x}"
            fh.write(_event_line(1.0 + i / 64, "r0@dp0", key))
            rm = {"ts": 1.0 + i / 64 + 1 / 128, "replica": "r0@dp0", "op": "remove", "key": key}
            fh.write(json.dumps(rm) + "\n")
        fh.write(_event_line(2000.0, "r0@dp1", "idle-b"))
    assert traceanalysis.QUEUE_CAP <= 10_000
    tracemalloc.start()
    try:
        rep = analyze_files([f]).events
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    events, _, _ = traceanalysis.read_jsonl([f])
    expected = traceanalysis.format_event_report(traceanalysis.analyze_events(events))
    assert rep is not None and traceanalysis.format_event_report(rep) == expected
    assert rep.occupancy["r0@dp0"].removes == 60_000 and rep.censored_lifetimes_s == [0.0, 2000.0]
    assert peak < 24 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_a_pipe_is_read_once(tmp_path: Path) -> None:
    """A pipe cannot be read twice: its events are held (the old behaviour), the report
    the same as the file's."""
    paths = write_trace(tmp_path, 3000)
    data = paths[0].read_bytes()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "gateway.cli", "trace", "analyze"]
    piped = subprocess.run(
        [*cmd, "/dev/stdin"], input=data, capture_output=True, env=env, check=True
    )
    direct = run_cli(traceanalysis, [paths[0]], [])
    assert piped.stdout.decode() == direct["out"] and "| r0@dp0 |" in direct["out"]


def test_a_skipped_line_is_counted_and_logged_with_its_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "a.jsonl"
    f.write_text(_event_line(1.0, "r0", "a") + "\n{not json\n" + '{"ts":2,"op":"evict"}\n')
    with caplog.at_level("DEBUG", logger="cachecore.traceanalysis"):
        result = analyze_files([f])
    assert result.skipped == 2 and result.events is not None
    where = [(r.path, r.line, r.why) for r in caplog.records]  # type: ignore[attr-defined]
    assert where == [(str(f), 3, "not JSON"), (str(f), 4, "not a valid cache event")]


# ------------------------------------------------------------------------------ gzip


def _gzipped(path: Path, members: int = 1) -> Path:
    """``path`` compressed as logrotate leaves it (``members`` > 1: the data split into
    that many gzip members, concatenated)."""
    import gzip
    import itertools

    data = path.read_bytes()
    cut = [len(data) * i // members for i in range(members + 1)]
    out = path.with_name(path.name + ".gz")
    out.write_bytes(b"".join(gzip.compress(data[a:b]) for a, b in itertools.pairwise(cut)))
    return out


def test_gzip_files_give_the_plain_files_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rotated, compressed traces are read through their decompression, both reads; the
    per-replica readers of a shared file seek in decompressed bytes (QUEUE_CAP 1 gives every
    replica of the data-parallel file its own)."""
    paths = write_trace(tmp_path, 4000, seed=3)
    plain = run_cli(traceanalysis, paths, [])
    gz = [_gzipped(p, members=1 + i % 3) for i, p in enumerate(paths)]
    assert run_cli(traceanalysis, gz, []) == plain
    monkeypatch.setattr(traceanalysis, "QUEUE_CAP", 1)
    assert run_cli(traceanalysis, gz, []) == plain


def test_gzip_down_a_pipe_and_dash_for_stdin(tmp_path: Path) -> None:
    paths = write_trace(tmp_path, 3000)
    direct = run_cli(traceanalysis, [paths[0]], [])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    cmd = [sys.executable, "-m", "gateway.cli", "trace", "analyze", "-"]
    for data in (paths[0].read_bytes(), _gzipped(paths[0]).read_bytes()):
        piped = subprocess.run(cmd, input=data, capture_output=True, env=env, check=True)
        assert piped.stdout.decode() == direct["out"] and "| r0@dp0 |" in direct["out"]


def test_a_damaged_gzip_file_is_an_error_naming_it(tmp_path: Path) -> None:
    paths = write_trace(tmp_path, 3000)
    gz = _gzipped(paths[1])
    gz.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])  # cut short
    got = run_cli(traceanalysis, [paths[0], gz], [])
    assert got["code"] == 2 and got["out"] == ""
    assert got["err"].startswith("kvgate trace: <dir>/r1.jsonl.gz: its gzip data is damaged")
