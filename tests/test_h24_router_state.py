"""A routing decision moves the router's state (round-robin cursor, tie rounds, trees) only
when its request is sent: ``Router.decide(commit=False)`` then ``Router.commit``. The
gateway used to commit every decision at once, so a request refused by the tenant's
uncached-token budget, or a decision made again after its replica was cordoned during the
lookup, charged replicas and rounds for requests they never got."""

from __future__ import annotations

import random
from typing import Any

import pytest

from cachecore.index.base import PrefixMatch
from cachecore.lifecycle import Tier
from cachecore.scoring import Coefficients, LoadView
from gateway.core import Gateway
from gateway.routing import (
    Candidate,
    MissTieBreak,
    Router,
    RouteRequest,
    RoutingParams,
    Strategy,
)
from tests.test_gateway_support import words
from tests.test_upstream_faults import FakeReplica, completion, gateway

pytestmark = pytest.mark.timeout(60)

C = Coefficients()
State = tuple[
    int,
    frozenset[str],
    dict[str, frozenset[str]],
    dict[str, int],
    list[tuple[str, dict[str, int]]],
]


def state(r: Router) -> State:
    """What a decision may move (the RNG apart: a draw is no accounting, see decide; nor
    the place of a scope's rounds in their LRU, made or moved by a draw). The tie rounds:
    the shared one and each scope's own (D26)."""
    scopes = [(k, dict(v)) for k, v in r._scope_trees.items()]  # the LRU order too
    rounds = {k: frozenset(v.rounds) for k, v in r._scope_draws.items() if v.rounds}
    return r._rr, frozenset(r._round), rounds, dict(r._tree_tokens), scopes


def match(blocks: int) -> PrefixMatch:
    return PrefixMatch(
        {Tier.GPU: blocks, Tier.CPU: 0, Tier.DISK: 0, Tier.REMOTE: 0}, blocks, blocks
    )


def spill_fleet() -> list[Candidate]:
    """Two tied holders of the prefix behind a 100 ms queue and three idle replicas: with a
    5 ms spill bound a request takes a tie among the holders, then one among the idle."""
    busy = LoadView(queued_prefill_tokens=400, queued_requests=1)
    held = [Candidate(f"h{i}", busy, match(60)) for i in range(2)]
    return held + [Candidate(f"u{i}", LoadView()) for i in range(3)]


CONFIGS: dict[str, tuple[Strategy, dict[str, Any]]] = {
    "expected_latency/scope_tree": (Strategy.EXPECTED_LATENCY, {}),
    "expected_latency/round": (
        Strategy.EXPECTED_LATENCY,
        {"miss_tie_break": MissTieBreak.ROUND},
    ),
    "expected_latency/spill": (Strategy.EXPECTED_LATENCY, {"spill_queue_ms": 5.0}),
    "prefix_affinity": (Strategy.PREFIX_AFFINITY, {}),
    "round_robin": (Strategy.ROUND_ROBIN, {}),
    "random": (Strategy.RANDOM, {}),
}


def requests(i: int) -> tuple[RouteRequest, list[Candidate]]:
    """A mix: misses on idle replicas (ties), sensitive ones, spills, a few scopes."""
    scope = f"tenant:{i % 3}"
    if i % 5 == 4:
        return RouteRequest(2048, 16, scope_key=scope), spill_fleet()
    cands = [Candidate(f"r{k}", LoadView(running=(i + k) % 2)) for k in range(4)]
    load_only = i % 7 == 3
    return RouteRequest(64 * (1 + i % 4), 16, load_only=load_only, scope_key=scope), cands


@pytest.mark.parametrize("config", CONFIGS)
def test_a_decision_moves_the_router_only_when_committed(config: str) -> None:
    """decide(commit=False) leaves cursor, rounds and trees as they were (a refused request
    is never committed); its commit then makes them what decide's default makes them, and
    the next decisions are the same as a router that committed at once (same draws)."""
    strategy, kw = CONFIGS[config]
    params = RoutingParams(**kw)
    at_once, later = Router(params, random.Random(3)), Router(params, random.Random(3))
    moved = 0
    for i in range(60):
        req, cands = requests(i)
        want = at_once.decide(req, cands, C, strategy)
        before = state(later)
        got = later.decide(req, cands, C, strategy, commit=False)
        assert state(later) == before, i
        assert (got.replica, got.reason) == (want.replica, want.reason), i
        later.commit(got)
        assert state(later) == state(at_once), i
        later.commit(got)  # once: a second commit changes nothing
        at_once.commit(want)  # nor does committing what decide committed
        assert state(later) == state(at_once) != before or strategy is Strategy.RANDOM, i
        moved += state(later) != before
    assert moved > 0 or strategy is Strategy.RANDOM


@pytest.mark.parametrize("config", ["expected_latency/scope_tree", "prefix_affinity"])
def test_a_decision_made_again_charges_only_the_replica_finally_chosen(config: str) -> None:
    """The gateway decides again when the chosen replica was cordoned during the lookup:
    the first decision is not committed, so the replica that never got the request is
    charged nothing in the trees."""
    strategy, kw = CONFIGS[config]
    r = Router(RoutingParams(**kw), random.Random(0))
    req = RouteRequest(1000, 16, scope_key="tenant:a")
    cands = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    first = r.decide(req, cands, C, strategy, commit=False)
    rest = [c for c in cands if c.replica != first.replica]
    again = r.decide(req, rest, C, strategy, commit=False)
    r.commit(again)
    tree = r._tree_tokens if strategy is Strategy.PREFIX_AFFINITY else r._scope_trees["tenant:a"]
    assert tree == {again.replica: 1000}


