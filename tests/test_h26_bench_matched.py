"""R1's E5 (twenty-sixth session): the targets compare means over the same seeds. A run
rejected on one seed (lag twice, errors, misconfigured) left expected_latency's mean over
seeds 0-1 compared with a peer's over 0-2, so a hard seed kept on one side only decided the
verdict."""

from __future__ import annotations

from loadtest.bench_routers import (
    Bounds,
    SystemRun,
    aggregate,
    judged_verdicts,
    matched_seeds,
    summary_table,
)


def run(system: str, seed: int, p99: float, status: str = "ok", hit: float = 0.7) -> SystemRun:
    summary = {
        "token_hit_rate": hit, "ttft_mean_s": p99 / 3, "ttft_p50_s": 0.1, "ttft_p99_s": p99,
        "e2e_p99_s": 5.0, "throughput_rps": 7.0, "load_imbalance": 1.1, "cached_pred_error": 0.0,
    }  # fmt: skip
    return SystemRun(system, seed, status, summary)


BOUNDS = {s: Bounds(0.8, b, 16384) for s, b in ((0, 0.5), (1, 0.5), (2, 0.9))}


def test_a_seed_rejected_for_one_system_is_left_out_of_every_comparison() -> None:
    """R1's case: seed 2 is hard for everyone; expected_latency's run of it lagged twice.
    Over the mismatched seeds 0.9 s against the peer's 1.33 s read 0.68x, 'met'; over the
    two seeds both ran it is 0.90x."""
    runs = [
        run("expected_latency", 0, 0.9), run("expected_latency", 1, 0.9),
        run("expected_latency", 2, 1.8, "lag"),
        run("vllm-router:kv_aware", 0, 1.0), run("vllm-router:kv_aware", 1, 1.0),
        run("vllm-router:kv_aware", 2, 2.0),
    ]  # fmt: skip
    assert matched_seeds("shared-prefix", runs) == ([0, 1], [2])
    ver = judged_verdicts("shared-prefix", runs, BOUNDS)
    assert ver[0].startswith("- note: judged on seeds 0, 1") and "seed(s) 2 left out" in ver[0]
    p99 = next(v for v in ver if "TTFT p99" in v)
    assert p99.startswith("- MISSED") and "ratio 0.90" in p99
    # the bound over the judged seeds too: 0.7 against 90% of 0.5, not of the mean 0.63
    hit = next(v for v in ver if "hit rate" in v)
    assert hit.startswith("- met") and "(50.0% -> 45.0%)" in hit


def test_every_seed_valid_judges_them_all_without_a_note() -> None:
    runs = [
        run(s, k, p)
        for k in range(3)
        for s, p in (("expected_latency", 0.6), ("least_loaded", 1.0))
    ]
    assert matched_seeds("hot-prefix", runs) == ([0, 1, 2], [])
    ver = judged_verdicts("hot-prefix", runs, BOUNDS)
    assert len(ver) == 1 and ver[0].startswith("- met") and "ratio 0.60" in ver[0]


def test_a_system_with_no_valid_run_removes_no_seed() -> None:
    """A peer misconfigured on every seed is compared with nothing (the verdicts use the
    peers that ran), so it cannot empty the judged seeds."""
    runs = [run("expected_latency", k, 0.6) for k in range(2)]
    runs += [run("sglang-router:cache_aware", k, 1.0, "misconfigured") for k in range(2)]
    runs += [run("vllm-router:kv_aware", k, 1.0) for k in range(2)]
    assert matched_seeds("mooncake", runs) == ([0, 1], [])


def test_no_seed_in_common_is_said_not_judged() -> None:
    runs = [run("expected_latency", 0, 0.6), run("expected_latency", 1, 0.6, "lag")]
    runs += [run("least_loaded", 0, 1.0, "errors"), run("least_loaded", 1, 1.0)]
    assert judged_verdicts("short-unique", runs, BOUNDS) == [
        "- not evaluated: no seed where expected_latency and every system it is compared "
        "with have a valid run"
    ]
    lag_only = [run("expected_latency", 0, 0.6, "lag"), run("least_loaded", 0, 1.0)]
    assert judged_verdicts("short-unique", lag_only, BOUNDS) == [
        "- not evaluated: expected_latency has no valid run"
    ]


def test_the_summary_over_seeds_has_the_issues_figures() -> None:
    """R1's N4: the per-seed tables had prefill tokens and TTFT p90, the summary over seeds
    (the figures quoted as results) had neither."""
    runs = [run("expected_latency", k, 0.6) for k in range(2)]
    for r, (prefill, p90) in zip(runs, ((1200.0, 0.30), (1800.0, 0.50)), strict=True):
        r.summary.update(prefill_tokens=prefill, ttft_p90_s=p90)
    table = summary_table(aggregate(runs), 2)
    head, _, row = table.splitlines()
    cells = dict(zip(head.split(" | "), row.split(" | "), strict=True))
    assert cells["prefill tokens"] == "1,500 (1,200–1,800)"
    assert cells["TTFT p90 s"] == "0.400 (0.300–0.500)"
