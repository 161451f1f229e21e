"""The expected-latency cost model: hit cap, tier split, cost terms, online fit."""

from __future__ import annotations

import math
import random
from dataclasses import fields, replace

import pytest

from cachecore.index.base import PrefixMatch, empty_match
from cachecore.lifecycle import Tier
from cachecore.scoring import (
    FEATURES,
    Coefficients,
    LoadView,
    OnlineFit,
    cost,
    dot,
    features,
    hit_cap_blocks,
    predict_hit,
)

C = Coefficients()


def gpu_match(blocks: int, pending: int | None = None) -> PrefixMatch:
    tiers = {Tier.GPU: blocks, Tier.CPU: 0, Tier.DISK: 0, Tier.REMOTE: 0}
    return PrefixMatch(tiers, blocks, blocks if pending is None else pending)


@pytest.mark.parametrize(
    ("prompt", "bs", "cap"), [(0, 16, 0), (1, 16, 0), (16, 16, 0), (17, 16, 1), (33, 16, 2)]
)
def test_hit_cap_never_serves_the_last_token(prompt: int, bs: int, cap: int) -> None:
    assert hit_cap_blocks(prompt, bs) == cap


def test_prediction_applies_cap_to_a_full_match() -> None:
    # 64 tokens = 4 full blocks all cached, but the engine recomputes the last token
    hit = predict_hit(gpu_match(4), 64, 16, C)
    assert hit.predicted_cached_tokens == 48
    assert hit.uncached_tokens == 16


def test_pending_counts_with_its_weight() -> None:
    hit = predict_hit(gpu_match(2, pending=5), 100, 16, Coefficients(pending_weight=0.5))
    assert hit.gpu_tokens == 32 and hit.pending_tokens == 48
    assert hit.uncached_tokens == pytest.approx(100 - 32 - 24)
    assert hit.predicted_cached_tokens == 80  # weight >= 0.5: pending predicted as hits
    low = predict_hit(gpu_match(2, pending=5), 100, 16, Coefficients(pending_weight=0.2))
    assert low.predicted_cached_tokens == 32


def test_tiers_split_gpu_cpu_remote() -> None:
    # GPU prefix 2 blocks, CPU prefix 5, stored (any tier) 7: blocks 5..6 only on some other tier
    m = PrefixMatch({Tier.GPU: 2, Tier.CPU: 5, Tier.DISK: 0, Tier.REMOTE: 0}, 7, 7)
    hit = predict_hit(m, 16 * 20, 16, C)
    assert hit.gpu_tokens == 32 and hit.loaded_tokens == 5 * 16
    assert hit.loaded_weighted == pytest.approx((3 * 1.0 + 2 * 10.0) * 16)


def test_cost_terms_add_up_and_a_hit_is_cheaper_when_idle() -> None:
    idle = LoadView()
    miss = cost(empty_match(), 2048, 16, idle, C)
    hit = cost(gpu_match(120), 2048, 16, idle, C)
    assert miss.cost_ms == pytest.approx(C.overhead_ms + 2048 * C.prefill_ms_per_token)
    assert hit.cost_ms < miss.cost_ms
    assert hit.cost_ms == pytest.approx(C.overhead_ms + hit.queue_ms + hit.prefill_ms + hit.load_ms)


def test_a_hit_on_an_overloaded_replica_loses_to_an_idle_miss() -> None:
    busy = LoadView(queued_prefill_tokens=20_000, queued_requests=10, running=8)
    assert (
        cost(gpu_match(120), 2048, 16, busy, C).cost_ms
        > cost(empty_match(), 2048, 16, LoadView(), C).cost_ms
    )


def test_saturation_term_counts_requests_over_capacity() -> None:
    x = features(100, 0, LoadView(running=4, queued_requests=2, capacity=4))
    assert x[FEATURES.index("saturation")] == 3  # 4 running + 2 queued + this one - 4 slots


