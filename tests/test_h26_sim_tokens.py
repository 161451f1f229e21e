"""kvgate simulate's throughput columns say which tokens they count (review R1, E6)."""

from loadtest.simulate import SimResult, format_rows


def _result() -> SimResult:
    # 1,000 prompt tokens of which 900 were cache hits, 100 generated, in 2 wall seconds
    return SimResult(
        strategy="expected_latency",
        replicas=2,
        requests=4,
        sim_seconds=20.0,
        wall_seconds=2.0,
        prompt_tokens=1000,
        cached_tokens=900,
        generated_tokens=100,
        ttft=[0.1, 0.2],
        e2e=[1.0, 2.0],
        decision_us=[10.0, 20.0],
        per_replica_requests=[2, 2],
    )


def test_computed_tokens_leave_out_the_cache_hits() -> None:
    row = _result().row()
    assert row["tokens_per_wall_s"] == 550.0  # every prompt token + output, over wall time
    assert row["computed_tokens_per_wall_s"] == 100.0  # 100 uncached prompt + 100 generated


def test_the_table_names_both_columns() -> None:
    res = _result()
    table = format_rows([(res, res.row())])
    header, rule, line = table.splitlines()
    assert "prompt+output tokens/wall s" in header and "computed tokens/wall s" in header
    assert header.count("|") == rule.count("|") == line.count("|")
    assert line.rstrip().endswith("| 550 | 100 |")
