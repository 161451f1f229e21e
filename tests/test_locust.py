"""The Locust file, headless against a real gateway and replicas: one statistics row per
request, timed to its last byte, and the TTFTs reported apart."""

from __future__ import annotations

import asyncio
import csv
import re
import sys
from pathlib import Path

import pytest

from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(120)

LOCUSTFILE = Path(__file__).resolve().parent.parent / "loadtest" / "locustfile.py"


async def test_headless_run_counts_each_request_once_and_reports_ttft(tmp_path: Path) -> None:
    prefix = tmp_path / "run"
    async with stack(count=2) as st:
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "locust"),
            "-f", str(LOCUSTFILE), "--headless", "-u", "3", "-r", "3", "-t", "6s",
            "--host", st.url, "--csv", str(prefix), "--only-summary",
            "SharedSystemPromptChat", "ShortUnique",
            env={"KVGATE_LOCUST_MODEL": st.model, "PATH": str(Path(sys.executable).parent)},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    text = out.decode()
    assert proc.returncode == 0, text[-2000:]
    check_outputs(text, prefix)


def check_outputs(text: str, prefix: Path) -> None:
    # Locust's printed summary is final (its CSV is rewritten each second and can miss
    # the last requests): per class "POST <class> <requests> <failures>(...)"
    printed = dict(re.findall(r"^POST\s+(\w+)\s+(\d+)\s+0\(", text, re.M))
    ttft_csv = Path(f"{prefix}_ttft.csv").read_text().splitlines()
    ttft = {r["user class"]: r for r in csv.DictReader(ttft_csv)}
    assert set(printed) == set(ttft) == {"SharedSystemPromptChat", "ShortUnique"}
    total = int(re.findall(r"^\s+Aggregated\s+(\d+)\s", text, re.M)[0])
    assert total == sum(map(int, printed.values())) > 0  # one row per request, no TTFT rows
    stats_csv = Path(f"{prefix}_stats.csv").read_text().splitlines()
    stats = {(r["Type"], r["Name"]): r for r in csv.DictReader(stats_csv)}
    assert {kind for kind, _ in stats} == {"POST", ""}  # "" is the Aggregated row
    for name, count in printed.items():
        # every streamed request had a first token, and its row covers the whole stream
        assert int(count) == int(ttft[name]["requests"])
        avg = float(stats[("POST", name)]["Average Response Time"])
        assert avg > float(ttft[name]["TTFT p50 ms"])
    assert float(ttft["SharedSystemPromptChat"]["mean cached tokens"]) > 0
    assert float(ttft["ShortUnique"]["mean cached tokens"]) == 0
    assert "streamed requests: TTFT" in text
