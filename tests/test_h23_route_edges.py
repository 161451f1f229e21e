"""Routing decisions at their edges: confinement on retries, the online fit fed absurd
engine reports, the rate limits' clock."""

from __future__ import annotations

import random

import pytest

from cachecore.index.base import PrefixMatch
from cachecore.lifecycle import Tier
from cachecore.scoring import Coefficients, LoadView
from gateway.routing import (
    Candidate,
    NoCandidateError,
    Router,
    RouteRequest,
    RoutingParams,
    rendezvous_weight,
)
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
