"""Routing decisions at their edges: confinement on retries, the online fit fed absurd
engine reports, the rate limits' clock."""

from __future__ import annotations

import random

import pytest

from cachecore.index.base import PrefixMatch
from cachecore.lifecycle import Tier
from cachecore.scoring import Coefficients, LoadView, OnlineFit, features
from gateway.quarantine import ClaimCheck, QuarantineTracker
from gateway.routing import (
    Candidate,
    NoCandidateError,
    Router,
    RouteRequest,
    RoutingParams,
    rendezvous_weight,
)
from policies.schema import QuarantinePolicy
from tests.test_upstream_faults import FakeReplica, completion, gateway

pytestmark = pytest.mark.timeout(60)

C = Coefficients()


def match(blocks: int) -> PrefixMatch:
    return PrefixMatch(
        {Tier.GPU: blocks, Tier.CPU: 0, Tier.DISK: 0, Tier.REMOTE: 0}, blocks, blocks
    )


def test_a_cold_request_without_its_cold_replicas_has_nowhere_to_go() -> None:
    """The tenant's cold replica (r3) is not among the candidates (a retry after it
    failed): a cold request has no eligible replica, where it used to go to any; a warm
    one is not confined and still goes to its match."""
    router = Router(RoutingParams(), random.Random(0))
    req = RouteRequest(2048, 16, cold_replicas=frozenset({"r3"}))
    cands = [Candidate(f"r{i}", LoadView()) for i in range(3)]
    with pytest.raises(NoCandidateError):
        router.decide(req, cands, C)
    for kw in ({"load_only": True}, {"load_only": True, "unkeyed": True}):
        blind = RouteRequest(2048, 16, cold_replicas=frozenset({"r3"}), **kw)  # type: ignore[arg-type]
        with pytest.raises(NoCandidateError):
            router.decide(blind, cands, C)
    cands[1] = Candidate("r1", LoadView(), match(100))
    assert router.decide(req, cands, C).replica == "r1"


async def test_a_retry_never_leaves_the_tenants_cold_replicas() -> None:
    """Both of a confined tenant's cold replicas fail to connect: the second retry has
    none of them left, and the request ends there (the client gets the 502 of a failed
    connect) instead of going to a replica outside the confinement (docs/gateway.md:
    retries stay "within the tenant's cold-replica confinement")."""
    reps = [FakeReplica() for _ in range(4)]
    policy = "tenants: {anonymous: {limits: {cold_replica_count: 2}}}"
    async with gateway(reps, policy) as (gw, _):
        assert gw.pool is not None and gw.settings.retries >= 2
        ids = sorted(
            (r.id for r in gw.pool.all()), key=lambda rid: rendezvous_weight("anonymous", rid)
        )
        cold = set(ids[-2:])
        for i in range(5):
            body = completion(f"cold prompt {i} " * 20)
            d = await gw.prepare("completion", "anonymous", body, {}, f"r{i}", explain_only=True)
            assert d.replica in cold
            assert gw.reroute(d, d.replica)
            assert d.replica in cold, (d.replica, cold)
            assert not gw.reroute(d, d.replica), (d.replica, cold)
            assert d.replica in cold


def _normal_samples(rng: random.Random, n: int) -> list[tuple[list[float], float]]:
    """Honest samples: TTFT = 30 + 0.25 ms per prefill token + 0.5 ms per running request."""
    out = []
    for _ in range(n):
        load = LoadView(rng.uniform(0, 5000), rng.randint(0, 5), rng.randint(0, 20))
        x = features(rng.uniform(0, 4000), 0.0, load)
        out.append((x, 30.0 + 0.25 * x[1] + 0.5 * x[3] + rng.gauss(0.0, 5.0)))
    return out


def test_one_absurd_engine_report_does_not_poison_the_fit() -> None:
    """An engine's usage claims a prompt of 1.8e19 tokens (or its metrics 1e6 running
    requests) for a request answered in 50 ms, before the fit is warm. Taken, it pinned the
    coefficients to the clamp box's edges (prefill 0.0625, overhead 120, decode 0.125) for
    thousands of honest samples after it, and the residual variance (1e32) stopped every
    outlier check: the fit every replica's cost uses, poisoned by one replica's report."""
    for absurd in (
        features(1.8e19, 0.0, LoadView()),
        features(100.0, 0.0, LoadView(running=10**6)),
    ):
        rng = random.Random(1)
        samples = _normal_samples(rng, 305)
        fit = OnlineFit(C)
        for x, y in samples[:5]:
            fit.update(x, y)
        assert fit.update(absurd, 50.0) is False
        for x, y in samples[5:]:
            fit.update(x, y)
        got = fit.coefficients()
        assert got.prefill_ms_per_token == pytest.approx(0.25, rel=0.05)
        assert got.overhead_ms == pytest.approx(30.0, rel=0.2)
        assert fit._resid_var < 100.0  # the honest noise (5 ms): outliers are rejected again
        # and an outlier is: a warm fit skips a GC pause's 10 s TTFT on an idle replica
        assert fit.update(features(100.0, 0.0, LoadView()), 10_000.0) is False


def test_a_replica_that_keeps_misreporting_does_not_open_the_fit() -> None:
    """A third of the samples from one replica whose metrics claim 1e6 running requests:
    each was an outlier that grew the residual variance by 5%, so a run of them could
    widen the fit's acceptance without bound; they are now skipped without growing it."""
    rng = random.Random(2)
    fit = OnlineFit(C)
    honest = iter(_normal_samples(rng, 400))
    absurd = features(100.0, 0.0, LoadView(running=10**6))
    for x, y in [next(honest) for _ in range(100)]:
        fit.update(x, y)
    for i in range(300):
        if i % 3 == 0:
            assert fit.update(absurd, 60.0) is False
        else:
            fit.update(*next(honest))
    assert fit._resid_var < 100.0
    assert fit.coefficients().prefill_ms_per_token == pytest.approx(0.25, rel=0.05)


def test_a_rebuild_lifts_one_quarantine_not_every_one() -> None:
    """A rogue agent lies k times, is quarantined, clears its index (a new epoch: the
    gateway calls release) and lies again: each rebuild lifted the quarantine at once, so
    it misrouted k requests per rebuild without end. A rebuild now lifts one quarantine;
    the next needs recover_after agreeing checks, after which a rebuild may lift again."""
    # the rebuild rule alone: no escalation (a repeat offender's is test_h26_quarantine_cycles)
    q = QuarantineTracker(QuarantinePolicy(k=3, m=5, recover_after=3, recover_after_max=3))
    bad, agree = ClaimCheck("r", 10, 0, 10), ClaimCheck("r", 10, 10, 10)
    for _ in range(3):
        q.observe(bad)
    assert q.is_quarantined("r")
    assert q.release("r") and not q.is_quarantined("r")  # an honest rebuild: at once
    for _ in range(3):
        q.observe(bad)
    assert q.is_quarantined("r")
    assert not q.release("r")  # rebuilt again without proving itself: stays
    assert q.is_quarantined("r")
    assert [q.observe(agree) for _ in range(3)] == [None, None, False]  # proven
    for _ in range(3):
        q.observe(bad)
    assert q.release("r")  # proven since: a rebuild lifts this one
    for _ in range(3):  # proven after a rebuild while in service: the same
        q.observe(agree)
    for _ in range(3):
        q.observe(bad)
    assert q.release("r")
