"""Router properties over generated fleets: what every decision must hold whatever the
loads (huge engine-reported counts included), matches, quarantines and confinement."""

from __future__ import annotations

import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachecore.index.base import NO_MATCH, PrefixMatch
from cachecore.lifecycle import Tier
from cachecore.scoring import Coefficients, LoadView, OnlineFit
from gateway.routing import (
    Candidate,
    NoCandidateError,
    Router,
    RouteRequest,
    RoutingParams,
    Strategy,
)

C = Coefficients()
NAMES = [f"r{i}" for i in range(6)]
# a Redis load record holds 64-bit integers: an engine may report any of them (running is
# never negative in a view, LoadTracker takes the larger of it and its own count)
BIG = 2**63 - 1


@st.composite
def candidate(draw: st.DrawFn, name: str) -> Candidate:
    load = LoadView(
        draw(st.floats(0, 1e7)),
        draw(st.integers(0, 300)),
        draw(st.one_of(st.integers(0, 64), st.integers(0, BIG))),
        draw(st.one_of(st.integers(-BIG, BIG), st.integers(0, 300))),
        draw(st.integers(1, 512)),
        0.0,
        draw(st.one_of(st.just(0.0), st.floats(0, 1e7))),
    )
    stored = draw(st.integers(0, 400))
    pending = draw(st.integers(stored, 500))
    m = NO_MATCH
    if pending:
        gpu = draw(st.integers(0, stored))
        tiers = {Tier.GPU: gpu, Tier.CPU: draw(st.integers(0, stored)), Tier.DISK: 0}
        m = PrefixMatch({**tiers, Tier.REMOTE: 0}, stored, pending)
    return Candidate(name, load, m, draw(st.booleans()))


@st.composite
def fleet(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(1, len(NAMES)))
    return [draw(candidate(NAMES[i])) for i in range(n)]


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    cands=fleet(),
    prompt=st.integers(0, 5000),
    block_size=st.sampled_from([1, 16, 32]),
    load_only=st.booleans(),
    strategy=st.sampled_from(list(Strategy)),
    cold=st.one_of(st.none(), st.frozensets(st.sampled_from(NAMES), min_size=1)),
    temperature=st.sampled_from([0.0, 0.5]),
    scoped=st.booleans(),
)
def test_every_decision_holds_the_routing_contract(
    cands: list[Candidate],
    prompt: int,
    block_size: int,
    load_only: bool,
    strategy: Strategy,
    cold: frozenset[str] | None,
    temperature: float,
    scoped: bool,
) -> None:
    router = Router(RoutingParams(temperature=temperature), random.Random(0))
    req = RouteRequest(
        prompt,
        block_size,
        session_key="s" if scoped else None,
        load_only=load_only,
        cold_replicas=cold,
        scope_key="tenant" if scoped else None,
    )
    try:
        d = router.decide(req, cands, C, strategy)
    except NoCandidateError:
        # only a confined tenant's request with none of its cold replicas offered
        assert cold is not None and not cold.intersection(c.replica for c in cands)
        return
    assert d.replica in {c.replica for c in cands}
    assert d.chosen.eligible
    by = {s.replica: s for s in d.scores}
    for c in cands:
        s = by[c.replica]
        assert not math.isnan(s.cost_ms) and s.cost_ms >= 0.0
        assert s.predicted_cached_tokens <= max(0, prompt - 1)  # the engine's hit cap
        if load_only or c.quarantined:  # the isolation contract: such a match is ignored
            assert s.matched_blocks == 0 and s.predicted_cached_tokens == 0
        if load_only:
            assert s.recompute_ms == 0.0
        if cold is not None and not s.eligible:
            assert s.replica not in cold and s.note == "cold_confined"
    best = max(s.predicted_cached_tokens for s in d.scores)
    if cold is not None and best < RoutingParams().cold_fraction * prompt:
        assert d.replica in cold  # a confined tenant's cold request: its replicas only


_FEATURE = st.one_of(st.floats(0, 1e4), st.floats(0, 2.0**64))
_OBSERVED = st.one_of(
    st.floats(0, 1e7),  # a TTFT on the gateway's clock (its timeouts bound it)
    st.sampled_from([-1.0, math.nan, math.inf, -math.inf]),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    samples=st.lists(
        st.tuples(st.tuples(_FEATURE, _FEATURE, _FEATURE, _FEATURE), _OBSERVED), max_size=60
    ),
    min_samples=st.integers(1, 30),
)
def test_the_online_fit_stays_in_its_box_whatever_it_is_fed(
    samples: list[tuple[tuple[float, float, float, float], float]], min_samples: int
) -> None:
    """OnlineFit's invariant (the coefficients within [prior / bound, prior * bound]) and
    a finite state, whatever engines report (64-bit counts) and whatever is observed."""
    fit = OnlineFit(C, min_samples=min_samples)
    prior = C.as_vector()
    for x, observed in samples:
        fit.update([1.0, *x], observed)
        got = fit.coefficients().as_vector()
        box = [(p / 4 * (1 - 1e-12), p * 4 * (1 + 1e-12)) for p in prior]  # float rounding
        assert all(lo <= v <= hi for v, (lo, hi) in zip(got, box, strict=True)), got
        assert all(math.isfinite(v) for row in fit._p for v in row)
        assert math.isfinite(fit._resid_var)
