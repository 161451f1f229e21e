"""`kvgate demo` end to end (DEMO_SERVE=0), at a reduced size: real replica and gateway
subprocesses, embedded agents, the same code path as `make demo`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cachecore.testing import free_port


@pytest.mark.slow
def test_demo_prints_a_comparison_with_expected_latency_ahead() -> None:
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "demo", "--serve", "0", "--requests", "48",
         "--time-scale", "0.5", "--port", str(port)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\| (round_robin|expected_latency) \| ([\d.]+)% \|", line)
        if m:
            rows[m.group(1)] = float(m.group(2))
    assert set(rows) == {"round_robin", "expected_latency"}, proc.stdout
    assert rows["expected_latency"] > rows["round_robin"]
    assert "requests failed" not in proc.stdout
