"""D26: D9's tie rounds and the router's random draws are kept per isolation scope.

The H29 red team found the tie rounds one set for every tenant, drawn from one shared
generator: with two replicas, tenant b's two load-routed requests in a row landed on both
replicas every time (0 of 14 on one), and on one replica about half the time when another
tenant's tied request came between them (14 of 26). So b counted the others' load-routed
requests (sensitive, media, batches) and, where keyed requests tie, whether theirs hit.
Now each scope takes its ties in rounds of its own and draws from a generator of its own
(seeded from the router's root generator when the scope is first met), so b's placements
are a function of b's own requests and the replicas' load only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from cachecore.keys import Scope, ScopeKind
from cachecore.scoring import Coefficients, LoadView
from gateway import routing
from gateway.routing import (
    Candidate,
    MissTieBreak,
    Router,
    RouteRequest,
    RoutingParams,
    ScopeDraws,
    Strategy,
)
from tests.test_gateway_support import stack, words
from tests.test_isolation import auth, key_store

pytestmark = pytest.mark.timeout(120)

C = Coefficients()
A, B = "tenant:a", "tenant:b"


def fleet(n: int = 2) -> list[Candidate]:
    return [Candidate(f"r{i}", LoadView()) for i in range(n)]


def sensitive(scope: str, tokens: int = 64) -> RouteRequest:
    """A load-routed request (a sensitive scope's, a media or batch request)."""
    return RouteRequest(tokens, 16, load_only=True, scope_key=scope)


def miss(scope: str, tokens: int = 64) -> RouteRequest:
    """A keyed request that no replica holds: a tie on an idle fleet."""
    return RouteRequest(tokens, 16, scope_key=scope)


# how each kind of decision that draws or takes a tie is made: (params, request maker)
DRAWS: dict[str, tuple[RoutingParams, Callable[[str], RouteRequest]]] = {
    "load_only": (RoutingParams(), sensitive),
    "round": (RoutingParams(miss_tie_break=MissTieBreak.ROUND), miss),
    "scope_tree": (RoutingParams(), miss),  # equal trees: a draw among them
    "temperature": (RoutingParams(temperature=0.5), miss),
}


def b_picks(config: str, others: Callable[[int], int], seed: int, n: int = 40) -> list[str]:
    """Tenant b's ``n`` picks on an idle fleet of two, ``others(i)`` of tenant a's decisions
    of the same kind (ties, draws) made after b's i-th one."""
    params, make = DRAWS[config]
    r = Router(params, random.Random(seed))
    cands = fleet()
    out = []
    for i in range(n):
        out.append(r.decide(make(B), cands, C).replica)
        for _ in range(others(i)):
            r.decide(make(A), cands, C)
    return out


@pytest.mark.parametrize("config", DRAWS)
def test_a_tenants_placements_do_not_depend_on_other_tenants_decisions(config: str) -> None:
    """(a) The red team's measurement, made exact: tenant b's pick sequence is the same
    whether or not tenant a's tied decisions (one to three) come between b's. With one
    set of rounds and one generator it was not: a's ties moved b's rounds and a's draws
    shifted b's. b meets the router first in both (its generator is seeded from the root
    one when its scope is first met: a scope met later gets another, as unpredictable)."""
    for seed in range(4):
        alone = b_picks(config, lambda i: 0, seed)
        mixed = b_picks(config, lambda i: 1 + i * 7 % 3, seed)
        assert mixed == alone, (seed, alone, mixed)
        assert len(set(alone)) == 2  # b's ties do spread (not one replica every time)


def same_replica_pairs(between: int, seed: int, pairs: int = 40) -> int:
    """How often tenant b's two load-routed requests in a row land on the same replica,
    ``between`` tied requests of tenant a's sent between the two (the red team's count)."""
    r = Router(RoutingParams(), random.Random(seed))
    cands = fleet()
    same = 0
    for _ in range(pairs):
        first = r.decide(sensitive(B), cands, C).replica
        for _ in range(between):
            r.decide(sensitive(A), cands, C)
        same += r.decide(sensitive(B), cands, C).replica == first
    return same


def test_back_to_back_requests_land_alike_whatever_others_sent_between() -> None:
    """(a) as the red team counted it: b's pairs land on both replicas every time, with or
    without a's tied request between the two (before: about half the pairs on one replica
    with a's request between, none without)."""
    for seed in range(3):
        assert [same_replica_pairs(k, seed) for k in (0, 1, 2)] == [0, 0, 0], seed


@pytest.mark.parametrize("config", ["load_only", "round"])
def test_a_scopes_ties_spread_in_rounds_of_their_own(config: str) -> None:
    """(b) Per-scope rounds spread one scope's ties as D9's rounds did: each tied replica
    once per round, in an order nobody can predict, however many ties other scopes took
    in between."""
    params, make = DRAWS[config]
    r = Router(params, random.Random(2))
    cands = fleet(4)
    rng = random.Random(5)
    picks = []
    for _ in range(40):
        d = r.decide(make("tenant:x"), cands, C)
        assert d.reason in ("sensitive_load", "tie_round"), d.reason
        picks.append(d.replica)
        for _ in range(rng.randrange(4)):
            r.decide(make(f"tenant:y{rng.randrange(3)}"), cands, C)
    rounds = [tuple(picks[4 * k : 4 * k + 4]) for k in range(10)]
    assert all(sorted(rd) == ["r0", "r1", "r2", "r3"] for rd in rounds), rounds
    assert len(set(rounds)) > 3


def test_a_request_without_a_scope_keeps_the_shared_round() -> None:
    """A request with no scope takes its ties in the one shared round, with the root
    generator, as before D26; a scope's ties leave that round alone."""
    r = Router(RoutingParams(), random.Random(0))
    cands = fleet(3)
    shared = [r.decide(sensitive(None), cands, C).replica for _ in range(2)]  # type: ignore[arg-type]
    assert r.tie_round() == frozenset(shared) and len(set(shared)) == 2
    x = r.decide(sensitive("tenant:x"), cands, C).replica
    assert r.tie_round() == frozenset(shared) and r.tie_round("tenant:x") == {x}


def test_strategies_that_are_no_isolation_default_keep_the_root_generator() -> None:
    """random, least_loaded and consistent_hash without a key draw from the root generator
    and make no scope state (D26 says so)."""
    for strategy in (Strategy.RANDOM, Strategy.LEAST_LOADED, Strategy.CONSISTENT_HASH):
        r = Router(RoutingParams(), random.Random(1))
        twin = random.Random(1)
        for _ in range(5):
            d = r.decide(miss("tenant:x"), fleet(), C, strategy)
            assert d.replica == twin.choice(fleet()).replica, strategy
        assert r._scope_draws == {}


# ------------------------------------------------------------------ the router's contracts


def held_round_rechecked(others: str) -> tuple[str, frozenset[str]]:
    """A decision of scope x held uncommitted while two ``others`` decisions are taken."""
    r = Router(RoutingParams(miss_tie_break=MissTieBreak.ROUND), random.Random(0))
    held = r.decide(miss("tenant:x"), fleet(), C, commit=False)
    assert r.tie_round("tenant:x") == frozenset()  # uncommitted: no round moves
    r.decide(miss(others), fleet(), C)
    r.decide(miss(others), fleet(), C)
    assert r.tie_round(others) == {"r0", "r1"}
    r.commit(held)
    r.commit(held)  # once
    return held.replica, r.tie_round("tenant:x")


def test_commit_applies_a_decision_to_its_own_scopes_round() -> None:
    """(c) commit: a decision held while its own scope's round filled begins a new round
    (as decide would have on that round); while other scopes filled theirs, it joins its
    scope's round as decided (theirs never reach it)."""
    pick, rounds = held_round_rechecked("tenant:x")
    assert rounds == {pick}  # a new round of x's
    pick, rounds = held_round_rechecked("tenant:y")
    assert rounds == {pick}  # x's round had nothing: pick joins it
    r = Router(RoutingParams(), random.Random(0))
    d = r.decide(sensitive("tenant:x"), fleet(3), C, commit=False)
    assert d.effects is not None and d.effects.scope == "tenant:x"
    r.decide(sensitive("tenant:y"), fleet(3), C)
    before = r.tie_round("tenant:y")
    r.commit(d)
    assert r.tie_round("tenant:x") == {d.replica} and r.tie_round("tenant:y") == before
    assert r.tie_round() == frozenset()  # and not the shared round


def test_retract_takes_a_pick_out_of_its_own_scopes_round_only() -> None:
    """(c) retract: the pick leaves its scope's round; another scope's round holding the
    same replica keeps it; a scope evicted since is not made again."""
    r = Router(RoutingParams(), random.Random(0))
    cands = fleet(3)
    x = r.decide(sensitive("tenant:x"), cands, C)
    pair = [c for c in cands if c.replica != x.replica][:1] + [
        c for c in cands if c.replica == x.replica
    ]
    y1 = r.decide(sensitive("tenant:y"), pair, C)
    y2 = r.decide(sensitive("tenant:y"), pair, C)
    assert r.tie_round("tenant:y") == {c.replica for c in pair}  # x's pick in it too
    r.retract(x)
    assert r.tie_round("tenant:x") == frozenset()
    assert r.tie_round("tenant:y") == {c.replica for c in pair}
    r.retract(y2)
    assert r.tie_round("tenant:y") == {y1.replica}
    assert r.tie_round() == frozenset()  # the shared round never had them
    r._scope_draws.clear()  # evicted from the LRU before the connection failed
    r.retract(y1)
    assert r._scope_draws == {}


def test_forget_takes_a_replica_out_of_every_scopes_round() -> None:
    """(c) forget: a replica removed for good leaves the shared round and every scope's."""
    r = Router(RoutingParams(), random.Random(0))
    cands = fleet(3)
    for scope in ("tenant:x", "tenant:y", "group:g", None):
        for _ in range(2):
            r.decide(sensitive(scope), cands, C)  # type: ignore[arg-type]
    held = [r.tie_round(s) for s in ("tenant:x", "tenant:y", "group:g", None)]
    assert any("r1" in h for h in held)
    r.forget("r1")
    for s, before in zip(("tenant:x", "tenant:y", "group:g", None), held, strict=True):
        assert r.tie_round(s) == before - {"r1"}, s


def snapshot(r: Router) -> list[tuple[str, frozenset[str], Any]]:
    """Every scope's rounds and generator state, in LRU order."""
    return [(k, frozenset(v.rounds), v.rng.getstate()) for k, v in r._scope_draws.items()]


@pytest.mark.parametrize("config", DRAWS)
def test_a_preview_leaves_every_scopes_rounds_and_generator_as_found(config: str) -> None:
    """(c) preview (route/explain): decisions inside, committed or not, of scopes the router
    has and of one it has not, nested too, move no scope's rounds, generator or LRU place;
    the real decisions after are those of a router that never previewed. Only the scopes a
    preview uses are copied."""
    params, make = DRAWS[config]
    plain, previewing = Router(params, random.Random(4)), Router(params, random.Random(4))
    cands = fleet(3)
    for i in range(200):  # scopes a preview must not copy
        for r in (plain, previewing):
            r.decide(make(f"tenant:old{i}"), cands, C)
    copies = 0
    real_copy = ScopeDraws.copy

    def counting_copy(self: ScopeDraws) -> ScopeDraws:
        nonlocal copies
        copies += 1
        return real_copy(self)

    for i in range(30):
        scope = f"tenant:{i % 3}"
        before = snapshot(previewing)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ScopeDraws, "copy", counting_copy)
            copies = 0
            with previewing.preview():
                previewing.decide(make(f"tenant:{(i + 1) % 3}"), cands, C)
                previewing.decide(make("tenant:new"), cands, C, commit=False)
                with previewing.preview():
                    previewing.decide(make(scope), cands, C)
        assert snapshot(previewing) == before, i
        assert "tenant:new" not in previewing._scope_draws
        # the scopes used: one, then the nested preview's copies of two and one more
        assert copies <= 4, copies
        got = previewing.decide(make(scope), cands, C)
        want = plain.decide(make(scope), cands, C)
        assert (got.replica, got.reason) == (want.replica, want.reason), i
    with previewing.preview():
        shown = previewing.decide(make("tenant:0"), cands, C).replica
    assert previewing.decide(make("tenant:0"), cands, C).replica == shown


