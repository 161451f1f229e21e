"""Routing strategies: pure functions of plain data, shared by the gateway and the simulator.

A decision takes the candidate replicas (each with its scoped :class:`PrefixMatch`, its
:class:`LoadView` and whether it is quarantined), the request's shape and the current cost
coefficients, and returns the chosen replica, the reason, and a per-replica breakdown. No
HTTP, no index, no clock and no asyncio here: the caller looks up, the caller dispatches.
Randomness comes from the ``random.Random`` the caller passes in, so runs are reproducible.

Isolation contract: the only prompt-dependent input is ``Candidate.match``, which the caller
looks up under the request's own scope; a ``load_only`` request (sensitive scope) and a
quarantined replica's match are ignored entirely.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter
from typing import Any

import xxhash

from cachecore.index.base import NO_MATCH, PrefixMatch
from cachecore.scoring import (
    Coefficients,
    HitPrediction,
    LoadView,
    cost,
    cost_terms,
    predict_hit,
)


class Strategy(StrEnum):
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    LEAST_LOADED = "least_loaded"
    CONSISTENT_HASH = "consistent_hash"
    PREFIX_AFFINITY = "prefix_affinity"
    EXPECTED_LATENCY = "expected_latency"


class NoCandidateError(LookupError):
    """No replica can take the request (none healthy, none serves the model)."""


class MissTieBreak(StrEnum):
    ROUND = "round"
    SCOPE_TREE = "scope_tree"


MAX_SCOPE_TREES = 4096
"""Scopes whose routed data the router remembers (LRU): a forgotten one starts over. The
same bound holds the scopes' tie rounds and generators (D26)."""


@dataclass(frozen=True, slots=True)
class RoutingParams:
    """Strategy knobs (from the policy's ``routing`` section).

    ``tie_epsilon_ms`` / ``tie_fraction``: costs within ``tie_epsilon_ms`` of the best are
    ties, taken in random rounds (each tied replica once per round; per isolation scope,
    D26); when no replica holds any
    of the prompt, within ``max(tie_epsilon_ms, tie_fraction * best)``: the costs then
    differ only by load estimates, whose noise should not decide, and the rounds spread such
    requests about as evenly as round_robin (measured: short-unique p99 at 85% load).
    ``temperature``: 0 picks the lowest cost; > 0 samples with weights
    ``exp(-(cost - best) / (temperature * best))`` (dimensionless, relative to the best).
    ``spill_queue_ms`` (None: off, the default, D12): when the cheapest replica holds a
    prefix match and its queue wait exceeds the fleet's shortest by more than this, the
    request goes to the cheapest replica within that bound, so a hot prefix is replicated
    instead of piling up. Relative, because an absolute bound fires on every long prompt in
    a busy fleet (one queued 8k-token prefill is 2 s) and trades hits for nothing.
    ``cache_threshold`` / ``balance_*``: SGLang / vllm-router ``cache_aware`` defaults.
    ``sticky_slack`` / ``sticky_slack_ms``: a sensitive request may go to any replica whose
    load-only cost is within ``best * (1 + slack) + slack_ms``; among those its session
    hashes to a fixed one (reuse within the session, no cross-scope signal).
    ``cold_fraction``: a request whose best match covers less than this fraction of its
    prompt is "cold" (for confining a flooding tenant's cold traffic).
    ``miss_tie_break``: how expected_latency breaks a tie when no replica holds any of the
    prompt: ``scope_tree`` (D14) to the tied replica that has received the least new prompt
    data *from the request's own scope* (SGLang's smallest tree, kept per tenant so no other
    tenant's traffic moves it), ``round`` to random rounds only (D9).
    """

    strategy: Strategy = Strategy.EXPECTED_LATENCY
    temperature: float = 0.0
    tie_epsilon_ms: float = 0.5
    tie_fraction: float = 0.1
    spill_queue_ms: float | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    sticky_slack: float = 0.25
    sticky_slack_ms: float = 50.0
    cold_fraction: float = 0.1
    miss_tie_break: MissTieBreak = MissTieBreak.SCOPE_TREE


