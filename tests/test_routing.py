"""Routing strategies on plain data: each strategy's rule, ties, spill, isolation inputs."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from cachecore.index.base import PrefixMatch, empty_match
from cachecore.lifecycle import Tier
from cachecore.scoring import Coefficients, LoadView
from gateway.routing import (
    Candidate,
    MissTieBreak,
    NoCandidateError,
    Router,
    RouteRequest,
    RoutingParams,
    Strategy,
    rendezvous,
)

C = Coefficients()
REQ = RouteRequest(prompt_tokens=2048, block_size=16)


def match(blocks: int) -> PrefixMatch:
    return PrefixMatch(
        {Tier.GPU: blocks, Tier.CPU: 0, Tier.DISK: 0, Tier.REMOTE: 0}, blocks, blocks
    )


def router(seed: int = 0, **kw: object) -> Router:
    return Router(RoutingParams(**kw), random.Random(seed))  # type: ignore[arg-type]


def fleet(n: int = 4) -> list[Candidate]:
    return [Candidate(f"r{i}", LoadView()) for i in range(n)]


def test_expected_latency_prefers_the_cached_replica() -> None:
    cands = fleet()
    cands[2] = Candidate("r2", LoadView(), match(100))
    d = router().decide(REQ, cands, C)
    assert d.replica == "r2" and d.reason == "prefix_hit"
    assert d.predicted_cached_tokens == 1600
    assert {s.replica for s in d.scores} == {"r0", "r1", "r2", "r3"}


def test_expected_latency_avoids_an_overloaded_hit() -> None:
    cands = fleet()
    cands[2] = Candidate(
        "r2", LoadView(queued_prefill_tokens=50_000, queued_requests=30), match(100)
    )
    d = router(spill_queue_ms=None).decide(REQ, cands, C)
    assert d.replica != "r2"


def test_a_miss_is_charged_for_the_prefix_it_computes_again() -> None:
    """r0 holds 4,000 of 4,096 tokens behind a 1.5 s queue; r1 is idle. On its own TTFT the
    request goes to r1 (1,054 ms < 1,554 ms), recomputing the prefix; charged for that
    (1,000 ms at weight 1) it stays on r0, until r0's queue outweighs twice its hit."""
    req = RouteRequest(prompt_tokens=4096, block_size=16)
    queued = LoadView(queued_prefill_tokens=6000, queued_requests=2)  # 1,500 ms
    cands = [Candidate("r0", queued, match(250)), Candidate("r1", LoadView())]
    myopic = replace(C, recompute_weight=0.0)
    assert router().decide(req, cands, myopic).replica == "r1"
    d = router().decide(req, cands, C)
    assert (d.replica, d.reason) == ("r0", "prefix_hit")
    by = {s.replica: s for s in d.scores}
    assert by["r0"].recompute_ms == 0.0
    assert by["r1"].recompute_ms == pytest.approx(1000.0)  # (4096 - 96) tokens x 0.25 ms
    assert by["r1"].ttft_ms == pytest.approx(1054.0)  # the predicted TTFT leaves it out
    assert by["r1"].to_dict()["recompute_ms"] == pytest.approx(1000.0)
    longer = LoadView(queued_prefill_tokens=18_000, queued_requests=6)  # 4,500 ms
    cands[0] = Candidate("r0", longer, match(250))
    assert router().decide(req, cands, C).replica == "r1"


def test_no_recompute_charge_without_a_match_or_for_a_sensitive_request() -> None:
    busy = LoadView(queued_prefill_tokens=2000, queued_requests=1)
    cold = [Candidate("r0", busy), Candidate("r1", LoadView())]
    d = router().decide(REQ, cold, C)
    assert all(s.recompute_ms == 0.0 for s in d.scores) and d.replica == "r1"
    held = [Candidate("r0", busy, match(100)), Candidate("r1", LoadView())]
    sensitive = RouteRequest(prompt_tokens=2048, block_size=16, load_only=True)
    d = router().decide(sensitive, held, C)
    assert all(s.recompute_ms == 0.0 for s in d.scores) and d.replica == "r1"


def test_ties_are_broken_at_random_and_reproducibly() -> None:
    picks = Counter(router(seed=s).decide(REQ, fleet(), C).replica for s in range(200))
    assert set(picks) == {"r0", "r1", "r2", "r3"}
    assert min(picks.values()) > 20
    a = [router(seed=3).decide(REQ, fleet(), C).replica for _ in range(5)]
    b = [router(seed=3).decide(REQ, fleet(), C).replica for _ in range(5)]
    assert a == b


