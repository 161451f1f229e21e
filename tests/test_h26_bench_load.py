"""R1's E1 (twenty-sixth session): ``kvgate bench routers``' load points are fractions of the
knee of the workload each seed runs, not of a 200-request probe's."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from loadtest.bench_routers import (
    BLOCK_SIZE,
    _rates_text,
    configure,
    make_workload,
    seed_rates,
)
from loadtest.simulate import SimConfig, calibrate_capacity
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(["--no-install", "--systems", "least_loaded", *argv])


def _own_knee(workload: str, requests: int, seed: int, rate: float, text: TextSource) -> float:
    """least_loaded's burst throughput on the very workload the run replays (built at the
    rate it is offered), independently of the benchmark's calibration."""
    w = make_workload(workload, requests, 4, rate, seed, text)
    cfg = SimConfig(replicas=4, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE)
    pol = load_policy(builtin_policy_path("default"))
    return asyncio.run(calibrate_capacity(cfg, pol, w, text, requests))


@pytest.mark.parametrize("requests", [120, 600])
def test_each_seed_is_offered_the_load_of_its_own_workloads_knee(requests: int) -> None:
    """shared-prefix has a fixed number of prefix groups, so its capacity grows with the
    request count (R1: ~7.5 req/s at 120, ~13.9 at 600, against the 200-request probe's 8.9
    that every count used to get): 85% must be 85% of the measured workload's own knee."""
    text = TextSource()
    args = _args("--workload", "shared-prefix", "--requests", str(requests), "--seeds", "0,1")
    rates, knees = seed_rates(args, args.seeds, text)
    assert set(rates) == set(knees) == {0, 1}
    for s in (0, 1):
        own = _own_knee("shared-prefix", requests, s, rates[s], text)
        assert knees[s] == pytest.approx(own, rel=1e-9)
        assert rates[s] == pytest.approx(0.85 * own, rel=1e-9)


def test_the_knee_follows_the_request_count() -> None:
    text = TextSource()
    small = seed_rates(_args("--requests", "120", "--seeds", "0"), [0], text)[0][0]
    large = seed_rates(_args("--requests", "600", "--seeds", "0"), [0], text)[0][0]
    assert large > 1.5 * small  # 25 requests per cold prefix cost far less each than 5


def test_a_given_rate_is_every_seeds_rate_and_no_knee() -> None:
    rates, knees = seed_rates(_args("--rate", "3", "--seeds", "0,2"), [0, 2], TextSource())
    assert rates == {0: 3.0, 2: 3.0} and knees == {0: None, 2: None}


@pytest.mark.parametrize(
    "workload", ["shared-prefix", "hot-prefix", "short-unique", "long-prefix-pressure", "rag"]
)
def test_a_workloads_requests_do_not_depend_on_its_rate(workload: str) -> None:
    """The knee is taken on the workload built at a burst rate; the run replays it built at
    its offered rate: the same requests in the same order only if the rate changes nothing
    but the arrival times."""
    text = TextSource()
    a = make_workload(workload, 60, 4, 1e6, 1, text)
    b = make_workload(workload, 60, 4, 2.5, 1, text)
    assert [(x.messages, x.prompt, x.tenant, x.max_tokens) for x in a.items] == [
        (x.messages, x.prompt, x.tenant, x.max_tokens) for x in b.items
    ]


def test_the_header_names_each_seeds_rate_and_knee() -> None:
    args = argparse.Namespace(load=0.85)
    two = _rates_text(args, {0: 6.336, 1: 6.544}, {0: 7.454, 1: 7.699})
    assert two == "85% of each seed's least_loaded knee (6.34, 6.54 req/s)"
    assert _rates_text(args, {0: 6.336}, {0: 7.454}) == (
        "6.34 req/s = 85% of its least_loaded knee 7.45"
    )
    assert _rates_text(args, {0: 3.0, 1: 3.0}, {0: None, 1: None}) == "3.00 req/s"