def test_online_fit_recovers_true_coefficients_and_stays_bounded() -> None:
    rng = random.Random(7)
    truth = Coefficients(overhead_ms=40, prefill_ms_per_token=0.4, decode_ms_per_running=1.0)
    fit = OnlineFit(C, bound=4.0, forgetting=0.999, min_samples=10)
    tv = truth.as_vector()
    for _ in range(800):
        load = LoadView(
            queued_prefill_tokens=rng.uniform(0, 8000),
            running=rng.randrange(0, 32),
            queued_requests=rng.randrange(0, 4),
        )
        x = features(rng.uniform(0, 4000), rng.uniform(0, 500), load)
        y = sum(a * b for a, b in zip(tv, x, strict=True)) + rng.gauss(0, 2.0)
        fit.update(x, y)
    got = fit.coefficients()
    assert got.prefill_ms_per_token == pytest.approx(0.4, rel=0.05)
    assert got.overhead_ms == pytest.approx(40, rel=0.15)
    # clamp box: a wild observation stream cannot push coefficients out of [prior/4, prior*4]
    for _ in range(200):
        fit.update([1, 10_000, 0, 0, 0], 1e7)
    v, p = fit.coefficients().as_vector(), C.as_vector()
    for got_i, prior_i in zip(v, p, strict=True):
        assert prior_i / 4 - 1e-9 <= got_i <= prior_i * 4 + 1e-9


def test_online_fit_rejects_non_finite_and_uses_prior_until_warm() -> None:
    fit = OnlineFit(C, min_samples=5)
    assert not fit.update([1, 0, 0, 0, 0], float("nan"))
    fit.update([1, 100, 0, 0, 0], 1000.0)
    assert fit.coefficients() == C


def test_cost_equals_the_linear_model_the_fit_uses() -> None:
    rng = random.Random(3)
    for _ in range(200):
        g = rng.randrange(0, 50)
        tiers = {Tier.GPU: g, Tier.CPU: g + rng.randrange(0, 5), Tier.DISK: 0, Tier.REMOTE: 0}
        stored = tiers[Tier.CPU] + rng.randrange(0, 3)
        m = PrefixMatch(tiers, stored, stored + rng.randrange(0, 4))
        load = LoadView(
            queued_prefill_tokens=rng.uniform(0, 5000),
            queued_requests=rng.randrange(0, 5),
            running=rng.randrange(0, 20),
            waiting=rng.randrange(0, 5),
            capacity=rng.randrange(1, 24),
            overdue_ms=rng.choice([0.0, rng.uniform(0, 3000)]),
        )
        prompt = rng.randrange(1, 1200)
        b = cost(m, prompt, 16, load, C)
        x = features(b.hit.uncached_tokens, b.hit.loaded_weighted, load)
        # the measured lateness of the replica's queue adds to the model's estimate
        assert b.ttft_ms == pytest.approx(dot(C.as_vector(), x) + load.overdue_ms)
        # the routing cost adds the decode stall this prefill imposes on the running ones:
        # its own prefill, and the step overhead unless a prefill waits for the next step
        alone = C.overhead_ms if load.queued_requests < 2 else 0.0
        stall = C.stall_weight * (b.prefill_ms + alone) * load.running
        assert b.stall_ms == pytest.approx(stall)
        assert b.cost_ms == pytest.approx(b.ttft_ms + b.stall_ms)


def test_a_long_miss_prefers_the_replica_with_fewer_decoding_requests() -> None:
    """Two replicas with no queued prefill and no match: on its own TTFT a 4,000-token miss
    hardly minds 12 decoding requests (12 x 0.5 ms); with the stall term it goes to the
    replica with 2, since its ~1 s prefill would hold up every one of them. A hit (little
    prefill) still goes to its replica however many decode there."""
    busy = LoadView(running=12, capacity=16)
    idle = LoadView(running=2, capacity=16)
    none = gpu_match(0)
    own = replace(C, stall_weight=0.0)
    gap = cost(none, 4000, 16, busy, own).cost_ms - cost(none, 4000, 16, idle, own).cost_ms
    assert gap == pytest.approx(5.0)
    b, i = cost(none, 4000, 16, busy, C), cost(none, 4000, 16, idle, C)
    # its prefill (1,000 ms) and, with no prefill queued on either, the step overhead (30 ms)
    assert b.cost_ms - i.cost_ms == pytest.approx(5.0 + C.stall_weight * 1030.0 * 10)
    assert b.ttft_ms - i.ttft_ms == pytest.approx(5.0)  # what the fit predicts is unchanged
    assert cost(gpu_match(240), 4000, 16, busy, C).cost_ms < i.cost_ms