def test_ties_rotate_and_load_noise_ties_only_when_nothing_matches() -> None:
    r = router()
    cands = fleet()
    cands[0] = Candidate("r0", LoadView(queued_prefill_tokens=100))  # +25 ms of ~540: < 10%
    picks = [r.decide(REQ, cands, C) for _ in range(40)]
    # no replica holds the prompt: all four are tied, taken in rounds (each once per round)
    # whose order is random (not a fixed rotation another tenant could line up with)
    rounds = [tuple(d.replica for d in picks[4 * k : 4 * k + 4]) for k in range(10)]
    assert all(sorted(rd) == ["r0", "r1", "r2", "r3"] for rd in rounds)
    assert len(set(rounds)) > 3
    assert {d.reason for d in picks} == {"tie_round"}
    # without the relative band the 25 ms decide: r0 is never picked
    strict = router(tie_fraction=0.0)
    assert "r0" not in {strict.decide(REQ, cands, C).replica for _ in range(12)}
    # a match anywhere (here 16 tokens, 4 ms) switches the band off: that replica wins
    cands[1] = Candidate("r1", LoadView(), match(1))
    assert {r.decide(REQ, cands, C).replica for _ in range(12)} == {"r1"}


def test_spill_replicates_a_hot_prefix() -> None:
    req = RouteRequest(prompt_tokens=16_384, block_size=16)
    cands = fleet(3)
    hot = LoadView(queued_prefill_tokens=8400, queued_requests=3)  # 2100 ms of queue
    cands[0] = Candidate("r0", hot, match(1023))
    no_spill = router(spill_queue_ms=None).decide(req, cands, C)
    assert no_spill.replica == "r0"  # the hit still wins on cost (a miss costs ~4.1 s)
    d = router(spill_queue_ms=2000).decide(req, cands, C)
    assert d.replica in {"r1", "r2"} and d.reason == "spill"
    assert router(spill_queue_ms=3000).decide(req, cands, C).replica == "r0"


def test_a_busy_fleet_does_not_spill() -> None:
    """The spill bound is on the holder's queue beyond the shortest one: when every replica
    queues about as long, the prefix is not piling up and the hit keeps it."""
    req = RouteRequest(prompt_tokens=16_384, block_size=16)
    busy = LoadView(queued_prefill_tokens=8000, queued_requests=3)  # 2000 ms everywhere
    cands = [Candidate(f"r{i}", busy) for i in range(3)]
    hot = LoadView(queued_prefill_tokens=9600, queued_requests=4)  # 2400 ms: 400 beyond
    cands[0] = Candidate("r0", hot, match(1023))
    d = router(spill_queue_ms=2000).decide(req, cands, C)
    assert (d.replica, d.reason) == ("r0", "prefix_hit")
    # 2,000 ms beyond the shortest queue: now it piles up, and the request spills
    piled = LoadView(queued_prefill_tokens=16_400, queued_requests=6)  # 4100 ms
    cands[0] = Candidate("r0", piled, match(1023))
    d = router(spill_queue_ms=2000).decide(req, cands, C)
    assert d.replica in {"r1", "r2"} and d.reason == "spill"


def test_softmax_temperature_spreads_choices() -> None:
    cands = fleet(2)
    cands[0] = Candidate("r0", LoadView(), match(20))  # a bit cheaper
    cold = Counter(router(seed=s).decide(REQ, cands, C).replica for s in range(100))
    warm = Counter(
        router(seed=s, temperature=1.0).decide(REQ, cands, C).replica for s in range(300)
    )
    assert cold == Counter({"r0": 100})
    assert 0 < warm["r1"] < warm["r0"]


def test_round_robin_cycles() -> None:
    r = router(strategy=Strategy.ROUND_ROBIN)
    assert [r.decide(REQ, fleet(3), C).replica for _ in range(6)] == ["r0", "r1", "r2"] * 2


def test_least_loaded_picks_fewest_requests() -> None:
    cands = [Candidate("a", LoadView(running=5)), Candidate("b", LoadView(running=1, waiting=1))]
    assert router(strategy=Strategy.LEAST_LOADED).decide(REQ, cands, C).replica == "b"


