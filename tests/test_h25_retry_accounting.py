"""A retry after a refused connection leaves the router's accounting as if the request had
gone only where it went (D24's open end): the first decision was committed when the request
was sent, so the replica that refused the connection stayed charged the prompt's new tokens
in prefix_affinity's tree or the tenant's scope tree (D14), and round robin's cursor stepped
twice for one request."""

from __future__ import annotations

import pytest

from tests.test_gateway_support import words
from tests.test_h24_router_state import GATEWAY_CONFIGS
from tests.test_upstream_faults import FakeReplica, completion, gateway

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "config", ["expected_latency/scope_tree", "prefix_affinity", "round_robin"]
)
async def test_a_replica_that_refused_the_connection_is_charged_nothing(config: str) -> None:
    reps = [FakeReplica(), FakeReplica()]
    async with gateway(reps, GATEWAY_CONFIGS[config]) as (gw, h):
        assert gw.pool is not None
        body = completion(words(200, 1))
        # the request's first decision (explain: previewed, moves nothing)
        shown = await gw.prepare("completion", "anonymous", body, {}, "e", True)
        y = shown.replica
        x = next(r.id for r in gw.pool.all() if r.id != y)
        # y's engine is gone, its listener closed; the pool still routes to it (no probe yet)
        y_url = next(r.url for r in gw.pool.all() if r.id == y)
        await next(rep for rep in reps if rep.url == y_url).stop()
        r = await h.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == x, r.text
        assert gw.metrics.retries._value.get() == 1
        router = gw.router
        if config == "round_robin":
            assert router._rr == 1  # one request, one step
            return
        charged = router._tree_tokens
        if config != "prefix_affinity":
            (charged,) = router._scope_trees.values()  # the one tenant's tree
        assert charged.get(y, 0) == 0 and charged[x] > 0, charged


async def test_two_refused_connections_step_round_robin_once() -> None:
    """Each retry is decided again over the replicas left: one request, one step of the
    cursor, however many connections it took (a second retry stepped it again)."""
    reps = [FakeReplica() for _ in range(3)]
    async with gateway(reps, GATEWAY_CONFIGS["round_robin"]) as (gw, _):
        d = await gw.prepare("completion", "anonymous", completion(words(50, 1)), {}, "r")
        assert gw.router._rr == 1  # sent: committed
        first = d.replica
        assert gw.reroute(d, d.replica) and d.replica != first
        assert gw.reroute(d, d.replica)  # refused again: the last replica
        assert len({first, *d.tried, d.replica}) == 3
        assert gw.router._rr == 1


async def test_a_replica_that_refused_the_connection_keeps_its_turn_in_the_tie_round() -> None:
    """With random tie rounds (miss_tie_break: round) the refused replica stayed in the
    round as if it had taken a tied request: the next misses went elsewhere until the
    round ended. Only the replica the request reached has had its turn."""
    reps = [FakeReplica(), FakeReplica()]
    async with gateway(reps, GATEWAY_CONFIGS["expected_latency/round"]) as (gw, _):
        d = await gw.prepare("completion", "anonymous", completion(words(200, 2)), {}, "t")
        first = d.replica
        scope = d.scope.routing_key()  # the tenant's own round (D26)
        assert gw.router.tie_round(scope) == {first}  # a miss everywhere: a tie, in the round
        assert gw.reroute(d, first) and d.replica != first
        # the retry over the one replica left ties with nobody: no round entry of its own
        assert first not in gw.router.tie_round(scope)


def test_retract_takes_back_a_committed_decision_and_nothing_more() -> None:
    """Router.retract: the cursor step, the pick's place in the round, the tree growth;
    an entry taken to zero goes; a scope tree evicted since is not made again; twice or
    on an uncommitted decision it does nothing."""
    import random

    from cachecore.scoring import Coefficients, LoadView
    from gateway.routing import (
        Candidate,
        MissTieBreak,
        Router,
        RouteRequest,
        RoutingParams,
        Strategy,
    )

    cands = [Candidate(f"r{i}", LoadView()) for i in range(3)]
    req = RouteRequest(prompt_tokens=320, block_size=16, scope_key="t")
    co = Coefficients()
    rr = Router(RoutingParams(strategy=Strategy.ROUND_ROBIN), random.Random(0))
    d = rr.decide(req, cands, co)
    rr.retract(d)
    rr.retract(d)
    assert rr._rr == 0
    tied = Router(RoutingParams(miss_tie_break=MissTieBreak.ROUND), random.Random(0))
    a = tied.decide(req, cands, co)
    b = tied.decide(req, cands, co)
    tied.retract(b)
    assert tied.tie_round("t") == {a.replica}  # scope t's round (D26)
    pa = Router(RoutingParams(strategy=Strategy.PREFIX_AFFINITY), random.Random(0))
    d = pa.decide(req, cands, co)
    pa.retract(d)
    assert pa._tree_tokens == {}  # no zero entry left behind
    st = Router(RoutingParams(), random.Random(0))
    d = st.decide(req, cands, co)
    assert st._scope_trees["t"] == {d.replica: 320}
    st.retract(d)
    assert "t" not in st._scope_trees  # emptied: dropped, as forget() does
    d = st.decide(req, cands, co)
    st._scope_trees.clear()  # evicted from the LRU before the connection failed
    st.retract(d)
    assert st._scope_trees == {}
    undecided = st.decide(req, cands, co, commit=False)
    st.retract(undecided)
    assert st._scope_trees == {} and st._commits == 2