@dataclass(slots=True)  # built per replica per request: not frozen (3x cheaper); read-only
class Candidate:
    replica: str
    load: LoadView
    match: PrefixMatch = NO_MATCH
    quarantined: bool = False


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_tokens: int
    block_size: int
    session_key: str | None = None
    load_only: bool = False  # sensitive (ephemeral) scope: never use any match
    unkeyed: bool = False  # load_only because the gateway cannot key it (media parts)
    cold_replicas: frozenset[str] | None = None  # confine this tenant's cold traffic
    # the isolation scope (tenant or trust group): D14's trees and D26's tie rounds and
    # draws are kept per scope; None: the shared round and the root generator
    scope_key: str | None = None
    # blocks the engine drops off every prefix hit (the pool's hit_drop_blocks: 1 for vLLM
    # with EAGLE/EAGLE3/MTP drafting), so predictions equal its cached_tokens
    hit_drop_blocks: int = 0


@dataclass(slots=True)  # built per replica per request: not frozen (3x cheaper); read-only
class ReplicaScore:
    replica: str
    cost_ms: float
    queue_ms: float
    prefill_ms: float
    load_ms: float
    matched_blocks: int  # the match the decision used (0 when ignored)
    predicted_cached_tokens: int
    requests: int
    eligible: bool
    note: str = ""
    stall_ms: float = 0.0  # cost_ms = predicted TTFT + stall_ms (cachecore.scoring)
    recompute_ms: float = 0.0  # + this: charged in Router._score (D12)
    # prompt tokens the replica holds, where not predicted_cached_tokens: a hit on an engine
    # that drops blocks off it (hit_drop_blocks) holds the dropped blocks all the same
    held_tokens: int | None = None

    @property
    def ttft_ms(self) -> float:
        return self.cost_ms - self.stall_ms - self.recompute_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "cost_ms": round(self.cost_ms, 3),
            "queue_ms": round(self.queue_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "load_ms": round(self.load_ms, 3),
            "stall_ms": round(self.stall_ms, 3),
            "recompute_ms": round(self.recompute_ms, 3),
            "matched_blocks": self.matched_blocks,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "requests": self.requests,
            "eligible": self.eligible,
            "note": self.note,
        }


@dataclass(slots=True)
class Effects:
    """What a decision changes in its router, applied by :meth:`Router.commit`: the
    round-robin step, the tie rounds, the tree growth. Recorded by :meth:`Router.decide`,
    so a decision nobody sends (refused by the tenant's budget, decided again over other
    replicas) moves nothing."""

    seq: int  # the router's commits when decided: a later one re-checks its rounds
    rr: bool = False
    # per tie taken: (pick, whether it began a new round, the tied replicas)
    rounds: list[tuple[str, bool, list[ReplicaScore]]] | None = None
    # whose tie rounds and generator the decision used (D26): the request's isolation scope
    # for expected_latency and load-only decisions, None for the shared ones
    scope: str | None = None
    tree: tuple[str, int] | None = None  # prefix_affinity's (replica, new tokens)
    scope_tree: tuple[str, str, int] | None = None  # D14's (scope, replica, new tokens)
    done: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    strategy: Strategy
    reason: str
    scores: tuple[ReplicaScore, ...]
    effects: Effects | None = field(default=None, compare=False, repr=False)

    @property
    def chosen(self) -> ReplicaScore:
        for s in self.scores:
            if s.replica == self.replica:
                return s
        raise KeyError(self.replica)  # pragma: no cover - a decision always scores its pick

    @property
    def predicted_cached_tokens(self) -> int:
        return self.chosen.predicted_cached_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "strategy": self.strategy.value,
            "reason": self.reason,
            "scores": [s.to_dict() for s in self.scores],
        }


# per-replica fields read over every candidate of a decision: C loops (min(map(...)))
_COST_MS = attrgetter("cost_ms")
_MATCHED_BLOCKS = attrgetter("matched_blocks")
_REQUESTS = attrgetter("requests")
_NOTE = attrgetter("note")
_QUARANTINED = attrgetter("quarantined")  # read over the candidates


def _matched_blocks(hit: HitPrediction, block_size: int) -> int:
    """Blocks a decision used from a match: stored on any tier or pending."""
    return (hit.stored_tokens + hit.pending_tokens) // block_size


