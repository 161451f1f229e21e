"""Claims checking: quarantine replicas whose index claims the engine does not honour.

After each response the gateway compares the blocks the index claimed as *stored* on the
chosen replica (agent-written, never the gateway's own pending guesses) with the engine's
``cached_tokens``. A request is "bad" when at least ``missing_fraction`` of the claimed
blocks prove missing, and the index still claims them afterwards (so no BlockRemoved came
in between: an honest eviction is not a false claim). "Afterwards" is up to
``settle_s`` later: the gateway looks again until the claim drops or that time passes, since
an agent that lags behind its engine reports an eviction late, and a late report is not a
lie (``Gateway._settled_claim``). A claim can also stand at the check *because* of an
eviction: the engine evicted a claimed block after the lookup, the request computed it again
and the engine stored it again, so the index holds it once more. The index's removal log
(:meth:`~cachecore.index.base.PrefixIndex.removed_since`) tells that apart: if the first
block the engine did not have was removed since the lookup, the miss is an eviction
(``evicted_restored``). If the log no longer reaches back that far it cannot tell, and
its floor (``rm_floor``, the newest removal time it trimmed) sits in the agent's own meta,
which a rogue agent can raise to make every check of its lies "cannot tell" (D22): a floor
no honest log can have (later than the agent's own latest write, or than the gateway's
clock, beyond ``tamper_margin_ms``) counts as no removal (``tampered``, a false claim); a
possible one leaves the check ``unverifiable``, and ``max_unverifiable`` of those among the
replica's last ``unverifiable_window`` checked requests quarantine it too (an honest log
trimmed that fast is too short for its churn). The log's removal times are the agent's as
well: one later than the gateway's clock beyond ``tamper_margin_ms`` is no removal either
(``tampered``), by the same rule (:func:`beyond_agent_clock`).
A replica with ``k`` bad requests among its last ``m`` checked ones is quarantined: routed
by load only. It leaves quarantine after ``recover_after`` consecutive checked requests
whose claims agree, or when its index is rebuilt (:meth:`QuarantineTracker.release`, a new
epoch: the claims that earned it are gone). A rebuild releases once: its agent can rebuild
at will, so a replica quarantined again before ``recover_after`` agreeing checks proved it
since is released by agreeing checks only (a rogue agent that cleared its index at each
quarantine was back in service within a second, for another ``k`` lies, without end).

A repeat offender proves itself longer (W3): without it a rogue told its ``k`` or
``max_unverifiable`` lies, answered truthfully for ``recover_after`` checks and started
again with a fresh count, two thirds of its checked requests unjudged lies. Each quarantine
a replica earns doubles the agreeing checks its next one needs (``recover_after``, 2x,
4x, ... up to ``recover_after_max``), and ``forgive_after`` checked requests in service
without a bad one forget one quarantine (:func:`recover_needed`). A rebuild lifts a first
offence only: a quarantine entered with another remembered ends by agreeing checks alone.
So past a few cheap cycles each costs a rogue ``recover_after_max`` truthful checks, or
``forgive_after`` per quarantine forgotten, and D22's bound holds over any horizon, not
within one cycle only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from cachecore.index.base import RemovalFloor
from policies.schema import QuarantinePolicy


class LogAnswer(StrEnum):
    """What the removal log says about a claim's first missing block since the lookup."""

    REMOVED = "removed"  # evicted after the lookup: the miss is no lie
    NOT_REMOVED = "not_removed"
    UNVERIFIABLE = "unverifiable"  # trimmed past the lookup, at a floor an honest log can have
    TAMPERED = "tampered"  # trimmed "past" the lookup at a floor no honest log can have


def beyond_agent_clock(t_ms: float, bound_ms: int, margin_ms: int) -> bool:
    """The one rule for every time an agent writes into the index (a removal's, its log's
    floor): an honest agent stamps it with its own clock at its write, so it is never later
    than ``bound_ms`` (the gateway's now, or the agent's own latest write) by more than
    ``margin_ms`` (``quarantine.tamper_margin_ms``). Later is a lie, and no removal."""
    return t_ms > bound_ms + margin_ms


def judge_removal(removed_ms: float | None, now_ms: int, margin_ms: int) -> LogAnswer:
    """The removal log's answer about one block: ``removed_ms``, the time of its removal at
    or after the lookup (None: none), judged against the gateway's ``now_ms``."""
    if removed_ms is None:
        return LogAnswer.NOT_REMOVED
    if beyond_agent_clock(removed_ms, now_ms, margin_ms):
        return LogAnswer.TAMPERED  # a removal "in the future" excuses every lie forever
    return LogAnswer.REMOVED


