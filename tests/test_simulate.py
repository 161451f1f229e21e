"""The virtual-time simulator: deferred analytic decode equals stepping every step, and
the routing code it drives behaves as it does behind HTTP."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cachecore.keys import tokens_to_bytes
from gateway.routing import Strategy
from loadtest.simulate import (
    FleetSimulator,
    SimConfig,
    SimResult,
    scaled_workload,
    tiled_mooncake,
)
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy


@pytest.fixture(scope="module")
def text() -> TextSource:
    return TextSource()


def _run(cfg: SimConfig, workload_name: str, n: int, rate: float, text: TextSource) -> SimResult:
    pol = load_policy(builtin_policy_path("default"))
    w = scaled_workload(workload_name, n, cfg.replicas, rate, 0, text)
    return asyncio.run(FleetSimulator(cfg, pol, w).run())


def test_deferred_decode_equals_stepping_every_step(text: TextSource) -> None:
    cfg = SimConfig(replicas=3, strategy=Strategy.ROUND_ROBIN, num_blocks=1024)
    fast = _run(cfg, "shared-prefix", 120, 6.0, text)
    slow = _run(replace(cfg, defer_decode=False), "shared-prefix", 120, 6.0, text)
    assert fast.requests == slow.requests == 120
    assert sorted(fast.ttft) == pytest.approx(sorted(slow.ttft), abs=1e-9)
    assert sorted(fast.e2e) == pytest.approx(sorted(slow.e2e), abs=1e-9)
    assert fast.cached_tokens == slow.cached_tokens
    assert fast.generated_tokens == slow.generated_tokens == 120 * 128


def test_expected_latency_beats_round_robin_on_shared_prefixes(text: TextSource) -> None:
    cfg = SimConfig(replicas=4, num_blocks=2048)
    rr = _run(replace(cfg, strategy=Strategy.ROUND_ROBIN), "shared-prefix", 300, 10.0, text)
    el = _run(cfg, "shared-prefix", 300, 10.0, text)
    assert el.cached_tokens > rr.cached_tokens
    assert el.row()["ttft_mean"] < rr.row()["ttft_mean"]
    assert el.row()["pred_error"] < 0.03
    assert el.index_entries_peak > 0


def test_every_request_finishes_under_overload(text: TextSource) -> None:
    cfg = SimConfig(replicas=2, num_blocks=512, strategy=Strategy.LEAST_LOADED)
    res = _run(cfg, "short-unique", 200, 200.0, text)
    assert len(res.e2e) + res.rejected == 200


def test_tiled_mooncake_arrives_at_the_wanted_rate() -> None:
    for rate in (2.0, 40.0):
        w = tiled_mooncake(TextSource(), requests=400, rate=rate, seed=0)
        assert len(w.items) == 400
        achieved = (len(w.items) - 1) / (w.items[-1].t - w.items[0].t)
        assert achieved == pytest.approx(rate, rel=0.01)


@pytest.mark.parametrize(
    "workload_name",
    ["shared-prefix", "hot-prefix", "tenant-mix", "rag", "short-unique", "multi-turn"],
)
def test_the_word_shortcut_gives_the_tokenizers_ids(text: TextSource, workload_name: str) -> None:
    """The simulator reads a chat made of single-token words without BPE; its ids must be
    the tokenizer's, on every item (the in-run check covers only the first ones)."""
    pol = load_policy(builtin_policy_path("default"))
    w = scaled_workload(workload_name, 60, 2, 4.0, 0, text)
    sim = FleetSimulator(SimConfig(replicas=2), pol, w)
    shortcut = 0
    for item in w.items:
        body = item.body("m", stream=False)
        exact = (
            sim.tokenizer.chat_sync(body)
            if item.api == "chat"
            else sim.tokenizer.completion_sync(body)
        )
        fast = sim._chat_words(body) if item.api == "chat" else None
        shortcut += fast is not None
        # the ids, and their bytes as the engine would convert them
        assert fast is None or fast == (exact, tokens_to_bytes(exact))
        ids, data = sim._tokens(item)
        assert ids == exact
        assert data is None or data == tokens_to_bytes(exact)
    if workload_name in ("shared-prefix", "hot-prefix"):
        assert shortcut == len(w.items)  # these are word-only chats: no BPE at all
    assert sim._word_ids is not None  # the in-run check never tripped


def test_a_chat_that_is_not_words_takes_the_tokenizer(text: TextSource) -> None:
    pol = load_policy(builtin_policy_path("default"))
    w = scaled_workload("shared-prefix", 4, 2, 4.0, 0, text)
    sim = FleetSimulator(SimConfig(replicas=2), pol, w)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello,  world!\nBye"}]}
    assert sim._chat_words(body) is None