def temperature_on(params: RoutingParams, scores: Sequence[ReplicaScore]) -> bool:
    """Whether expected_latency samples by cost (softmax) instead of taking the lowest."""
    return params.temperature > 0 and len(scores) > 1


def _new_tokens(req: RouteRequest, pick: ReplicaScore) -> int:
    """What a pick adds to its replica's tree: the prompt tokens it did not hold (blocks
    the engine drops off a hit and computes again are held: not new to its cache)."""
    held = pick.predicted_cached_tokens if pick.held_tokens is None else pick.held_tokens
    return max(0, req.prompt_tokens - held)


def _take_rounds(
    rounds: set[str], taken: Sequence[tuple[str, bool, Sequence[ReplicaScore]]], recheck: bool
) -> None:
    """Apply ties taken to the tie rounds: a new round first when every tied replica had one
    in this round (``recheck``: judged on ``rounds`` as it is now, else as when decided)."""
    for pick, new_round, ties in taken:
        if recheck:
            new_round = all(s.replica in rounds for s in ties)
        if new_round:
            rounds.clear()
        rounds.add(pick)


@dataclass(slots=True, eq=False)
class ScopeDraws:
    """One isolation scope's tie rounds and random generator (D26): a scope's ties and
    draws depend on its own decisions only, never on how many other tenants made. The
    generator is seeded from the router's root generator when the scope is first met."""

    rng: random.Random
    rounds: set[str] = field(default_factory=set)  # replicas its ties went to this round

    def copy(self) -> ScopeDraws:
        rng = random.Random(0)
        rng.setstate(self.rng.getstate())
        return ScopeDraws(rng, set(self.rounds))


def _shrink(tree: dict[str, int], replica: str, tokens: int) -> None:
    """Take ``tokens`` back from ``replica``'s entry; an entry at zero or below goes."""
    left = tree.get(replica, 0) - tokens
    if left > 0:
        tree[replica] = left
    else:
        tree.pop(replica, None)


def rendezvous_weight(key: str, replica: str) -> int:
    """``replica``'s highest-random-weight score for ``key``."""
    return xxhash.xxh3_64_intdigest(f"{key}\x00{replica}".encode())


def rendezvous(key: str, replicas: Sequence[str]) -> str:
    """Highest-random-weight hashing: stable when replicas join or leave (only the keys of
    a departed replica move)."""
    return max(replicas, key=lambda r: rendezvous_weight(key, r))