def test_a_short_miss_joins_a_waiting_prefill_rather_than_add_a_step_overhead() -> None:
    """A step that carries any prefill pays the step overhead (30 ms) once. A 128-token miss
    (32 ms of prefill) sent where the next step would carry no prefill makes it pay that for
    each of the 12 decoding requests there; sent where a second request waits behind the one
    in the step under way, it shares the next step, which pays it anyway. On its own TTFT it
    would take the other replica (25 ms sooner); its routing cost sends it to the waiting one.
    One request before its first token is most likely in the step under way: no sharing."""
    one = LoadView(queued_prefill_tokens=50.0, queued_requests=1, running=12, capacity=16)
    two = LoadView(queued_prefill_tokens=150.0, queued_requests=2, running=12, capacity=16)
    none = gpu_match(0)
    a, j = cost(none, 128, 16, one, C), cost(none, 128, 16, two, C)
    assert j.ttft_ms - a.ttft_ms == pytest.approx(25.0)
    assert a.stall_ms == pytest.approx(C.stall_weight * (32.0 + 30.0) * 12)
    assert j.stall_ms == pytest.approx(C.stall_weight * 32.0 * 12)
    assert j.cost_ms < a.cost_ms
    quiet = cost(none, 128, 16, LoadView(running=12, capacity=16), C)
    assert quiet.stall_ms == a.stall_ms
    # with nothing decoding there is nobody to stall
    assert cost(none, 128, 16, LoadView(capacity=16), C).stall_ms == 0.0


def test_with_vector_keeps_every_other_field() -> None:
    """with_vector names every field itself: a field added to Coefficients must be too."""
    base = Coefficients()
    odd = {f.name: getattr(base, f.name) for f in fields(Coefficients)}
    odd.update({k: v * 3.0 + 1.0 for k, v in odd.items() if isinstance(v, float)})
    odd["tier_load_factor"] = {Tier.CPU: 2.0}
    c = Coefficients(**odd)
    got = c.with_vector([1.0, 2.0, 3.0, 4.0, 5.0])
    assert got == replace(
        c, overhead_ms=1.0, prefill_ms_per_token=2.0, load_ms_per_token=3.0,
        decode_ms_per_running=4.0, saturation_ms=5.0,
    )  # fmt: skip


def test_online_fit_matches_the_textbook_recursion() -> None:
    """The fit's update (C-level dot products) against the plain loops, bit for bit."""
    rng = random.Random(5)
    fit = OnlineFit(Coefficients(), min_samples=5, max_trace=50.0)
    n = len(FEATURES)
    theta, p = list(fit._theta), [list(r) for r in fit._p]
    resid_var, samples = 0.0, 0
    for _ in range(500):
        x = [1.0, rng.uniform(0, 8000), rng.uniform(0, 1e5), rng.randrange(64), rng.random()]
        y = rng.uniform(0, 500) if rng.random() > 0.05 else rng.uniform(0, 1e6)
        z = [x[i] * OnlineFit._SCALES[i] for i in range(n)]
        resid = y - math.fsum(theta[i] * z[i] for i in range(n))
        lo = math.fsum(fit._lo[i] * z[i] for i in range(n))
        beyond = 100.0 * y < lo  # far faster than the clamp box can explain: skipped
        outlier = samples >= 5 and resid_var > 0 and abs(resid) > 6.0 * math.sqrt(resid_var)
        assert fit.update(x, y) is not (beyond or outlier)
        if beyond:
            pass
        elif outlier:
            resid_var *= 1.05
        else:
            pz = [math.fsum(p[i][j] * z[j] for j in range(n)) for i in range(n)]
            denom = 0.995 + math.fsum(z[i] * pz[i] for i in range(n))
            gain = [v / denom for v in pz]
            for i in range(n):
                theta[i] = min(fit._hi[i], max(fit._lo[i], theta[i] + gain[i] * resid))
            for i in range(n):
                for j in range(n):
                    p[i][j] = (p[i][j] - gain[i] * pz[j]) / 0.995
            trace = sum(p[i][i] for i in range(n))
            if trace > 50.0:
                for i in range(n):
                    for j in range(n):
                        p[i][j] *= 50.0 / trace
            resid_var = resid * resid if samples == 0 else 0.98 * resid_var + 0.02 * resid * resid
            samples += 1
        assert fit._theta == theta and fit._p == p and fit._resid_var == resid_var


def test_online_fit_refuses_a_short_or_lenless_feature_vector() -> None:
    """A vector shorter than FEATURES (or one without a length) is an error, not a sample
    taken with features missing (review of the fit's C loops, which would truncate)."""
    fit = OnlineFit(Coefficients())
    before = list(fit._theta)
    with pytest.raises(ValueError):
        fit.update([1.0, 100.0, 0.0], 50.0)
    with pytest.raises(TypeError):
        fit.update(iter([1.0, 100.0, 0.0, 2.0, 0.0]), 50.0)  # type: ignore[arg-type]
    assert fit._theta == before and fit.samples == 0
