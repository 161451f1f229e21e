"""The schedule floor: exact on schedules worked by hand, and below what every routing
strategy of the simulator (the same engine model) actually achieves."""

from __future__ import annotations

import asyncio
import math

import pytest

from cachecore.engine.latency import get_profile
from gateway.routing import Strategy
from loadtest.bench_routers import BLOCK_SIZE, workload_bounds
from loadtest.schedule_floor import (
    PrefillJob,
    deficit_s,
    percentile_exceptions,
    prefill_jobs,
    schedule_floor_percentile_s,
    schedule_floor_s,
)
from loadtest.simulate import FleetSimulator, SimConfig, scaled_workload
from loadtest.workloads import TextSource
from policies.schema import builtin_policy_path, load_policy

OH = 0.030  # one step overhead
TOL = 0.0006  # the bisection's resolution, and a hair


def test_one_request_alone_is_its_overhead_plus_its_prefill() -> None:
    got = schedule_floor_s([PrefillJob(5.0, 0.5)], replicas=1, overhead_s=OH)
    assert 0.53 - TOL <= got <= 0.53


def test_simultaneous_requests_share_the_replicas_as_mcnaughton_says() -> None:
    # five 0.5 s prefills at once on four replicas: preemptive optimum 5 x 0.5 / 4
    five = [PrefillJob(0.0, 0.5) for _ in range(5)]
    assert OH + 0.625 - TOL <= schedule_floor_s(five, 4, OH) <= OH + 0.625
    # one of them may be late: the other four run side by side
    assert OH + 0.5 - TOL <= schedule_floor_s(five, 4, OH, exceptions=1) <= OH + 0.5
    # eight on four: two each, one after the other
    eight = [PrefillJob(0.0, 0.5) for _ in range(8)]
    assert OH + 1.0 - TOL <= schedule_floor_s(eight, 4, OH) <= OH + 1.0


def test_no_request_runs_on_two_replicas_at_once() -> None:
    # a 1 s prefill alone on eight replicas still takes 1 s (plus the overhead)
    assert OH + 1.0 - TOL <= schedule_floor_s([PrefillJob(0.0, 1.0)], 8, OH) <= OH + 1.0


def test_spaced_arrivals_do_not_queue() -> None:
    jobs = [PrefillJob(float(i), 0.4 + 0.1 * (i % 2)) for i in range(6)]  # 1 s apart, one replica
    assert OH + 0.5 - TOL <= schedule_floor_s(jobs, 1, OH) <= OH + 0.5


def test_the_dropped_request_is_a_whole_request() -> None:
    # twenty 0.5 s prefills on one replica, each 0.52 s apart: no queue, except that one
    # 2 s prefill lands in the middle. Dropping it restores 0.53 s; spreading "one request's
    # worth" of lateness over its neighbours (a relaxation by work) would not be a bound on
    # the percentile, and the floor must not go below what dropping one request gives
    jobs = [PrefillJob(0.52 * i, 0.5) for i in range(20)] + [PrefillJob(5.0, 2.0)]
    assert OH + 0.5 - TOL <= schedule_floor_s(jobs, 1, OH, exceptions=1) <= OH + 0.5
    assert schedule_floor_s(jobs, 1, OH) > 2.0


def test_deficit_is_the_work_that_cannot_fit() -> None:
    jobs = [PrefillJob(0.0, 0.5) for _ in range(3)]  # 1.5 s of work, windows of 0.5 s
    assert deficit_s(jobs, 1, OH, OH + 0.5) == pytest.approx(1.0, abs=1e-5)
    assert deficit_s(jobs, 3, OH, OH + 0.5) == pytest.approx(0.0, abs=1e-5)
    assert deficit_s(jobs, 3, OH, OH) == pytest.approx(1.5, abs=1e-5)


def test_percentile_exceptions_match_the_nearest_rank() -> None:
    assert percentile_exceptions(120, 99) == 1
    assert percentile_exceptions(100, 99) == 1
    assert percentile_exceptions(99, 99) == 0
    assert percentile_exceptions(600, 99) == 6
    assert percentile_exceptions(1, 99) == 0


def test_prefill_jobs_take_the_profile_per_token_time() -> None:
    prof = get_profile("8b-h100")
    (job,) = prefill_jobs([1.0], [2000], prof)
    assert job.work_s == pytest.approx(2000 * prof.prefill_per_token_s)
    with pytest.raises(ValueError):
        prefill_jobs([1.0, 2.0], [1], prof)
    assert math.isnan(schedule_floor_s([], 4, OH))


