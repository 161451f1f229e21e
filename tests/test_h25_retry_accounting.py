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