# ------------------------------------------------------------------ the CLI and its figures


def _kvgate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_sim_seconds_end_when_the_last_request_finishes(text: TextSource) -> None:
    """Not at the scrape tick after it: with a 10 s scrape the old figure was a multiple of
    10 s, inflating "sim s" and "speedup" (and the calibration's divisor)."""
    pol = load_policy(builtin_policy_path("default"))
    w = scaled_workload("short-unique", 20, 2, 4.0, 0, text)
    cfg = SimConfig(replicas=2, num_blocks=512, scrape_interval_s=10.0)
    res = asyncio.run(FleetSimulator(cfg, pol, w).run())
    assert len(res.e2e) == 20
    # the last e2e recorded is the last request to finish: its arrival + e2e is the end
    end_arrival = res.sim_seconds - res.e2e[-1]
    assert any(abs(end_arrival - it.t) < 1e-9 for it in w.items)
    assert res.sim_seconds % 10.0 != pytest.approx(0.0)


def test_a_zero_scrape_interval_is_refused() -> None:
    pol = load_policy(builtin_policy_path("default"))
    w = scaled_workload("short-unique", 4, 2, 4.0, 0, TextSource())
    with pytest.raises(ValueError, match="scrape_interval_s"):
        FleetSimulator(SimConfig(replicas=2, scrape_interval_s=0.0), pol, w)


def test_rejected_requests_are_shown_and_warned_about() -> None:
    """Every prompt (2k-token system prompt) is larger than 140 blocks x 16 tokens: the run
    measured nothing, which the table and a warning say, and the exit code is 1."""
    proc = _kvgate(
        "simulate", "--replicas", "2", "--requests", "20", "--rate", "5",
        "--strategies", "round_robin", "--blocks", "140",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "| rejected |" in proc.stdout
    assert "| 2 | round_robin | 20 | 20 |" in proc.stdout
    assert "WARNING: requests rejected" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--requests", "-5"],
        ["--requests", "0"],
        ["--rate", "0"],
        ["--rate", "-1"],
        ["--load", "0"],
        ["--scrape-interval-ms", "0"],
        ["--replicas", "4,x"],
        ["--replicas", "0"],
        ["--strategies", "bogus"],
        ["--strategies", ","],
        ["--blocks", "0"],
        ["--block-size", "0"],
        ["--profile", "nope"],
        ["--policy", "/nonexistent.yaml"],
        ["--plot", "/tmp/kvgate-one-size.png", "--replicas", "2"],
        ["--plot", "/dev/null/x/plot.png", "--replicas", "2,4"],
    ],
)
def test_bad_simulate_arguments_are_one_line_errors(args: list[str]) -> None:
    proc = _kvgate("simulate", "--requests", "10", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""  # nothing ran
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("kvgate simulate: ")
    assert "Traceback" not in proc.stderr


def test_a_bad_trace_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "mooncake_synthetic_trace.jsonl").write_text("")
    proc = _kvgate(
        "simulate", "--workload", "mooncake", "--requests", "10", "--rate", "1",
        env={"KVGATE_TRACE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"kvgate simulate: {tmp_path / 'mooncake_synthetic_trace.jsonl'}: no rows"
    )


def test_simultaneous_mooncake_rows_are_rescaled_not_divided_by_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rows at one timestamp (one copy, no span) were a ZeroDivisionError traceback
    out of `kvgate simulate --workload mooncake --requests 2`."""
    row = '{"timestamp": 5, "input_length": 100, "output_length": 2, "hash_ids": [%d]}\n'
    (tmp_path / "mooncake_synthetic_trace.jsonl").write_text(row % 1 + row % 2)
    monkeypatch.setenv("KVGATE_TRACE_DIR", str(tmp_path))
    w = tiled_mooncake(TextSource(), requests=2, rate=1.0, seed=0)
    assert [it.t for it in w.items] == [0.0, 0.0]


def test_more_azure_requests_than_the_trace_holds_is_a_one_line_error(tmp_path: Path) -> None:
    """`--workload azure-conv --requests 10` on a trace of 2 rows ran 2 requests and
    reported them as the run asked for (the real azure-code trace holds 8,819 rows)."""
    (tmp_path / "AzureLLMInferenceTrace_conv.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    proc = _kvgate(
        "simulate", "--workload", "azure-conv", "--requests", "10", "--rate", "1",
        "--strategies", "round_robin", env={"KVGATE_TRACE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip().startswith("kvgate simulate: the Azure conv trace "), proc.stderr
    assert "holds 2 requests, 10 asked for" in proc.stderr