def judge_floor(floor: RemovalFloor, now_ms: int, margin_ms: int) -> LogAnswer:
    """The answer of a removal log that cannot tell, by its floor. An honest floor is the
    time of a removal its agent wrote, so never later than that agent's latest write
    (``updated_ms``, the same clock) nor than the gateway's ``now_ms``, beyond
    ``margin_ms``; and always an integer."""
    if floor.floor_ms is None or floor.updated_ms is None:
        return LogAnswer.TAMPERED
    if beyond_agent_clock(floor.floor_ms, min(floor.updated_ms, now_ms), margin_ms):
        return LogAnswer.TAMPERED
    return LogAnswer.UNVERIFIABLE


def max_repeats(policy: QuarantinePolicy) -> int:
    """The fewest quarantines remembered at which :func:`recover_needed` reaches its cap:
    more are not kept, so forgiving starts below the cap (0: no escalation)."""
    cap = max(policy.recover_after, policy.recover_after_max)
    return (-(-cap // policy.recover_after) - 1).bit_length()


def recover_needed(policy: QuarantinePolicy, repeats: int) -> int:
    """Agreeing checks that release a quarantine entered with ``repeats`` earlier ones
    remembered: ``recover_after`` doubled per repeat, at most ``recover_after_max`` (a
    ``recover_after`` above that cap: no escalation)."""
    cap = max(policy.recover_after, policy.recover_after_max)
    return min(cap, policy.recover_after << min(repeats, max_repeats(policy)))


@dataclass(slots=True)
class _ReplicaClaims:
    window: deque[bool] = field(default_factory=deque)
    quarantined: bool = False
    agreeing: int = 0
    checked: int = 0  # checked requests seen (the unverifiable window's clock)
    # the ``checked`` count of each recent bad check whose removal log could not tell:
    # those within the last unverifiable_window (at most max_unverifiable are kept)
    unverifiable_at: deque[int] = field(default_factory=deque)
    # released by a rebuild and not proven by recover_after agreeing checks since: its next
    # quarantine is not lifted by a rebuild (see the module docstring)
    rebuilt: bool = False
    # quarantines remembered (W3): each doubles the next one's recover_after; one is
    # forgotten per forgive_after checked requests in service without a bad one
    repeats: int = 0
    entered_with: int = 0  # ``repeats`` when the latest quarantine began: what it needs
    clean: int = 0  # good checked requests in service since a bad one, entry or forgiving


@dataclass(frozen=True, slots=True)
class ClaimCheck:
    replica: str
    claimed_blocks: int
    actual_blocks: int
    still_claimed_blocks: int  # what the index claims after the response
    # the first missing block was removed after the lookup (and stored again since): the
    # miss is an eviction the index could not show by the time of the check
    removed_since_lookup: bool = False
    # the removal log could not tell whether it was (trimmed past the lookup): a bad check
    # then counts on the max_unverifiable track, not in the k-of-m window
    unverifiable: bool = False

    @property
    def missing_fraction(self) -> float:
        if self.claimed_blocks <= 0:
            return 0.0
        return max(0, self.claimed_blocks - self.actual_blocks) / self.claimed_blocks


class QuarantineTracker:
    def __init__(self, policy: QuarantinePolicy) -> None:
        self.policy = policy
        self._replicas: dict[str, _ReplicaClaims] = {}

    def configure(self, policy: QuarantinePolicy) -> None:
        self.policy = policy
        top = max_repeats(policy)
        for st in self._replicas.values():
            while len(st.window) > policy.m:
                st.window.popleft()
            st.repeats = min(st.repeats, top)
        if not policy.enabled:
            # released, and what was counted goes: a later re-enable starts from nothing
            self._replicas.clear()

    def is_quarantined(self, replica: str) -> bool:
        st = self._replicas.get(replica)
        return st is not None and st.quarantined

    def quarantined(self) -> list[str]:
        return sorted(r for r, st in self._replicas.items() if st.quarantined)

    def standing(self, replica: str) -> dict[str, bool | int]:
        """What /admin/replicas and the quarantine logs show of ``replica``: whether it is
        quarantined, the quarantines it is remembered for, and the agreeing checks its
        quarantine needs (the current one's, else the next one's)."""
        st = self._replicas.get(replica)
        if st is None:
            st = _ReplicaClaims()
        repeats = st.entered_with if st.quarantined else st.repeats
        return {
            "quarantined": st.quarantined,
            "quarantine_repeats": st.repeats,
            "quarantine_recover_after": recover_needed(self.policy, repeats),
        }

    def release(self, replica: str) -> bool:
        """Lift ``replica``'s quarantine and forget its window (its index was rebuilt from
        the engine: the old claims are gone). Returns whether it was lifted: not when it
        was not quarantined, nor when a rebuild already lifted a quarantine of it and no
        ``recover_after`` agreeing checks proved it since, nor for a repeat offender (a
        quarantine entered with another remembered: W3), whose agent could otherwise
        rebuild its way past the longer proof."""
        st = self._replicas.get(replica)
        if st is None or not st.quarantined or st.rebuilt or st.entered_with:
            return False
        st.quarantined = False
        st.rebuilt = True
        st.window.clear()
        st.agreeing = 0
        st.clean = 0
        st.unverifiable_at.clear()
        return True

    def forget(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def observe(self, check: ClaimCheck) -> bool | None:
        """Record one check. Returns the new quarantine state if it changed, else None."""
        p = self.policy
        if not p.enabled or check.claimed_blocks < p.min_claimed_blocks:
            return None
        bad = check.missing_fraction >= p.missing_fraction
        st = self._replicas.get(check.replica)
        if st is None:
            st = self._replicas[check.replica] = _ReplicaClaims()
        unverifiable = self._count_unverifiable(st, bad and check.unverifiable)
        if bad and check.still_claimed_blocks < check.claimed_blocks:
            return None  # the blocks were removed in between: an eviction, not a lie
        if bad and check.removed_since_lookup:
            return None  # removed after the lookup, stored again: an eviction, not a lie
        self._forgive(st, bad)
        if bad and check.unverifiable:
            # no verdict for the window, but a log trimmed past every lookup is no alibi:
            # a rogue agent raises its floor for that (D22)
            st.agreeing = 0
            if not st.quarantined and p.max_unverifiable and unverifiable >= p.max_unverifiable:
                self._enter(st)
                return True
            return None
        st.window.append(bad)
        while len(st.window) > p.m:
            st.window.popleft()
        st.agreeing = 0 if bad else st.agreeing + 1
        need = recover_needed(p, st.entered_with)
        if st.rebuilt and not st.quarantined and st.agreeing >= need:
            st.rebuilt = False  # proven since its rebuild: a rebuild may lift a quarantine
        if not st.quarantined and sum(st.window) >= p.k:
            self._enter(st)
            return True
        if st.quarantined and st.agreeing >= need:
            st.quarantined = False
            st.rebuilt = False
            st.window.clear()
            st.clean = 0
            st.unverifiable_at.clear()
            return False
        return None

    def _enter(self, st: _ReplicaClaims) -> None:
        """Quarantine: it needs the agreeing checks its remembered repeats make, and the
        next one twice as many (W3)."""
        st.quarantined = True
        st.agreeing = 0
        st.clean = 0
        st.unverifiable_at.clear()
        st.entered_with = st.repeats
        st.repeats = min(st.repeats + 1, max_repeats(self.policy))

    def _forgive(self, st: _ReplicaClaims, bad: bool) -> None:
        """Count a checked request in service that was no eviction: ``forgive_after`` good
        ones with no bad one between forget one quarantine. A bad one (a lie, judged or
        not) starts the count again, so a rogue cannot lie its way back to a short
        quarantine; while quarantined nothing is forgiven (proving is recover_after's)."""
        if st.quarantined:
            return
        if bad:
            st.clean = 0
            return
        st.clean += 1
        if st.clean >= self.policy.forgive_after:
            st.clean = 0
            st.repeats = max(0, st.repeats - 1)

    def _count_unverifiable(self, st: _ReplicaClaims, unverifiable: bool) -> int:
        """Count one checked request (every kind: agreeing, evicted, false); how many of
        the last ``unverifiable_window`` were unverifiable. A window, not a run: agreeing
        checks never asked the log, so they must not end a rogue's run (D22), yet an honest
        log that falls short now and then, hours apart, must not add up to the bound."""
        st.checked += 1
        at = st.unverifiable_at
        if unverifiable:
            at.append(st.checked)
        oldest = st.checked - self.policy.unverifiable_window
        while at and (at[0] <= oldest or len(at) > self.policy.max_unverifiable):
            at.popleft()
        return len(at)
