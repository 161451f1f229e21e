"""`kvgate bench routers` end to end at a small size: a real fleet subprocess, a real gateway,
kvgate strategies only and --no-install (CI has no peers; the peer systems asked for are
reported as skipped), plus the pure helpers (system parsing, ABBA order, lag percentile,
verdicts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from cachecore.engine.latency import get_profile
from cachecore.tokenizer import builtin_tokenizer
from gateway.tokenization import LocalPromptTokenizer
from loadtest import bench_routers
from loadtest.bench_routers import (
    ALL_SYSTEMS,
    LAG_LIMIT_MS,
    Bench,
    System,
    SystemRun,
    _bench,
    _floor_note,
    aggregate,
    block_order,
    json_text,
    lag_p99_ms,
    make_workload,
    parse_systems,
    seed_p99_ratios,
    summary_table,
    verdicts,
    workload_bounds,
)
from loadtest.peers import ensure_peer, placement_lookups
from loadtest.replay import ReplayReport, RequestResult
from loadtest.workloads import TextSource, WorkItem, build


def test_parse_systems_and_abba_order() -> None:
    assert [s.name for s in parse_systems("all")] == list(ALL_SYSTEMS)
    got = parse_systems("kvgate,vllm-router:kv_aware,round_robin")
    assert got[-1] == System("vllm-router:kv_aware") and len(got) == 7
    with pytest.raises(ValueError):
        parse_systems("nginx")
    systems = parse_systems("round_robin,expected_latency,sglang-router:cache_aware")
    even = [[s.name for s in b] for b in block_order(systems, 0)]
    odd = [[s.name for s in b] for b in block_order(systems, 1)]
    assert even == [["round_robin", "expected_latency"], ["sglang-router:cache_aware"]]
    assert odd == [["sglang-router:cache_aware"], ["expected_latency", "round_robin"]]


def test_lag_percentile_from_bucket_deltas() -> None:
    before = [{"lag_le_0.001": 10.0, "lag_le_0.005": 10.0, "lag_le_+Inf": 10.0}]
    after = [{"lag_le_0.001": 108.0, "lag_le_0.005": 110.0, "lag_le_+Inf": 110.0}]
    assert lag_p99_ms(before, after) == pytest.approx(5.0)
    assert math.isnan(lag_p99_ms(before, before))


def test_verdicts_report_missed_targets() -> None:
    agg = {
        "expected_latency": {
            "ttft_p99_s": (1.0, 1.0, 1.0),
            "ttft_mean_s": (0.5, 0.5, 0.5),
            "token_hit_rate": (0.5, 0.5, 0.5),
        },
        "vllm-router:cache_aware": {
            "ttft_p99_s": (1.2, 1.2, 1.2),
            "ttft_mean_s": (0.6, 0.6, 0.6),
            "token_hit_rate": (0.4, 0.4, 0.4),
        },
    }
    lines = verdicts("shared-prefix", agg, 0.6, 0)
    assert lines[0].startswith("- MISSED") and "ratio 0.83" in lines[0]  # 1.0 > 0.7 x 1.2
    assert lines[1].startswith("- met")  # mean 0.5 <= 0.6
    assert lines[2].startswith("- MISSED")  # 50% < 90% of 60%


@pytest.mark.parametrize("workload", ["short-unique", "azure-conv", "azure-code"])
def test_non_repeating_workloads_are_held_within_5_percent_of_least_loaded(
    workload: str,
) -> None:
    def agg(p99: float) -> dict[str, dict[str, tuple[float, float, float]]]:
        other = {"ttft_mean_s": (0.5, 0.5, 0.5), "token_hit_rate": (0.0, 0.0, 0.0)}
        return {
            "expected_latency": {"ttft_p99_s": (p99, p99, p99), **other},
            "least_loaded": {"ttft_p99_s": (1.0, 1.0, 1.0), **other},
        }

    (line,) = verdicts(workload, agg(1.04), 0.0, 0)
    assert line.startswith("- met") and "within 5% of" in line
    assert verdicts(workload, agg(1.06), 0.0, 0)[0].startswith("- MISSED")


def test_verdicts_give_the_p99_ratio_seed_by_seed() -> None:
    def run(system: str, seed: int, p99: float, status: str = "ok") -> SystemRun:
        return SystemRun(system, seed, status, summary={"ttft_p99_s": p99})

    runs = [
        run("expected_latency", 0, 1.2),
        run("sglang-router:cache_aware", 0, 1.0),
        run("vllm-router:cache_aware", 0, 1.5),
        run("least_loaded", 0, 0.5),  # not a peer: kvgate's own strategy
        run("expected_latency", 1, 0.8),
        run("sglang-router:cache_aware", 1, 2.0),
        run("expected_latency", 2, 0.9),
        run("sglang-router:cache_aware", 2, 1.0, status="misconfigured"),  # does not count
    ]
    ratios = seed_p99_ratios(runs)
    assert ratios == pytest.approx([1.2, 0.4])
    agg = aggregate(runs)
    line = verdicts("shared-prefix", agg, 0.6, 0, seed_ratios=ratios)[0]
    assert line.endswith("seed by seed vs that seed's best peer: 1.20, 0.40 (median 0.80)")


def test_no_install_skips_an_absent_peer(tmp_path: Path) -> None:
    st = ensure_peer("sglang-router", tmp_path, install=False)
    assert not st.ok and "skipped" in st.message and not (tmp_path / "sglang-router").exists()


def test_bounds_are_ordered() -> None:
    w = build("shared-prefix", TextSource(), groups=4, prompts_per_group=3, system_tokens=256)
    b = workload_bounds(w, capacity_blocks=10_000)
    small = workload_bounds(w, capacity_blocks=20)
    # 8 of 12 prompts reuse a 256-token system prompt (+128-token question, template)
    assert 0.35 < b.infinite == b.fleet_lru < 0.5
    assert small.fleet_lru < b.fleet_lru
    assert math.isnan(b.ttft_floor_p99_s)  # no profile, no floor


def test_ttft_floor_is_each_request_alone_with_the_infinite_cache() -> None:
    prof = get_profile("8b-h100")
    w = build("shared-prefix", TextSource(), groups=2, prompts_per_group=50, system_tokens=512)
    b = workload_bounds(w, capacity_blocks=10_000, profile=prof)
    tok = LocalPromptTokenizer(builtin_tokenizer())
    lens = [len(tok.chat_sync(it.body("kvgate-sim-8b", stream=False))) for it in w.items]
    first: dict[str, int] = {}  # system prompt -> its group's first request (cold)
    for i, it in enumerate(w.items):
        assert it.messages is not None
        first.setdefault(str(it.messages[0]["content"]), i)
    assert len(first) == 2
    # every other request reuses its group's 512-token system prompt, so the two cold ones
    # have the two highest floors and the nearest-rank p99 of 100 is the lower of them
    cold = sorted(prof.ttft_alone(lens[i]) for i in first.values())
    assert b.ttft_floor_p99_s == pytest.approx(cold[0])
    warm = [prof.ttft_alone(n, 512) for i, n in enumerate(lens) if i not in first.values()]
    assert b.ttft_floor_mean_s <= (sum(cold) + sum(warm)) / len(lens)  # hits >= 512 tokens
    assert b.ttft_floor_mean_s > prof.prefill_overhead_s


def test_floor_note_says_when_a_target_is_out_of_reach() -> None:
    assert "unreachable for kvgate" in _floor_note(0.4, 0.578, "p99")
    assert "unreachable" not in _floor_note(0.7, 0.578, "p99")
    assert _floor_note(0.7, math.nan, "p99") == ""


@pytest.mark.slow
def test_bench_routers_kvgate_only(tmp_path: Path) -> None:
    out = tmp_path / "plots"
    js = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "routers",
         "--systems", "round_robin,least_loaded,expected_latency,vllm-router:cache_aware",
         "--workload", "shared-prefix", "--requests", "48", "--rate", "3", "--seeds", "0",
         "--time-scale", "0.2", "--no-install", "--peers-dir", str(tmp_path / "peers"),
         "--out", str(out), "--json", str(js),
         # the pipeline is under test, not the machine: on a busy CI host every run may lag
         # past the 5 ms, and with no valid run the bench exits non-zero
         "--lag-limit-ms", "1000"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(js.read_text())
    runs = {r["system"]: r for r in doc["runs"]}
    assert runs["vllm-router:cache_aware"]["status"].startswith("skipped")
    kv = [runs[n] for n in ("round_robin", "least_loaded", "expected_latency")]
    for r in kv:
        assert r["status"] in ("ok", "lag"), r  # warm-up got engine-reported hits
        assert r["summary"]["errors"] == 0 and r["summary"]["requests"] == 48
        assert sum(r["per_replica"]) == 48
        # every request's record, in workload order, agreeing with the summary
        assert [q[0] for q in r["requests"]] == list(range(48))
        assert all(q[1] is not None and q[1] > 0 for q in r["requests"])
        cached = sum(q[3] for q in r["requests"]) / sum(q[2] for q in r["requests"])
        assert cached == pytest.approx(r["summary"]["token_hit_rate"])
    hit = {r["system"]: r["summary"]["token_hit_rate"] for r in kv}
    assert hit["expected_latency"] > hit["round_robin"]
    bound = doc["bounds"]["0"]
    assert bound["infinite"] >= bound["fleet_lru"] >= max(hit.values())
    for name in ("round_robin", "least_loaded", "expected_latency"):
        assert f"| {name} |" in proc.stdout
    assert "vllm-router:cache_aware: skipped" in proc.stdout
    assert "### targets" in proc.stdout
    for p in ("ttft-cdf", "hit-rate", "load"):
        f = out / f"shared-prefix-{p}.png"
        assert f.exists() and f.stat().st_size > 1000


def test_the_benchmark_policy_declares_the_replicas_slots() -> None:
    """The gateway learns a replica's sequence slots from the policy (engines do not
    publish them): the benchmark and the demo must declare their profile's, or a 16-slot
    replica is scored as if it had 256 and never looks saturated."""
    from loadtest.harness import scaled_policy
    from policies.schema import parse_policy_text

    slots = get_profile("8b-h100").max_num_seqs
    pol = parse_policy_text(scaled_policy("least_loaded", 0.5, slots))
    assert pol.models.default.max_num_seqs == slots == 16
    assert pol.routing.strategy.value == "least_loaded"
    assert pol.cost.overhead_ms == pytest.approx(15.0)  # scaled with the time scale
    assert parse_policy_text(scaled_policy("random", 1.0)).models.default.max_num_seqs == 256


def test_mooncake_groups_keep_the_reuse_that_windows_lose() -> None:
    """Same size, same trace: 120 rows drawn whole prefix group at a time reuse far more
    than 120 consecutive rows (whose prefixes were mostly computed before the window)."""
    text = TextSource()
    window = make_workload("mooncake", 120, 4, 2.0, 0, text)
    groups = make_workload("mooncake-groups", 120, 4, 2.0, 0, text)
    assert len(window.items) == len(groups.items) == 120
    span = groups.items[-1].t - groups.items[0].t
    assert len(groups.items) / span == pytest.approx(2.0, rel=0.02)  # arrivals at the rate
    w_bound = workload_bounds(window, capacity_blocks=4 * 4096).infinite
    g_bound = workload_bounds(groups, capacity_blocks=4 * 4096).infinite
    assert w_bound < 0.1 < 0.4 < g_bound


def _report(ok: int, failed: int) -> ReplayReport:
    item = WorkItem(t=0.0, api="completions", max_tokens=4, prompt=" a b")
    results = []
    for i in range(ok + failed):
        r = RequestResult(i, item, 0.0, status=200 if i < ok else 500)
        if i < ok:
            r.ttft_s, r.e2e_s, r.replica = 0.1, 0.2, "r0"
            r.prompt_tokens, r.cached_tokens = 100, 50
        else:
            r.error = "upstream failed"
        results.append(r)
    return ReplayReport("w", results, wall_s=1.0, time_scale=1.0)


def _bench_result(report: ReplayReport, replicas: int = 2) -> SystemRun:
    fleet: Any = SimpleNamespace(endpoints=[SimpleNamespace(index=i) for i in range(replicas)])
    args: Any = SimpleNamespace(lag_limit_ms=LAG_LIMIT_MS)
    client: Any = None  # _result does no I/O
    bench = Bench(args, fleet, Path("."), TextSource(), {}, None, client)
    workload: Any = None
    return bench._result(System("expected_latency"), workload, report, [], [], [], 100)


def test_the_lag_limit_decides_a_runs_status() -> None:
    """A run whose loop-lag p99 (7.5 ms) is over the limit is `lag` at the issue's 5 ms and
    `ok` under a raised limit (the functional bench test's, on a shared machine)."""
    before = [{"lag_le_0.005": 0.0, "lag_le_0.0075": 0.0, "lag_le_inf": 0.0}]
    after = [{"lag_le_0.005": 90.0, "lag_le_0.0075": 100.0, "lag_le_inf": 100.0}]
    fleet: Any = SimpleNamespace(endpoints=[SimpleNamespace(index=0)])
    client: Any = None
    workload: Any = None
    status = {}
    for limit in (LAG_LIMIT_MS, 10.0):
        args: Any = SimpleNamespace(lag_limit_ms=limit)
        bench = Bench(args, fleet, Path("."), TextSource(), {}, None, client)
        run = bench._result(
            System("expected_latency"), workload, _report(ok=10, failed=0), before, after,
            [], 100,
        )  # fmt: skip
        status[limit] = (run.status, run.lag_p99_ms)
    assert status == {LAG_LIMIT_MS: ("lag", 7.5), 10.0: ("ok", 7.5)}


def test_a_run_with_failed_requests_does_not_count() -> None:
    """A run where requests failed replayed less load than the others and lost those
    requests' TTFTs: status `errors`, left out of the aggregate and the verdicts."""
    good = _bench_result(_report(ok=10, failed=0))
    assert good.status == "ok" and good.counts
    bad = _bench_result(_report(ok=9, failed=1))
    assert bad.status == "errors" and not bad.counts
    none = _bench_result(_report(ok=0, failed=10))
    assert none.status == "errors" and not none.counts
    assert aggregate([bad, none]) == {}
    assert verdicts("shared-prefix", aggregate([bad]), 0.0, 0) == [
        "- not evaluated: expected_latency has no valid run"
    ]


def test_imbalance_counts_a_replica_that_got_no_request() -> None:
    """All 10 requests on r0 of a 2-replica fleet: max/mean = 2, not 1 (ReplayReport's
    summary counted only the replicas that appeared; the demo relied on it)."""
    report = _report(ok=10, failed=0)
    assert report.summary()["load_imbalance"] == pytest.approx(1.0)  # r1 unknown to it
    assert report.summary(["r0", "r1"])["load_imbalance"] == pytest.approx(2.0)
    assert math.isnan(_report(ok=0, failed=3).summary(["r0", "r1"])["load_imbalance"])


def test_json_is_strict_nan_and_infinity_become_null() -> None:
    doc = json.loads(json_text({"a": math.nan, "b": [1.5, math.inf], "c": {"d": -math.inf}}))
    assert doc == {"a": None, "b": [1.5, None], "c": {"d": None}}


def _kvgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--requests", "-3"],
        ["--requests", "0"],
        ["--rate", "0"],
        ["--rate", "-2"],
        ["--load", "0"],
        ["--time-scale", "0"],
        ["--time-scale", "-0.5"],
        ["--replicas", "0"],
        ["--replicas", "x"],
        ["--blocks", "0"],
        ["--profile", "nope"],
        ["--seeds", ""],
        ["--seeds", "0,x"],
        ["--systems", ","],
        ["--systems", "bogus"],
        ["--json", "/dev/null/x/bench.json"],
        ["--json", "/tmp"],
        ["--out", "/dev/null/plots"],
    ],
)
def test_bad_bench_routers_arguments_are_one_line_errors_before_the_fleet(
    args: list[str],
) -> None:
    proc = _kvgate("bench", "routers", "--no-install", "--systems", "round_robin", *args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == ""  # no peer line, no calibration, no fleet
    assert proc.stderr.strip().splitlines()[-1].startswith("kvgate bench routers: error: ")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_failed_requests_make_no_valid_run_and_json_to_stdout_is_parseable(
    tmp_path: Path,
) -> None:
    """100 blocks x 16 tokens cannot hold a 2k-token prompt: every request fails. The runs
    are `errors`, no target is judged on them, the exit code says no valid run is left;
    `--json -` puts only strict JSON on stdout; a seed given twice runs once."""
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "routers",
         "--systems", "expected_latency,least_loaded", "--seeds", "0,0", "--replicas", "2",
         "--requests", "4", "--rate", "3", "--blocks", "100", "--time-scale", "0.2",
         "--no-install", "--peers-dir", str(tmp_path / "peers"), "--json", "-"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # strict: no NaN, no markdown before or after
    assert doc["seeds"] == [0]
    assert [r["status"] for r in doc["runs"]] == ["errors", "errors"]
    for r in doc["runs"]:
        assert r["summary"]["errors"] == 4 and r["summary"]["ttft_p99_s"] is None
    assert not any(v.startswith("- met") for v in doc["verdicts"])
    assert "| expected_latency |" in proc.stderr  # the tables went to stderr
    assert "no valid run" in proc.stderr


# ------------------------------------------------------------------ the demo and the fleet


def test_the_demo_counts_a_replica_that_got_no_request(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo passes its fleet's replica ids: 10 requests all on r0 of r0..r3 is an
    imbalance of 4.00 (it printed 1.00: only the replicas seen were counted)."""
    from loadtest.demo import _print_comparison

    results = [("round_robin", _report(10, 0)), ("expected_latency", _report(10, 0))]
    _print_comparison(results, ["r0", "r1", "r2", "r3"])
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| round_robin")]
    assert rows and rows[0].split("|")[11].strip() == "4.00", rows


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "70000"],
        ["--port", "0"],
        ["--serve", "2"],
        ["--serve", "yes"],
        ["--time-scale", "0"],
        ["--requests", "0"],
    ],
)
def test_bad_demo_arguments_are_one_line_errors(args: list[str]) -> None:
    proc = _kvgate("demo", *args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == ""  # no fleet started
    assert proc.stderr.strip().splitlines()[-1].startswith("kvgate demo: error: argument ")


def test_a_replica_that_exits_early_says_why(tmp_path: Path) -> None:
    """The fleet's log is usually a temporary file deleted with the error's context: the
    error carries its last lines (here the replica's own argparse error)."""
    from cachecore.replica.fleet import launch_fleet

    with (
        pytest.raises(RuntimeError, match="exited with code 2") as exc,
        launch_fleet(1, ["--profile", "nope"], log_path=tmp_path / "fleet.log", timeout_s=20),
    ):
        pass
    assert "invalid choice: 'nope'" in str(exc.value)


def test_a_replica_that_never_gets_ready_shows_its_log(tmp_path: Path) -> None:
    import subprocess

    from cachecore.replica.fleet import _wait_ready_lines

    log = tmp_path / "fleet.log"
    log.write_text("loading the tokenizer ...\n")
    proc = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(TimeoutError, match="no ready line") as exc:
            _wait_ready_lines([proc], log, timeout_s=0.2)
        assert "loading the tokenizer" in str(exc.value)
    finally:
        proc.kill()
        proc.wait()


def test_the_summary_counts_only_the_seeds_whose_run_counts() -> None:
    ok = _bench_result(_report(ok=10, failed=0))
    bad = _bench_result(_report(ok=9, failed=1))
    ok.seed, bad.seed = 0, 1
    runs = [ok, bad]
    table = summary_table(aggregate(runs), Counter(r.system for r in runs if r.counts))
    assert "| expected_latency | 1 |" in table


def test_a_lagging_run_is_rejected_from_the_summary_and_the_targets() -> None:
    """The issue's rule: a run whose replicas' loop lag p99 exceeded 5 ms is rejected. Its
    TTFTs measure a CPU-starved machine, so they must not move the summary, the per-seed
    ratios or a verdict (here the lagging peer run would otherwise make the p99 target
    pass)."""
    el, peer, lagging = (_bench_result(_report(ok=10, failed=0)) for _ in range(3))
    peer.system = lagging.system = "sglang-router:cache_aware"
    el.seed, peer.seed, lagging.seed = 0, 0, 1
    lagging.status = "lag"
    lagging.summary["ttft_p99_s"] = 50.0
    runs = [el, peer, lagging]
    assert not lagging.counts
    agg = aggregate(runs)
    assert agg["sglang-router:cache_aware"]["ttft_p99_s"][0] == pytest.approx(0.1)
    assert seed_p99_ratios(runs) == [pytest.approx(1.0)]
    out = verdicts("shared-prefix", agg, 0.5, lag_flagged=1)
    assert out[0].startswith("- MISSED: expected_latency TTFT p99")
    assert "rejected" in out[-1]


async def test_a_lagging_run_is_rerun_on_its_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run rejected for loop lag is run again (``--lag-retries``) on the same seed, so the
    summary compares every system over the same seeds; the other systems keep their runs,
    and a system that lags on every try keeps its ``lag`` status."""
    calls: list[tuple[str, int]] = []
    lag_plan = {"expected_latency": [True, False], "sglang-router:cache_aware": [True, True]}

    def fake_run(name: str) -> SystemRun:
        n = sum(1 for c in calls if c[0] == name)
        calls.append((name, n))
        plan = lag_plan.get(name, [])
        lagging = n < len(plan) and plan[n]
        return SystemRun(name, -1, "lag" if lagging else "ok", {}, lag_p99_ms=10.0)

    async def kvgate_block(self: Bench, block: Any, workload: Any) -> list[SystemRun]:
        return [fake_run(s.name) for s in block]

    async def peer(self: Bench, system: System, workload: Any) -> SystemRun:
        return fake_run(system.name)

    monkeypatch.setattr(Bench, "run_kvgate_block", kvgate_block)
    monkeypatch.setattr(Bench, "run_peer", peer)
    systems = parse_systems("round_robin,expected_latency,sglang-router:cache_aware")
    args: Any = SimpleNamespace(lag_retries=1)
    fleet: Any = SimpleNamespace(endpoints=[])
    workloads: Any = {7: SimpleNamespace(items=[]), 8: SimpleNamespace(items=[])}
    runs = await _bench(args, systems, fleet, Path("."), {}, None, workloads)
    got = {(r.system, r.seed): (r.status, r.lag_retries) for r in runs}
    assert len(runs) == 6
    assert got[("round_robin", 7)] == ("ok", 0)
    assert got[("expected_latency", 7)] == ("ok", 1)  # rerun once, then valid
    assert got[("sglang-router:cache_aware", 7)] == ("lag", 1)  # lagged again: rejected
    assert all(got[(s.name, 8)] == ("ok", 0) for s in systems)
    assert calls.count(("expected_latency", 1)) == 1


async def test_kv_aware_placement_check_marks_the_run() -> None:
    """After a kv_aware run: a hit in the warm-up keeps it; no hit in the warm-up makes it
    misconfigured even when the run had hits (the rule is about the warm-up, read before the
    run) and when it also lagged (a lag rerun cannot fix a router that never sees events); a
    metrics endpoint that fails makes this run failed instead of aborting the benchmark."""
    answers = {
        1: (200, 'vllm_router_kv_placement_lookups_total{result="hit"} 4\n'),
        2: (200, 'vllm_router_kv_placement_lookups_total{result="miss"} 7\n'),
        3: (503, "down"),
    }

    def handler(req: httpx.Request) -> httpx.Response:
        code, text = answers[int(req.url.port or 0) - 40000]
        return httpx.Response(code, text=text)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        args: Any = SimpleNamespace()
        fleet: Any = SimpleNamespace(endpoints=[])
        bench = Bench(args, fleet, Path("."), TextSource(), {}, None, client)
        cases = [
            ("ok", 40001, {"hit": 1.0, "miss": 1.0}),
            ("ok", 40001, {"miss": 6.0}),  # the run's 4 hits came after a warm-up of misses
            ("lag", 40002, {"miss": 6.0}),
            ("ok", 40003, {"hit": 1.0}),
            ("ok", 40001, None),  # unreadable after the warm-up
        ]
        runs = [SystemRun("vllm-router:kv_aware", -1, st, {}) for st, _, _ in cases]
        for run, (_, port, warm) in zip(runs, cases, strict=True):
            await bench._check_placement(run, port, warm)
    assert runs[0].status == "ok" and runs[0].summary["kv_placement_hit"] == 4.0
    assert runs[0].summary["kv_placement_warmup_hit"] == 1.0
    assert runs[1].status == "misconfigured"
    assert runs[2].status == "misconfigured"
    assert runs[3].status.startswith("failed: placement lookups unreadable")
    assert runs[4].status.startswith("failed: placement lookups unreadable after the warm-up")


async def test_a_kv_aware_warm_up_goes_on_until_its_index_credits_a_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vllm-router kv_aware replays every replica's buffered event history when it starts and
    applies live events only after it: on a fleet that had served ten runs before (mooncake,
    2026-12-07, seed 2) all six warm-up lookups missed and the run was dropped as
    misconfigured although its events worked. The warm-up goes on, one request at a time,
    until the index credits a lookup; the time limit ends it for a router that never does."""
    sent: list[str] = []

    async def fake_replay(
        w: Any, base: str, model: str, keys: Any, time_scale: float = 1.0
    ) -> ReplayReport:
        sent.append(w.name)
        return _report(ok=len(w.items), failed=0)  # 50 cached tokens a request

    async def no_scrape(client: Any, urls: Any) -> list[dict[str, float]]:
        return []

    async def no_load(client: Any, urls: Any, t0: float, out: Any, stop: Any) -> None:
        await stop.wait()

    def result(self: Bench, system: System, *rest: Any) -> SystemRun:
        return SystemRun(system.name, -1, "ok", {}, warm_hits=rest[-1])

    monkeypatch.setattr(bench_routers, "replay", fake_replay)
    monkeypatch.setattr(bench_routers, "scrape", no_scrape)
    monkeypatch.setattr(bench_routers, "_sample_load", no_load)
    monkeypatch.setattr(Bench, "_result", result)
    args: Any = SimpleNamespace(time_scale=1.0)
    fleet: Any = SimpleNamespace(urls=["http://r0", "http://r1"])  # 4 warm-up requests
    client: Any = None
    bench = Bench(args, fleet, Path("."), TextSource(), {}, None, client)
    workload: Any = SimpleNamespace(name="run", items=())
    system = System("vllm-router:kv_aware")

    async def prepare() -> None:
        return None

    asked = 0

    async def index_warm() -> bool:  # the index credits its third look-up
        nonlocal asked
        asked += 1
        return asked >= 3

    run = await bench.measure(system, "http://router", workload, None, prepare, index_warm)
    assert sent == ["warmup"] * 6 + ["run"] and asked == 3
    assert run.warm_hits == 6 * 50

    async def never() -> bool:
        return False

    sent.clear()
    monkeypatch.setattr(bench_routers, "INDEX_WARMUP_TIMEOUT_S", 0.0)
    await bench.measure(system, "http://router", workload, None, prepare, never)
    assert sent == ["warmup"] * 4 + ["run"]


def test_placement_lookups_are_counted_by_result() -> None:
    text = (
        "# TYPE vllm_router_kv_placement_lookups_total counter\n"
        'vllm_router_kv_placement_lookups_total{result="hit"} 5\n'
        'vllm_router_kv_placement_lookups_total{result="miss"} 2\n'
        "# TYPE vllm_router_requests_total counter\n"
        'vllm_router_requests_total{route="/v1/completions"} 7\n'
    )
    assert placement_lookups(text) == {"hit": 5.0, "miss": 2.0}
    assert placement_lookups("") == {}


def test_the_harness_installs_the_peer_versions_peers_md_was_verified_with() -> None:
    """`kvgate bench routers` installed the newest release of each peer while docs/peers.md
    pins the versions its flags, topics and routing were verified with: a release that
    renamed a flag would have made a peer "misconfigured" in one run and not in another."""
    import re

    from loadtest.peers import PACKAGES

    text = (Path(__file__).resolve().parents[1] / "docs" / "peers.md").read_text()
    pinned = dict(re.findall(r"pip install ((?:vllm|sglang)-router)==([\w.]+)", text))
    assert set(pinned) == set(PACKAGES)
    for name, spec in PACKAGES.items():
        assert spec == f"{name}=={pinned[name]}", (name, spec, pinned[name])