def test_scope_draws_are_bounded_like_the_scope_trees() -> None:
    """An LRU of MAX_SCOPE_TREES scopes: the least recently used goes; one in use stays."""
    r = Router(RoutingParams(), random.Random(0))
    cands = fleet()
    r.decide(sensitive("tenant:0"), cands, C)
    r.decide(sensitive("tenant:1"), cands, C)
    for i in range(2, routing.MAX_SCOPE_TREES + 9):
        if i % 100 == 0:
            r.decide(sensitive("tenant:0"), cands, C)
        r.decide(sensitive(f"tenant:{i}"), cands, C)
    assert len(r._scope_draws) == routing.MAX_SCOPE_TREES
    assert "tenant:0" in r._scope_draws and "tenant:1" not in r._scope_draws


def test_a_per_request_scope_takes_its_ties_in_its_tenants_request_rounds() -> None:
    """A per-request scope (sensitive: request) is one request: its rounds are its tenant's
    per-request scopes' together, so a tenant's sensitive requests still spread in rounds,
    and a flood of them makes one entry, not one per request. A session scope, a tenant and
    a trust group are their own."""
    assert Scope(ScopeKind.REQUEST, "acme/0f3a").routing_key() == "request:acme"
    assert Scope(ScopeKind.REQUEST, "a/b/0f3a").routing_key() == "request:a/b"
    assert Scope(ScopeKind.SESSION, "acme/s1").routing_key() == "session:acme/s1"
    assert Scope(ScopeKind.TENANT, "acme").routing_key() == "tenant:acme"
    assert Scope(ScopeKind.GROUP, "g").routing_key() == "group:g"


