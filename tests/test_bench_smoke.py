"""Smoke runs of `kvgate bench gateway` and `kvgate bench index`: every part runs for real
(replica, gateway and bare proxy as processes; private redis-servers) and prints its
tables. Figures are not checked here: performance lives in the benchmarks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.redis


def test_bench_gateway_smoke_run_prints_every_part() -> None:
    cmd = [
        sys.executable, "-m", "gateway.cli", "bench", "gateway", "--requests", "10",
        "--warmup", "2", "--idle-s", "0.5", "--decision-lookups", "20", "--rate", "50",
        "--rate-seconds", "1", "--bare",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout
    for arm in ("direct", "gateway", "bare"):
        assert re.search(rf"^\| {arm} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|$", text, re.M), arm
    assert re.search(r"^\| gateway \| [0-9,]+ \| [0-9,]+ \| [0-9,]+ \|$", text, re.M)  # CPU
    for stage in ("parse", "tokenize", "keys", "lookup", "score", "proxy"):
        assert re.search(rf"^\| {stage} \| [0-9,]+ \|$", text, re.M), stage
    assert re.search(r"^\| keys \+ lookup \+ score \| [0-9.]+ \| [0-9.]+ \|$", text, re.M)
    # the rate part: both arms answered every request they were sent
    rows = re.findall(r"^\| (direct|gateway) \| (\d+) \| \d+ \| [0-9.]+ \| [0-9.]+ \| (\d+) \|$",
                      text, re.M)  # fmt: skip
    assert {r[0] for r in rows} == {"direct", "gateway"}
    assert all(int(sent) > 0 and int(errors) == 0 for _, sent, errors in rows)
    assert text.count("target:") >= 4
    # the decision part's fleet is valid: its candidates are one server's ranks (D20)
    assert "share one URL" not in text + out.stderr


def test_bench_index_quick_run_proves_one_call_per_lookup() -> None:
    """`kvgate bench index --quick`: both backends, every table; each Redis row made
    exactly one top-level call per lookup (the benchmark reads INFO commandstats)."""
    cmd = [sys.executable, "-m", "gateway.cli", "bench", "index", "--quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout
    redis_rows = re.findall(
        r"^\| redis \| (?:shared|uniform) \|.*\| ([0-9.]+) \| [0-9.]+ \| (\d+) \|$", text, re.M
    )
    assert len(redis_rows) >= 4 and all(calls == "1.00" for calls, _ in redis_rows), redis_rows
    assert all(int(us) > 0 for _, us in redis_rows), redis_rows  # the script's time in Redis
    assert re.search(r"^\| memory \| (?:shared|uniform) \| ", text, re.M)
    assert re.search(r"^\| redis \| \d+ \| \d+ \| [0-9,]+ \|$", text, re.M)  # writes
    assert "used_memory delta / indexed block" in text