def test_round_robin_decided_again_steps_the_cursor_once() -> None:
    r = Router(RoutingParams(), random.Random(0))
    req = RouteRequest(64, 16)
    cands = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    first = r.decide(req, cands, C, Strategy.ROUND_ROBIN, commit=False)
    assert first.replica == "a"
    again = r.decide(req, cands[1:], C, Strategy.ROUND_ROBIN, commit=False)
    r.commit(again)
    assert r._rr == 1
    assert r.decide(req, cands, C, Strategy.ROUND_ROBIN).replica == "b"  # the cursor's next


def test_a_spill_takes_its_two_ties_in_one_round() -> None:
    """A spill takes a tie among the holders, then one among the idle replicas, the second
    on the round as the first left it: from a round every replica had, the first begins a
    new one and the second joins it. Uncommitted, the second must see the first's new
    round though nothing is written yet."""
    names = {c.replica for c in spill_fleet()}
    for commit in (True, False):
        r = Router(RoutingParams(spill_queue_ms=5.0), random.Random(1))
        r._round = set(names)  # a round every replica had
        d = r.decide(RouteRequest(2048, 16), spill_fleet(), C, commit=commit)
        r.commit(d)
        assert d.reason == "spill" and d.replica.startswith("u")
        holder = (r._round - {d.replica}).pop()
        assert r._round == {holder, d.replica} and holder.startswith("h"), commit


def test_a_decision_committed_after_others_rechecks_its_round() -> None:
    """Two replicas tie. A decision held uncommitted while two others fill the round begins
    a new round when committed (as decide would have on that round), instead of adding a
    third tie to a round of two."""
    r = Router(RoutingParams(miss_tie_break=MissTieBreak.ROUND), random.Random(0))
    req = RouteRequest(64, 16)
    cands = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    held = r.decide(req, cands, C, commit=False)
    r.decide(req, cands, C)
    r.decide(req, cands, C)
    assert r._round == {"a", "b"}
    r.commit(held)
    assert r._round == {held.replica}


# ------------------------------------------------------------------------------ gateway

GATEWAY_CONFIGS = {
    "expected_latency/scope_tree": "routing: {strategy: expected_latency}",
    "expected_latency/round": "routing: {strategy: expected_latency, miss_tie_break: round}",
    "prefix_affinity": "routing: {strategy: prefix_affinity}",
    "round_robin": "routing: {strategy: round_robin}",
}


@pytest.mark.parametrize("config", GATEWAY_CONFIGS)
async def test_a_request_refused_by_the_uncached_budget_moves_no_router_state(
    config: str,
) -> None:
    """The budget is charged after the decision: every refused request (429) moved the
    round-robin cursor, the tie rounds and the trees as if it had been sent, so a tenant
    flooding refused requests skewed its own scope tree and everyone's cursor and rounds."""
    budget = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 100}"
    async with gateway([FakeReplica(), FakeReplica()], f"{GATEWAY_CONFIGS[config]}\n{budget}") as (
        gw,
        h,
    ):
        start = state(gw.router)
        sent = await h.post("/v1/completions", json=completion(words(300, 1)))
        assert sent.status_code == 200  # the full budget takes it, into debt
        after_sent = state(gw.router)
        assert after_sent != start  # a request sent moves the router
        for i in range(3):
            refused = await h.post("/v1/completions", json=completion(words(300, 10 + i)))
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["limit"] == "uncached_tokens"
            assert state(gw.router) == after_sent, i


def _cordon_during_lookup(gw: Gateway, replica: str) -> None:
    """Fault injection: the operator cordons ``replica`` while a lookup is in flight."""
    assert gw.pool is not None and gw.index is not None
    pool, real = gw.pool, gw.index.lookup

    async def lookup_while_cordoning(*args: Any, **kw: Any) -> Any:
        pool.cordon(replica)
        return await real(*args, **kw)

    gw.index.lookup = lookup_while_cordoning  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "config", ["expected_latency/scope_tree", "prefix_affinity", "round_robin"]
)
async def test_a_replica_cordoned_during_the_lookup_is_charged_nothing(config: str) -> None:
    """The first request goes to X; the second's first decision is the other replica Y
    (the smaller tree, the cursor's next), which is cordoned during its lookup: it is
    decided again and sent to X. Y used to be charged its prompt in the trees (and the
    cursor stepped twice) for a request it never got."""
    async with gateway([FakeReplica(), FakeReplica()], GATEWAY_CONFIGS[config]) as (gw, h):
        assert gw.pool is not None
        first = await h.post("/v1/completions", json=completion(words(200, 1)))
        x = first.headers["x-kvgate-replica"]
        y = next(r.id for r in gw.pool.all() if r.id != x)
        # what the second request's first decision is (explain: previewed, moves nothing)
        shown = await gw.prepare(
            "completion", "anonymous", completion(words(200, 2)), {}, "e", True
        )
        assert shown.replica == y
        _cordon_during_lookup(gw, y)
        second = await h.post("/v1/completions", json=completion(words(200, 2)))
        assert second.status_code == 200 and second.headers["x-kvgate-replica"] == x
        r = gw.router
        if config == "round_robin":
            assert r._rr == 2
            return
        charged = r._tree_tokens
        if config != "prefix_affinity":
            (charged,) = r._scope_trees.values()  # the one tenant's tree
        assert y not in charged and charged[x] > 0, charged