# ------------------------------------------------------------------ end to end


SENSITIVE = {"x-kvgate-sensitive": "request"}


async def _send(h: httpx.AsyncClient, model: str, key: str, seed: int) -> str:
    body = {"model": model, "prompt": words(40, seed), "max_tokens": 1}
    r = await h.post("/v1/completions", json=body, headers=auth(key) | SENSITIVE)
    assert r.status_code == 200, r.text
    return r.headers["x-kvgate-replica"]


async def test_a_tenant_cannot_count_another_tenants_sensitive_requests() -> None:
    """(a) end to end, the red team's probe: two tenants, two replicas, tenant b sends
    sensitive requests in pairs, with and without one of tenant a's sensitive requests
    between the two. b's pairs land on both replicas every time in both arms (before:
    every time without a's request, about half the time with it)."""
    policy = "default_tenant: {sensitive: {allow_header: true}}"
    async with (
        stack(count=2, policy=policy, build={"key_store": key_store()}, open_access=False) as st,
        st.http() as h,
    ):
        seed = 0
        same = {0: 0, 1: 0}
        for k in range(24):
            between = k % 2
            seed += 1
            first = await _send(h, st.model, "sk-b", seed)
            for _ in range(between):
                seed += 1
                await _send(h, st.model, "sk-a", seed)
            seed += 1
            same[between] += await _send(h, st.model, "sk-b", seed) == first
        assert same == {0: 0, 1: 0}, same
        # b's per-request scopes share one entry of b's, a's one of a's
        assert set(st.gw.router._scope_draws) == {"request:b", "request:a"}