def test_consistent_hash_is_sticky_and_moves_only_departed_keys() -> None:
    names = [f"r{i}" for i in range(5)]
    keys = [f"s{i}" for i in range(300)]
    before = {k: rendezvous(k, names) for k in keys}
    after = {k: rendezvous(k, names[:-1]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "r4" for k in moved)
    r = router(strategy=Strategy.CONSISTENT_HASH)
    req = RouteRequest(2048, 16, session_key="user-1")
    assert len({r.decide(req, fleet(), C).replica for _ in range(10)}) == 1


def test_prefix_affinity_follows_sglang_rules() -> None:
    r = router(strategy=Strategy.PREFIX_AFFINITY)
    cands = [Candidate("a", LoadView(running=1), match(100)), Candidate("b", LoadView())]
    d = r.decide(REQ, cands, C)
    assert (d.replica, d.reason) == ("a", "cache_hit")
    skew = [Candidate("a", LoadView(running=200), match(100)), Candidate("b", LoadView(running=10))]
    d = r.decide(REQ, skew, C)
    assert (d.replica, d.reason) == ("b", "imbalanced")
    # below the threshold: the replica with the smallest tree (a fresh router in which
    # only "a" has received a prompt)
    r = router(strategy=Strategy.PREFIX_AFFINITY)
    r.decide(REQ, [Candidate("a", LoadView())], C)
    small = [
        Candidate("a", LoadView(kv_usage=0.0), match(5)),
        Candidate("b", LoadView(kv_usage=0.9)),  # KV usage is not the tree: ignored
    ]
    d = r.decide(REQ, small, C)
    assert (d.replica, d.reason) == ("b", "smallest_tree")


def test_prefix_affinity_trees_grow_by_the_data_a_replica_did_not_hold() -> None:
    """SGLang's smallest tree: each pick adds the prompt's unmatched tokens to the picked
    replica's tree, so misses go where the least new data went, whatever the load."""
    r = router(strategy=Strategy.PREFIX_AFFINITY)
    two = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    first = r.decide(REQ, two, C).replica  # both empty: either
    other = "b" if first == "a" else "a"
    # the next miss goes to the other one, even when it is the busier
    busy = [Candidate(c.replica, LoadView(running=5 if c.replica == other else 0)) for c in two]
    assert r.decide(REQ, busy, C).replica == other
    # a hit on `first` (100 of 128 blocks held) grows its tree by the 28 blocks it lacked
    hit = [Candidate(first, LoadView(), match(100)), Candidate(other, LoadView())]
    d = r.decide(REQ, hit, C)
    assert (d.replica, d.reason) == (first, "cache_hit")
    # trees: first 2048 + 448, other 2048; a short miss goes to `other`
    short = RouteRequest(prompt_tokens=64, block_size=16)
    assert r.decide(short, two, C).replica == other
    # and now other has 2048 + 64 < 2496: still other
    assert r.decide(short, two, C).replica == other


def test_a_tied_miss_goes_where_its_scope_sent_the_least_new_data() -> None:
    """D14: among replicas whose costs tie on a miss, the one that received the least new
    prompt data from the request's own scope; outside a tie, cost decides as before."""
    r = router()
    two = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    big = RouteRequest(prompt_tokens=2048, block_size=16, scope_key="tenant:t")
    small = RouteRequest(prompt_tokens=64, block_size=16, scope_key="tenant:t")
    d = r.decide(big, two, C)
    assert d.reason == "smallest_tree"
    first = d.replica
    other = "b" if first == "a" else "a"
    # trees: first 2048, other 0: the next misses go to `other` until it catches up
    for _ in range(5):
        assert r.decide(small, two, C).replica == other
    # within the tie band (10% of the cost), a little busier does not matter (one decoding
    # request is more: the stall term charges 0.15 x (16 ms prefill + 30 ms step overhead)
    # for it, beyond the band) ...
    near = [
        Candidate(c.replica, LoadView(queued_prefill_tokens=8 if c.replica == other else 0))
        for c in two
    ]
    assert r.decide(small, near, C).replica == other
    # ... a real difference in cost does
    far = [
        Candidate(c.replica, LoadView(queued_prefill_tokens=8000 if c.replica == other else 0))
        for c in two
    ]
    assert r.decide(small, far, C).replica == first
    # a hit is not a tie-break matter
    hit = [Candidate(first, LoadView(), match(100)), Candidate(other, LoadView())]
    assert r.decide(big, hit, C).reason == "prefix_hit"
    # round keeps random rounds
    rr = router(miss_tie_break=MissTieBreak.ROUND)
    assert rr.decide(big, two, C).reason == "tie_round"


def test_scope_trees_do_not_move_with_other_tenants_traffic() -> None:
    """A tenant's tied misses follow its own data only: another tenant's large prefixes
    on one replica neither attract nor repel them (a global tree would repel them)."""
    two = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    b_busy = LoadView(queued_prefill_tokens=20_000)
    other_busy = [Candidate("a", LoadView()), Candidate("b", b_busy)]
    for seed in range(8):
        r = router(seed=seed)
        for _ in range(4):  # tenant x: 16k new tokens, all on "a" (b is far costlier)
            x = RouteRequest(prompt_tokens=4096, block_size=16, scope_key="tenant:x")
            assert r.decide(x, other_busy, C).replica == "a"
        y = RouteRequest(prompt_tokens=512, block_size=16, scope_key="tenant:y")
        first = r.decide(y, two, C).replica
        second = r.decide(y, two, C).replica
        assert second != first  # y's own tree, whichever replica x filled


@pytest.mark.parametrize("strategy", list(Strategy))
def test_a_preview_leaves_the_router_as_it_found_it(strategy: Strategy) -> None:
    """Decisions inside ``preview()`` (route/explain) move no tie round, cursor, tree or
    RNG draw: a router that previews between real decisions makes the same real ones as a
    router that never previewed, for every strategy."""
    cands = fleet(3)
    reqs = [
        RouteRequest(prompt_tokens=64 * (1 + i % 5), block_size=16, scope_key=f"tenant:{i % 2}")
        for i in range(24)
    ]
    plain, previewing = router(seed=5), router(seed=5)
    for i, req in enumerate(reqs):
        for _ in range(3):
            with previewing.preview():
                previewing.decide(reqs[(i * 7 + 3) % len(reqs)], cands, C, strategy)
        assert (
            previewing.decide(req, cands, C, strategy).replica
            == plain.decide(req, cands, C, strategy).replica
        )
    # and a preview does decide: it is the decision the next real request would get
    with previewing.preview():
        shown = previewing.decide(reqs[0], cands, C, strategy).replica
    assert previewing.decide(reqs[0], cands, C, strategy).replica == shown


def test_load_only_ignores_matches_and_is_session_sticky() -> None:
    cands = fleet()
    cands[1] = Candidate("r1", LoadView(), match(120))
    req = RouteRequest(2048, 16, session_key="sess", load_only=True)
    picks = {router(seed=s).decide(req, cands, C).replica for s in range(20)}
    assert len(picks) == 1
    d = router().decide(req, cands, C)
    assert d.reason == "sensitive_sticky"
    assert all(s.matched_blocks == 0 and s.predicted_cached_tokens == 0 for s in d.scores)
    # the decision is identical whether or not someone else cached the prefix
    d2 = router().decide(req, fleet(), C)
    assert d2.replica == d.replica


def test_sensitive_session_leaves_a_loaded_replica() -> None:
    names = [f"r{i}" for i in range(4)]
    home = rendezvous("sess", names)
    cands = [
        Candidate(n, LoadView(queued_prefill_tokens=40_000 if n == home else 0)) for n in names
    ]
    req = RouteRequest(2048, 16, session_key="sess", load_only=True)
    assert router().decide(req, cands, C).replica != home


def test_quarantined_replica_is_routed_by_load_only() -> None:
    cands = fleet(2)
    cands[0] = Candidate("r0", LoadView(running=2), match(120), quarantined=True)
    d = router().decide(REQ, cands, C)
    assert d.replica == "r1"
    assert d.scores[0].note == "quarantined" and d.scores[0].matched_blocks == 0


def test_cold_traffic_is_confined_but_warm_traffic_is_not() -> None:
    req = RouteRequest(2048, 16, cold_replicas=frozenset({"r3"}))
    assert {router(seed=s).decide(req, fleet(), C).replica for s in range(30)} == {"r3"}
    cands = fleet()
    cands[0] = Candidate("r0", LoadView(), match(100))
    assert router().decide(req, cands, C).replica == "r0"
    # sensitive and media requests ignore matches, so they are cold: confined as well (a
    # flooding tenant must not escape its replicas by marking its floods sensitive)
    kws: list[dict[str, Any]] = [{"load_only": True}, {"load_only": True, "unkeyed": True},
                                 {"load_only": True, "session_key": "s"}]  # fmt: skip
    for kw in kws:
        blind = RouteRequest(2048, 16, cold_replicas=frozenset({"r3"}), **kw)
        assert {router(seed=s).decide(blind, cands, C).replica for s in range(20)} == {"r3"}


def test_no_candidates_raises() -> None:
    with pytest.raises(NoCandidateError):
        router().decide(REQ, [], C)


def test_decision_serialises_for_explain() -> None:
    d = router().decide(REQ, fleet(2), C).to_dict()
    assert d["strategy"] == "expected_latency" and len(d["scores"]) == 2
    assert {"cost_ms", "queue_ms", "prefill_ms", "predicted_cached_tokens"} <= set(d["scores"][0])
    assert empty_match().stored_blocks == 0


def test_a_score_counts_the_requests_its_load_view_counts() -> None:
    """_score writes LoadView.requests out for speed: the two must agree."""
    loads = [
        LoadView(queued_requests=q, waiting=w, running=r)
        for q in (0, 2, 5)
        for w in (0, 3)
        for r in (0, 4)
    ]
    cands = [Candidate(f"r{i}", load) for i, load in enumerate(loads)]
    d = router().decide(RouteRequest(prompt_tokens=64, block_size=16), cands, Coefficients())
    assert [s.requests for s in d.scores] == [load.requests for load in loads]
