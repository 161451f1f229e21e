from __future__ import annotations

import math

import pytest

from cachecore.tiers import (
    DATASHEET_H100,
    LLAMA3_8B,
    LLAMA3_70B,
    TierLink,
    break_even_bandwidth,
    load_ms_per_token,
    measure_copy_link,
    measure_matmul_flops,
    min_tokens_worth_loading,
)


def test_kv_bytes_per_token_match_the_facts_sheet() -> None:
    assert LLAMA3_8B.kv_bytes_per_token == 131_072
    assert LLAMA3_70B.kv_bytes_per_token == 327_680


def test_break_even_arithmetic_h100() -> None:
    # facts sheet: ~4 GB/s for 8B and ~1.2 GB/s for 70B at 50% of ~1000 TFLOP/s (dense term)
    t8 = 2 * LLAMA3_8B.params / DATASHEET_H100.flops
    t70 = 2 * LLAMA3_70B.params / DATASHEET_H100.flops
    assert 3.5e9 < break_even_bandwidth(LLAMA3_8B, t8) < 4.5e9
    assert 1.0e9 < break_even_bandwidth(LLAMA3_70B, t70) < 1.3e9


def test_min_tokens_worth_loading() -> None:
    t_tok = 40e-6
    fast = TierLink("fast", 50e9, 1e-3, False)
    slow = TierLink("slow", 1e9, 1e-3, False)
    n = min_tokens_worth_loading(LLAMA3_8B, fast, t_tok)
    # at n* loading and recomputing cost the same
    load = n * LLAMA3_8B.kv_bytes_per_token / fast.bandwidth_bytes_s + fast.fixed_s
    assert math.isclose(load, n * t_tok, rel_tol=1e-9)
    assert math.isinf(min_tokens_worth_loading(LLAMA3_8B, slow, t_tok))
    assert load_ms_per_token(LLAMA3_8B, fast) == LLAMA3_8B.kv_bytes_per_token / 50e9 * 1e3


def test_measurements_run_with_torch() -> None:
    assert measure_matmul_flops(n=128, repeat=2) > 1e6
    link = measure_copy_link(nbytes=1 << 20, repeat=2)
    assert link.bandwidth_bytes_s > 1e7 and link.fixed_s > 0


def _bench_tiers(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    import argparse

    from cachecore import tiers

    parser = argparse.ArgumentParser(prog="kvgate bench tiers")
    tiers.configure(parser)
    code = tiers.run(parser.parse_args(list(argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (("--gemm", "0"), "--gemm must be > 0"),
        (("--gemm", "-8"), "--gemm must be > 0"),
        # a 360 GB matrix: torch's allocation RuntimeError was a traceback
        (("--gemm", "300000"), "--gemm 300000: cannot run the GEMM"),
        (("--context", "-100000"), "--context must be >= 0"),
        (("--redis", "redis://127.0.0.1:1/0"), "--redis: "),  # nothing listens on port 1
        (("--redis", "http://127.0.0.1:1"), "--redis: "),  # a scheme redis-py refuses
    ],
)
def test_bad_input_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], why: str
) -> None:
    code, out, err = _bench_tiers(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"kvgate bench tiers: {why}") and err.count("\n") == 1