class Router:
    """Holds what a strategy needs between decisions (the round-robin cursor, the RNG, the
    tie rounds, the trees); everything else arrives with each call.

    Per isolation scope (D14, D26): expected_latency's and load-only decisions take their
    ties in the request's scope's own rounds and draw from its own generator, so no tenant's
    placements depend on how many requests other tenants sent, or whether theirs hit. A
    request without a scope, and the strategies that are no isolation default (round_robin's
    cursor, random, consistent_hash without a key, least_loaded, prefix_affinity), use the
    shared rounds and the root generator ``rng``."""

    def __init__(self, params: RoutingParams, rng: random.Random) -> None:
        self.params = params
        self.rng = rng
        self._rr = 0
        self._round: set[str] = set()  # replicas a tie went to in the current round
        # D26: per isolation scope, its tie rounds and generator (LRU, as the scope trees)
        self._scope_draws: OrderedDict[str, ScopeDraws] = OrderedDict()
        # inside preview(): the copies of the scopes' draws it used (the originals untouched)
        self._previewed: dict[str, ScopeDraws] | None = None
        # prefix_affinity's stand-in for SGLang's per-worker tree size: prompt tokens it sent
        # to each replica that the replica did not hold (SGLang counts the characters its
        # approximate tree gained per worker; neither forgets on engine evictions)
        self._tree_tokens: dict[str, int] = {}
        # expected_latency's miss tie-break (D14): per isolation scope, the prompt tokens it
        # sent to each replica that the replica did not hold
        self._scope_trees: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._commits = 0  # decisions committed: tells a decision whether it is the latest

    @contextmanager
    def preview(self) -> Iterator[None]:
        """Decisions made inside leave the router as they found it: the round-robin cursor,
        the tie rounds, the trees and the RNG, the scopes' own rounds and generators (and
        their LRU) too. For ``/admin/route/explain``, which must show what a request would
        get without moving what the next real request gets (an operator's explains would
        otherwise steer ties and rounds). A scope's rounds and generator are copied when a
        decision inside first uses them, not all 4,096 up front. Safe under asyncio:
        :meth:`decide` never awaits, so nothing else decides in between."""
        rr, rounds, rng = self._rr, set(self._round), self.rng.getstate()
        trees, commits = dict(self._tree_tokens), self._commits
        scope_trees = OrderedDict((k, dict(v)) for k, v in self._scope_trees.items())
        outer = self._previewed  # a preview inside one: on copies of the outer's copies
        self._previewed = {} if outer is None else {k: v.copy() for k, v in outer.items()}
        try:
            yield
        finally:
            self._rr, self._round, self._commits = rr, rounds, commits
            self.rng.setstate(rng)
            self._tree_tokens, self._scope_trees = trees, scope_trees
            self._previewed = outer

    def decide(
        self,
        req: RouteRequest,
        candidates: Sequence[Candidate],
        coeffs: Coefficients,
        strategy: Strategy | None = None,
        commit: bool = True,
    ) -> Decision:
        """Choose a replica. ``commit`` (the default) applies the decision's effects on the
        router at once; ``commit=False`` leaves them to :meth:`commit`, for a caller that
        may not send the request: until then the cursor, the tie rounds and the trees stay
        as they were. The RNG's draws are not held back: a draw is no accounting (no later
        decision's odds depend on how many came before), and undoing one would cost a
        getstate/setstate of the generator's 2.5 KB per request; :meth:`preview` restores
        it, as explain promises the next request's decision. Nor is a scope's first draw: it
        makes the scope's rounds and generator (D26), empty rounds until a commit."""
        if not candidates:
            raise NoCandidateError("no healthy replica serves this request")
        strat = strategy or self.params.strategy
        scores = self._score(req, candidates, coeffs)
        eligible = [s for s in scores if s.eligible]
        if not eligible:  # a confined tenant's cold request, none of its replicas offered
            raise NoCandidateError("none of the tenant's cold replicas can take this request")
        fx = Effects(self._commits)
        if req.load_only or strat is Strategy.EXPECTED_LATENCY:
            fx.scope = req.scope_key  # its ties and draws: the scope's own (D26)
        if req.load_only:
            pick, reason = self._load_only(req, eligible, fx)
        elif strat is Strategy.EXPECTED_LATENCY:
            pick, reason = self._expected_latency(req, eligible, fx)
        elif strat is Strategy.PREFIX_AFFINITY:
            pick, reason = self._prefix_affinity(req, eligible, fx)
        elif strat is Strategy.LEAST_LOADED:
            pick, reason = self._least_loaded(eligible)
        elif strat is Strategy.CONSISTENT_HASH:
            if req.session_key:
                pick = rendezvous(req.session_key, [s.replica for s in eligible])
                reason = "hash"
            else:
                pick, reason = self.rng.choice(eligible).replica, "no_session_key"
        elif strat is Strategy.ROUND_ROBIN:
            pick = eligible[self._rr % len(eligible)].replica
            fx.rr = True
            reason = "round_robin"
        else:
            pick, reason = self.rng.choice(eligible).replica, "random"
        decision = Decision(pick, strat, reason, tuple(scores), fx)
        if commit:
            self.commit(decision)
        return decision

    def commit(self, decision: Decision) -> None:
        """Apply what ``decision`` changes in the router, as ``decide`` would have: once (a
        decision committed already, by ``decide`` too, changes nothing again). A decision
        committed after others re-checks whether its ties began a new round on the rounds
        they left."""
        fx = decision.effects
        if fx is None or fx.done:
            return
        fx.done = True
        if fx.rr:
            self._rr += 1
        if fx.rounds:
            # re-checked when any decision committed in between (another scope's too: on
            # rounds nobody else moved the re-check finds what the decision found)
            _take_rounds(self._tie_rounds(fx.scope), fx.rounds, fx.seq != self._commits)
        if fx.tree is not None:
            replica, new = fx.tree
            self._tree_tokens[replica] = self._tree_tokens.get(replica, 0) + new
        if fx.scope_tree is not None:
            scope, replica, new = fx.scope_tree
            tree = self._scope_tree(scope)
            tree[replica] = tree.get(replica, 0) + new
        self._commits += 1

    def retract(self, decision: Decision, trees: bool = True) -> None:
        """Take back what a committed ``decision`` changed, for a request that never reached
        its replica (the connection was refused): the round-robin step, its pick's place in
        the tie round, and (``trees``) what it added to the trees, without a commit of its
        own. A round the decision began stays begun (the one before is not kept); a tree
        entry taken to zero goes, and a scope tree or a scope's rounds (D26) evicted since
        are not made again. A decision not committed, or retracted already, changes
        nothing."""
        fx = decision.effects
        if fx is None or not fx.done:
            return
        fx.done = False
        if fx.rr:
            self._rr -= 1
        if fx.rounds:
            if fx.scope is None:
                rounds = self._round
            else:  # the scope's own rounds; evicted since: not made again
                draws = self._peek_draws(fx.scope)
                rounds = set() if draws is None else draws.rounds
            for pick, _, _ in fx.rounds:
                rounds.discard(pick)
        if not trees:
            return
        if fx.tree is not None:
            _shrink(self._tree_tokens, *fx.tree)
        if fx.scope_tree is not None:
            scope, replica, new = fx.scope_tree
            tree = self._scope_trees.get(scope)
            if tree is not None:
                _shrink(tree, replica, new)
                if not tree:
                    del self._scope_trees[scope]

    def forget(self, replica: str) -> None:
        """``replica`` was removed for good: its tree sizes and its places in the tie rounds
        (the shared round and every scope's) go (one entry per replica id ever routed to,
        else); back under the same id it starts as a new replica, with empty trees. A scope
        tree left empty is dropped (it reads as absent); a scope's rounds left empty stay
        with its generator."""
        self._tree_tokens.pop(replica, None)
        self._round.discard(replica)
        for draws in self._scope_draws.values():
            draws.rounds.discard(replica)
        for draws in (self._previewed or {}).values():
            draws.rounds.discard(replica)
        trees = self._scope_trees
        for scope in [s for s, tree in trees.items() if tree.pop(replica, None) is not None]:
            if not trees[scope]:
                del trees[scope]

    # ------------------------------------------------------------------ scope draws
    def _draws(self, scope: str) -> ScopeDraws:
        """``scope``'s tie rounds and generator (D26), made on first use with a generator
        seeded from the root one (deterministic under a seeded router, unpredictable under
        an OS-seeded one); its LRU place moves. Inside :meth:`preview`, a copy."""
        seen = self._previewed
        if seen is not None:
            draws = seen.get(scope)
            if draws is None:
                real = self._scope_draws.get(scope)
                draws = seen[scope] = (
                    ScopeDraws(random.Random(self.rng.getrandbits(64)))
                    if real is None
                    else real.copy()
                )
            return draws
        states = self._scope_draws
        draws = states.get(scope)
        if draws is None:
            draws = states[scope] = ScopeDraws(random.Random(self.rng.getrandbits(64)))
            if len(states) > MAX_SCOPE_TREES:
                states.popitem(last=False)
        else:
            states.move_to_end(scope)
        return draws

    def _peek_draws(self, scope: str) -> ScopeDraws | None:
        """``scope``'s rounds and generator if the router has them; makes and moves nothing."""
        seen = self._previewed
        if seen is not None and scope in seen:
            return seen[scope]
        return self._scope_draws.get(scope)

    def _tie_rounds(self, scope: str | None) -> set[str]:
        return self._round if scope is None else self._draws(scope).rounds

    def _rng(self, scope: str | None) -> random.Random:
        return self.rng if scope is None else self._draws(scope).rng

    def tie_round(self, scope: str | None = None) -> frozenset[str]:
        """The replicas ``scope``'s ties went to in its current round (None: the shared
        round); for tests and diagnostics: makes and moves nothing."""
        if scope is None:
            return frozenset(self._round)
        draws = self._peek_draws(scope)
        return frozenset() if draws is None else frozenset(draws.rounds)

    # ------------------------------------------------------------------ scoring
    def _score(
        self, req: RouteRequest, candidates: Sequence[Candidate], coeffs: Coefficients
    ) -> list[ReplicaScore]:
        bs = req.block_size
        n = req.prompt_tokens
        drop = req.hit_drop_blocks
        # every replica without a match predicts the same hit: its costs on every replica's
        # load in one call (a matched replica's are computed too and unused: there are few)
        no_hit = predict_hit(NO_MATCH, n, bs, coeffs)
        no_hit_blocks = _matched_blocks(no_hit, bs)
        no_hit_cached = no_hit.predicted_cached_tokens
        no_hit_terms = cost_terms(no_hit, [c.load for c in candidates], coeffs)
        load_only = req.load_only
        # the matched replicas' costs first (a match of a quarantined replica, or any match
        # of a load_only request, is ignored), so the recompute charge is known before the
        # scores are built: one pass instead of a second one over every score
        hits = (
            []
            if load_only
            else [
                (i, cost(c.match, n, bs, c.load, coeffs, drop))
                for i, c in enumerate(candidates)
                if c.match.pending_blocks and not c.quarantined
            ]
        )
        unmatched = len(hits) < len(candidates)
        best_cached = max(0, no_hit_cached) if unmatched else 0
        low = no_hit_terms[0][2] if unmatched else math.inf  # the no-match prefill: one value
        for _, b in hits:
            best_cached = max(best_cached, b.hit.predicted_cached_tokens)
            low = min(low, b.prefill_ms)
        # The recompute charge: weight x (own prefill ms - the smallest among the replicas)
        # on each cost. A replica's cost is the request's own expected TTFT there. Sending a
        # request past a replica that holds its prefix makes the fleet compute those tokens
        # again, and that work is capacity every request queued behind it pays for, which
        # the request's own TTFT does not show; the myopic cost trades hits for balance too
        # readily under load. Relative to the cheapest prefill, so it is zero when no
        # replica holds anything (or every replica holds the same), and a sensitive request
        # (no matches) never pays it.
        weight = coeffs.recompute_weight
        charge = weight > 0 and best_cached > 0 and not load_only
        extra = weight * (no_hit_terms[0][2] - low) if charge and unmatched else 0.0
        note = "load_only" if load_only else ""
        # every replica scored as a no-match in one comprehension (the matched few are
        # replaced below); LoadView.requests written out: a property call per replica per
        # decision cost ~20% of a 64-replica decide
        if not extra > 0:  # nothing to add (NaN included): no addition per score
            extra = 0.0
        out = [
            ReplicaScore(
                c.replica, t[0] + extra if extra else t[0], t[1], t[2], t[3], no_hit_blocks,
                no_hit_cached,
                (ld.queued_requests if ld.queued_requests > ld.waiting else ld.waiting)
                + ld.running,
                True, note, t[4], extra,
            )
            for c, t in zip(candidates, no_hit_terms, strict=True)
            for ld in (c.load,)
        ]  # fmt: skip
        if not load_only and any(map(_QUARANTINED, candidates)):
            for s, c in zip(out, candidates, strict=True):
                if c.quarantined:
                    s.note = "quarantined"
        for i, b in hits:
            s = out[i]
            e = weight * (b.prefill_ms - low) if charge else 0.0
            hit = b.hit
            out[i] = ReplicaScore(
                s.replica, b.cost_ms + e if e > 0 else b.cost_ms, b.queue_ms, b.prefill_ms,
                b.load_ms, _matched_blocks(hit, bs), hit.predicted_cached_tokens, s.requests,
                True, "", b.stall_ms, e if e > 0 else 0.0,
            )  # fmt: skip
            if drop:  # what the replica holds: the match before the engine's drop
                held = predict_hit(candidates[i].match, n, bs, coeffs).predicted_cached_tokens
                out[i].held_tokens = held
        cold = req.cold_replicas
        # sensitive and media requests count as cold too (their matches are ignored): a
        # confined tenant must not escape its replicas by asking for them. With none of
        # them among the candidates (a retry after they failed) none is eligible: the
        # retry used to go to any replica, out of the confinement
        if cold is not None and best_cached < self.params.cold_fraction * n:
            for s in out:  # a cold request of a confined tenant: to its replicas only
                if s.replica not in cold:
                    s.eligible, s.note = False, "cold_confined"
        return out

    # ------------------------------------------------------------------ strategies
    def _ties(self, scores: Sequence[ReplicaScore]) -> list[ReplicaScore]:
        """The replicas whose cost ties with the lowest (D9's bands)."""
        p = self.params
        best = min(map(_COST_MS, scores))
        eps = p.tie_epsilon_ms
        if p.tie_fraction > 0 and not any(map(_MATCHED_BLOCKS, scores)):
            # no replica holds any of the prompt: the costs differ by load estimates only
            eps = max(eps, p.tie_fraction * best)
        bound = best + eps
        return [s for s in scores if s.cost_ms <= bound]

    def _lowest_cost(
        self, scores: Sequence[ReplicaScore], fx: Effects
    ) -> tuple[ReplicaScore, bool]:
        ties = self._ties(scores)
        if len(ties) == 1:
            return ties[0], False
        # in rounds: at random among the tied replicas no tie went to in this round (a new
        # round when there are none), so ties spread as evenly as round_robin, in an order
        # nobody can predict: a fixed rotation would let one tenant's placements reveal how
        # many cold requests the others sent, and line them up with theirs
        # (the rounds and the generator of the request's scope: D26)
        taken = fx.rounds
        if fx.scope is None:
            rounds, rng = self._round, self.rng
        else:
            draws = self._draws(fx.scope)
            rounds, rng = draws.rounds, draws.rng
        if taken:  # a second tie in one decision (a spill): on the rounds the first left
            rounds = set(rounds)
            _take_rounds(rounds, taken, False)
        fresh = [s for s in ties if s.replica not in rounds]
        new_round = not fresh
        pick = rng.choice(ties if new_round else fresh)
        if taken is None:
            fx.rounds = [(pick.replica, new_round, ties)]
        else:
            taken.append((pick.replica, new_round, ties))
        return pick, True

    def _expected_latency(
        self, req: RouteRequest, scores: Sequence[ReplicaScore], fx: Effects
    ) -> tuple[str, str]:
        scope = req.scope_key
        if self.params.miss_tie_break is MissTieBreak.SCOPE_TREE and scope is not None:
            # read only: a scope's tree is made (and its LRU place moved) at the commit
            tree = self._scope_trees.get(scope)
            pick = self._smallest_scope_tree(scores, {} if tree is None else tree, scope)
            if pick is None:
                pick, reason = self._expected_latency_cost(scores, fx)
            else:
                reason = "smallest_tree"
            fx.scope_tree = (scope, pick.replica, _new_tokens(req, pick))
            return pick.replica, reason
        pick, reason = self._expected_latency_cost(scores, fx)
        return pick.replica, reason

    def _scope_tree(self, scope: str) -> dict[str, int]:
        trees = self._scope_trees
        tree = trees.get(scope)
        if tree is None:
            tree = trees[scope] = {}
            if len(trees) > MAX_SCOPE_TREES:
                trees.popitem(last=False)
        else:
            trees.move_to_end(scope)
        return tree

    def _smallest_scope_tree(
        self, scores: Sequence[ReplicaScore], tree: dict[str, int], scope: str
    ) -> ReplicaScore | None:
        """A miss everywhere whose costs tie (the ``tie_fraction`` band of D9): the tied
        replica with the least new data from this scope. Cold prefixes then spread by the
        cache space they take, not only by count, and a tenant's placements depend on its
        own traffic and the replicas' load, never on what other tenants sent. None when a
        replica has a match, nothing ties, or a replica is quarantined: its holdings are
        unknown to routing then, and a tree that grows with every cold request it takes
        would keep repeats of those requests away from it, and with them the agreeing
        checks that release it (random rounds keep sending some)."""
        if (
            temperature_on(self.params, scores)
            or any(map(_MATCHED_BLOCKS, scores))
            or "quarantined" in map(_NOTE, scores)
        ):
            return None
        ties = self._ties(scores)
        if len(ties) < 2:
            return None
        low = min(tree.get(s.replica, 0) for s in ties)
        least = [s for s in ties if tree.get(s.replica, 0) <= low]
        return least[0] if len(least) == 1 else self._draws(scope).rng.choice(least)

    def _smallest_tree(self, scores: Sequence[ReplicaScore], tree: dict[str, int]) -> ReplicaScore:
        """SGLang's smallest tree: the replica with the least new prompt data in ``tree``
        (at random among equals)."""
        low = min(tree.get(s.replica, 0) for s in scores)
        return self.rng.choice([s for s in scores if tree.get(s.replica, 0) <= low])

    def _expected_latency_cost(
        self, scores: Sequence[ReplicaScore], fx: Effects
    ) -> tuple[ReplicaScore, str]:
        p = self.params
        if temperature_on(p, scores):
            best = min(s.cost_ms for s in scores)
            scale = p.temperature * max(best, 1.0)
            weights = [math.exp(-(s.cost_ms - best) / scale) for s in scores]
            pick = self._rng(fx.scope).choices(list(scores), weights=weights, k=1)[0]
            return pick, "softmax"
        pick, tied = self._lowest_cost(scores, fx)
        if p.spill_queue_ms is not None and pick.matched_blocks > 0:
            # a prefix piles up when its holder's queue is longer than the shortest queue
            # by more than the bound; a busy fleet, where every queue is long, is not that
            floor = min(s.queue_ms for s in scores)
            bound = floor + p.spill_queue_ms
            if pick.queue_ms > bound:
                under = [s for s in scores if s.replica != pick.replica and s.queue_ms <= bound]
                if under:
                    alt, _ = self._lowest_cost(under, fx)
                    return alt, "spill"
        if tied:
            return pick, "tie_round"
        return pick, "prefix_hit" if pick.matched_blocks > 0 else "lowest_cost"

    def _least_loaded(self, scores: Sequence[ReplicaScore]) -> tuple[str, str]:
        low = min(map(_REQUESTS, scores))
        ties = [s for s in scores if s.requests == low]
        if len(ties) > 1:  # then the least queued prefill work
            q = min(s.queue_ms for s in ties)
            ties = [s for s in ties if s.queue_ms <= q]
        return self.rng.choice(ties).replica, "least_loaded"

    def _prefix_affinity(
        self, req: RouteRequest, scores: Sequence[ReplicaScore], fx: Effects
    ) -> tuple[str, str]:
        """SGLang / vllm-router ``cache_aware``: shortest queue when imbalanced, else the
        best match above the threshold, else the replica with the smallest tree: the least
        new prompt data routed to it so far (not the KV usage, which tracks running
        requests, not what a worker caches)."""
        p = self.params
        loads = [s.requests for s in scores]
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs_threshold and hi > lo * p.balance_rel_threshold:
            ties = [s for s in scores if s.requests == lo]
            pick, reason = self.rng.choice(ties), "imbalanced"
        else:
            best = max(s.predicted_cached_tokens for s in scores)
            if req.prompt_tokens > 0 and best / req.prompt_tokens > p.cache_threshold:
                ties = [s for s in scores if s.predicted_cached_tokens == best]
                pick, reason = self.rng.choice(ties), "cache_hit"
            else:
                pick, reason = self._smallest_tree(scores, self._tree_tokens), "smallest_tree"
        # every pick grows the picked replica's tree by what it did not hold, as SGLang
        # inserts every routed request's text into the chosen worker's tree
        fx.tree = (pick.replica, _new_tokens(req, pick))
        return pick.replica, reason

    def _load_only(
        self, req: RouteRequest, scores: Sequence[ReplicaScore], fx: Effects
    ) -> tuple[str, str]:
        p = self.params
        best = min(s.cost_ms for s in scores)
        why = "unkeyed" if req.unkeyed else "sensitive"
        if req.session_key:
            bound = best * (1.0 + p.sticky_slack) + p.sticky_slack_ms
            ok = [s.replica for s in scores if s.cost_ms <= bound]
            return rendezvous(req.session_key, ok), f"{why}_sticky"
        pick, _ = self._lowest_cost(scores, fx)
        return pick.replica, f"{why}_load"