@pytest.mark.parametrize(
    "workload,rate",
    [("shared-prefix", 9.0), ("shared-prefix", 14.0), ("short-unique", 40.0)],
)
def test_no_simulated_strategy_beats_the_floor(workload: str, rate: float) -> None:
    """The floor is a bound on every router with the engine model it relaxes: each strategy
    of the simulator, on the same requests at the same times, has a TTFT p99 at or above it
    (and so at or above the alone floor, which it also is)."""
    text, replicas = TextSource(), 4
    prof = get_profile("8b-h100")
    w = scaled_workload(workload, 120, replicas, rate, 3, text)
    b = workload_bounds(w, 4096 * replicas, prof, replicas)
    assert b.schedule_floor_p99_s >= b.ttft_floor_p99_s - TOL
    policy = load_policy(builtin_policy_path("default"))
    for strategy in (Strategy.EXPECTED_LATENCY, Strategy.LEAST_LOADED, Strategy.ROUND_ROBIN):
        cfg = SimConfig(
            replicas=replicas, profile="8b-h100", num_blocks=4096, block_size=BLOCK_SIZE,
            strategy=strategy,
        )  # fmt: skip
        res = asyncio.run(FleetSimulator(cfg, policy, w).run())
        assert res.row()["ttft_p99"] >= b.schedule_floor_p99_s, strategy


def test_the_floor_rises_with_the_queue_it_forces() -> None:
    """At a rate far past the fleet's capacity the arrivals alone force queueing: the
    schedule floor is then above the alone floor, and it never falls as the rate rises."""
    text, prof = TextSource(), get_profile("8b-h100")
    floors = []
    for rate in (4.0, 16.0, 64.0):
        w = scaled_workload("shared-prefix", 120, 4, rate, 1, text)
        b = workload_bounds(w, 4096 * 4, prof, 4)
        floors.append(b.schedule_floor_p99_s)
        assert (
            schedule_floor_percentile_s(
                prefill_jobs([it.t for it in w.items], [1] * len(w.items), prof), 4, OH, 99
            )
            <= OH + prof.prefill_per_token_s + TOL
        )
    assert floors[0] <= floors[1] + TOL <= floors[2] + 2 * TOL
    w = scaled_workload("shared-prefix", 120, 4, 64.0, 1, text)
    b = workload_bounds(w, 4096 * 4, prof, 4)
    assert b.schedule_floor_p99_s > b.ttft_floor_p99_s + 0.5


def test_the_verdict_takes_the_sharper_floor() -> None:
    from loadtest.bench_routers import Bounds

    assert Bounds(0.5, 0.4, 10, 0.578, 0.1, 0.723).p99_floor_s == 0.723
    assert Bounds(0.5, 0.4, 10, 0.578, 0.1, 0.577).p99_floor_s == 0.578
    assert Bounds(0.5, 0.4, 10, 0.578, 0.1).p99_floor_s == 0.578  # no schedule floor
    assert math.isnan(Bounds(0.5, 0.4, 10).p99_floor_s)


def test_the_infinite_cache_holds_the_block_with_a_prompts_last_token() -> None:
    """The engine caches every full block of a prompt, the one holding its last token too
    (only its own hit is capped): a 32-token prompt leaves 2 blocks that a 33-token
    extension hits. The bounds counted 1 (the review's counterexample, where every
    simulated strategy then beat both floors)."""
    from cachecore.tokenizer import builtin_tokenizer
    from cachecore.traceanalysis import lru_bound
    from gateway.tokenization import LocalPromptTokenizer
    from loadtest.bench_routers import request_blocks
    from loadtest.harness import MODEL
    from loadtest.workloads import WorkItem, Workload

    text, tok = TextSource(), LocalPromptTokenizer(builtin_tokenizer())

    def n_tokens(prompt: str) -> int:
        return len(tok.completion_sync({"model": MODEL, "prompt": prompt, "max_tokens": 1}))

    short = next(p for n in range(16, 40) if n_tokens(p := text.block("cap", n)) == 32)
    longer = short + text.block("cap-next", 1)
    assert n_tokens(longer) == 33
    w = Workload(
        "cap",
        (
            WorkItem(t=0.0, api="completions", max_tokens=1, prompt=short),
            WorkItem(t=1.0, api="completions", max_tokens=1, prompt=longer),
        ),
    )
    reqs = request_blocks(w)
    assert [len(r.keys) for r in reqs] == [2, 2]
    assert lru_bound(reqs, None).request_hits == (0, 32)  # the first: capped at 1 block


def test_work_beyond_the_solvers_32_bit_microseconds() -> None:
    # 3,000 s of prefill (past 2^31 us): the flow runs in a coarser unit instead of failing
    jobs = [PrefillJob(0.0, 300.0) for _ in range(10)]
    got = schedule_floor_s(jobs, 4, OH)
    assert OH + 750.0 - 0.01 <= got <= OH + 750.0  # McNaughton: 10 x 300 s / 4
    assert deficit_s(jobs, 4, OH, OH + 700.0) == pytest.approx(200.0, abs=0.01)
