"""D22: claim checks the removal log cannot judge. The tracker's max_unverifiable track, the
floor judge, both backends' removal floor, and honest agents under eviction churn (a real
gateway, simulated engines, a real Redis index written through the agents' index API) that
must not be taken for liars. The rogue agents are in tests/test_rogue_removal_floor.py."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import pytest

from cachecore.index.base import (
    IndexError_,
    PrefixIndex,
    RemovalFloor,
    ReplicaState,
)
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKey
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway.quarantine import (
    ClaimCheck,
    LogAnswer,
    QuarantineTracker,
    judge_floor,
    judge_removal,
)
from policies.schema import QuarantinePolicy
from tests.test_gateway_faults import checked, claim_checks, prompt_keys
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(120)
G = int(Tier.GPU)


def _now() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------ the floor judge


def test_an_honest_floor_is_unverifiable_an_impossible_one_tampered() -> None:
    now, skew = 1_000_000, 250
    honest = [
        RemovalFloor(-1, 0),  # nothing trimmed (a log of 0 entries in the memory backend)
        RemovalFloor(now - 5_000, now - 10),
        RemovalFloor(now, now),  # trimmed at the agent's latest write
        RemovalFloor(now + skew, now + skew),  # an agent clock ahead by the allowed skew
        RemovalFloor(now - 100, now - 100 - skew),  # the agent's clock stepped back by skew
    ]
    for f in honest:
        assert judge_floor(f, now, skew) is LogAnswer.UNVERIFIABLE, f
    tampered = [
        RemovalFloor(10**15, now),  # later than the agent's own latest write
        RemovalFloor(now - 100, now - 100 - skew - 1),
        RemovalFloor(now + skew + 1, 10**15),  # updated_ms raised too: later than our clock
        RemovalFloor(None, now),  # not an integer: no agent writes that
        RemovalFloor(-1, None),
    ]
    for f in tampered:
        assert judge_floor(f, now, skew) is LogAnswer.TAMPERED, f


def test_an_honest_clock_ahead_is_no_liar_with_the_default_margin() -> None:
    """R2: with KVGATE_AGENT_REMOVAL_LOG=0 the floor is the agent's now at each removal;
    an agent clock 400 ms ahead of the gateway's read as tampered while clock_skew_ms
    (250) was the accusing margin. tamper_margin_ms (10 s) is: still unverifiable."""
    now, pol = 1_000_000, QuarantinePolicy()
    ahead = RemovalFloor(now + 400, now + 400)
    assert judge_floor(ahead, now, pol.tamper_margin_ms) is LogAnswer.UNVERIFIABLE
    assert judge_removal(now + 400, now, pol.tamper_margin_ms) is LogAnswer.REMOVED
    far = RemovalFloor(now + pol.tamper_margin_ms + 1, 10**15)
    assert judge_floor(far, now, pol.tamper_margin_ms) is LogAnswer.TAMPERED


def test_a_removal_time_past_the_gateways_clock_is_tampered() -> None:
    """R1: the log's removal times are agent-written like its floor, and judged by the same
    rule (beyond_agent_clock): a removal "in the future" excuses nothing."""
    now, margin = 1_000_000, 10_000
    assert judge_removal(None, now, margin) is LogAnswer.NOT_REMOVED
    for honest in (now - 5_000, now, now + margin):
        assert judge_removal(honest, now, margin) is LogAnswer.REMOVED, honest
    for lie in (now + margin + 1, 1e15, float("inf")):
        assert judge_removal(lie, now, margin) is LogAnswer.TAMPERED, lie


# ------------------------------------------------------------------ the tracker

# no escalation (recover_after_max = recover_after): a repeat offender's is W3's,
# tests/test_h26_quarantine_cycles.py
POLICY = QuarantinePolicy(
    k=2,
    m=3,
    min_claimed_blocks=2,
    recover_after=2,
    max_unverifiable=3,
    unverifiable_window=10,
    recover_after_max=2,
)


def _bad(unverifiable: bool = False, restored: bool = False) -> ClaimCheck:
    return ClaimCheck("r", 10, 0, 10, removed_since_lookup=restored, unverifiable=unverifiable)


def _agree() -> ClaimCheck:
    return ClaimCheck("r", 10, 10, 10)


def test_unverifiable_disagreements_in_a_row_quarantine() -> None:
    q = QuarantineTracker(POLICY)
    assert q.observe(_bad(unverifiable=True)) is None
    assert q.observe(_bad(unverifiable=True)) is None
    # no verdict for the k-of-m window: k = 2 would have quarantined by now
    assert not q.is_quarantined("r")
    assert q.observe(_bad(unverifiable=True)) is True
    assert q.is_quarantined("r")
    # the release paths are the false claims' ones: recover_after agreeing checks...
    assert q.observe(_bad(unverifiable=True)) is None  # a disagreement restarts the count
    assert q.observe(_agree()) is None
    assert q.observe(_agree()) is False
    # ...or a rebuilt index (release), which forgets the run as it forgets the window
    for _ in range(3):
        q.observe(_bad(unverifiable=True))
    assert q.release("r") and not q.is_quarantined("r")
    assert q.observe(_bad(unverifiable=True)) is None
    assert not q.is_quarantined("r")


def test_the_truth_in_between_does_not_launder_unverifiable_lies() -> None:
    """A rogue that answers some requests truthfully between its lies still reaches the
    bound: agreeing checks never asked the log, so they end no run of "cannot tell"."""
    q = QuarantineTracker(POLICY)
    for _ in range(2):
        assert q.observe(_bad(unverifiable=True)) is None
        assert q.observe(_agree()) is None
        assert q.observe(_agree()) is None
    assert q.observe(_bad(unverifiable=True)) is True


def test_unverifiable_checks_count_within_a_window_of_checked_requests() -> None:
    """R4: the track is a window (max_unverifiable = 3 among the last 10 checked
    requests), not a run that only a judged check ends: an honest log that falls short now
    and then, with agreeing checks between, never adds up; the same three close together
    do. A faked removal (evicted_restored) between them ends nothing (it did: R1's rogue
    reset the run with each)."""
    q = QuarantineTracker(POLICY)
    for _ in range(5):  # two a burst, bursts nine checks apart: at most 2 in any 10
        assert q.observe(_bad(unverifiable=True)) is None
        assert q.observe(_bad(unverifiable=True)) is None
        for _ in range(8):
            assert q.observe(_agree()) is None
    assert not q.is_quarantined("r")
    for _ in range(8):
        q.observe(_agree())
    assert q.observe(_bad(unverifiable=True)) is None
    assert q.observe(_bad(restored=True)) is None
    assert q.observe(_bad(unverifiable=True)) is None
    assert q.observe(_bad(unverifiable=True)) is True


def test_a_rogue_below_the_bound_rate_is_the_bound_d22_states() -> None:
    """D22's bound: unjudged lies below max_unverifiable / unverifiable_window of the
    checked requests go unpunished (here 1 in 5 < 3/10); at the bound, quarantine."""
    q = QuarantineTracker(POLICY)
    for _ in range(200):
        assert q.observe(_bad(unverifiable=True)) is None
        for _ in range(4):
            assert q.observe(_agree()) is None
    assert not q.is_quarantined("r")
    q = QuarantineTracker(POLICY)
    got = [q.observe(c) for _ in range(3) for c in (_bad(unverifiable=True), _agree(), _agree())]
    assert got[-3] is True  # 3 in 7 checked requests


def test_max_unverifiable_zero_turns_the_track_off() -> None:
    q = QuarantineTracker(POLICY.model_copy(update={"max_unverifiable": 0}))
    for _ in range(50):
        assert q.observe(_bad(unverifiable=True)) is None
    assert not q.is_quarantined("r")
    with pytest.raises(ValueError, match="unverifiable_window"):
        QuarantinePolicy(max_unverifiable=11, unverifiable_window=10)


def test_disabling_forgets_the_counts_a_reenable_starts_afresh() -> None:
    """W3: a policy reload that turns quarantine off and on again does not carry the
    replicas' old checks over (one bad check before, one after: k = 2 would quarantine)."""
    q = QuarantineTracker(POLICY)
    assert q.observe(_bad()) is None
    q.observe(_bad(unverifiable=True))
    q.observe(_bad(unverifiable=True))
    q.configure(POLICY.model_copy(update={"enabled": False}))
    q.configure(POLICY)
    assert q.observe(_bad()) is None
    assert q.observe(_bad(unverifiable=True)) is None
    assert not q.is_quarantined("r")
    assert q.observe(_bad()) is True  # the counting itself still works


def test_a_small_unverifiable_miss_is_an_ordinary_check() -> None:
    """Below missing_fraction the log's answer never mattered: the check counts as any
    other good one (it was skipped)."""
    q = QuarantineTracker(POLICY)
    small = ClaimCheck("r", 10, 8, 10, unverifiable=True)
    for _ in range(10):
        assert q.observe(small) is None
    assert not q.is_quarantined("r")
    q.observe(_bad())
    q.observe(_bad())
    assert q.is_quarantined("r")
    assert q.observe(small) is None and q.observe(small) is False  # recover_after = 2


# ------------------------------------------------------------------ the backends


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_an_honest_floor_under_churn_is_never_past_the_agents_write(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Both backends: a log of 64 removals under 20 writes of 500 removals each, stamped
    with a real clock: the floor keeps up with the churn and is never judged tampered."""
    idx: PrefixIndex
    if kind == "memory":
        idx = MemoryIndex(removal_log=64)
    else:
        idx = RedisIndex.from_url(
            request.getfixturevalue("redis_url"),
            removal_log=64,
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    try:
        assert await idx.removal_floor("nobody") == RemovalFloor(-1, 0)
        epoch = await idx.clear_replica("a", ReplicaState.LIVE, _now())
        for i in range(20):
            keys = [os.urandom(16) for _ in range(500)]
            await idx.apply("a", epoch, IndexWrite(dict.fromkeys(keys, G)), _now())
            before = _now()
            await idx.apply("a", epoch, IndexWrite(dict.fromkeys(keys, 0)), _now())
            floor = await idx.removal_floor("a")
            assert floor.floor_ms is not None and floor.updated_ms is not None
            assert before <= floor.floor_ms <= floor.updated_ms, (i, floor)
            assert await idx.removed_since("a", keys[:1], before) is None  # trimmed
            assert judge_floor(floor, _now(), 0) is LogAnswer.UNVERIFIABLE
        # a clear starts a new log, complete only after the clear (R5): its floor is the
        # clear's time, a possible one
        at = _now()
        await idx.clear_replica("a", ReplicaState.LIVE, at)
        floor = await idx.removal_floor("a")
        assert floor == RemovalFloor(at, at)
        assert judge_floor(floor, _now(), 0) is LogAnswer.UNVERIFIABLE
    finally:
        await idx.close()


# ------------------------------------------------------------------ honest agents, e2e

# index reads get 1 s, not the default 5 ms: a claim check's read that times out is the
# gateway's own failure ("skipped", no verdict), and under a busy clean-clone CI run one did
# while Redis ran the churn's 5,000-removal write (the outcome read skipped, not the honest
# agent's evicted_restored these tests are about)
STRICT = (
    "quarantine: {missing_fraction: 0.5, k: 1, m: 1, min_claimed_blocks: 2, settle_s: 0.3,"
    " max_unverifiable: %d, unverifiable_window: 2}\n"
    "index: {lookup_timeout_ms: 1000}"
)


async def _evicted_and_restored(
    st: Stack, agent: RedisIndex, epoch: int, seed: int, churn: int
) -> str:
    """One request whose claimed blocks the engine does not have; its agent reports them
    evicted after the lookup and stored again by the request (one write), then ``churn``
    other blocks stored and evicted, all before the check's verdict. The check's outcome."""
    gw, rep = st.gw, st.replica_id(0)
    prompt = words(400, seed)
    keys = prompt_keys(gw, prompt, st.model)
    await agent.apply(rep, epoch, IndexWrite({k: G for k in keys}), _now())
    before = claim_checks(gw, rep)
    raw = await st.client().completions.with_raw_response.create(
        model=st.model, prompt=prompt, max_tokens=1
    )
    assert raw.headers["x-kvgate-replica"] == rep
    await agent.apply(rep, epoch, IndexWrite({k: G for k in keys}, removed=set(keys)), _now())
    other = [os.urandom(16) for _ in range(churn)]
    await agent.apply(rep, epoch, IndexWrite(dict.fromkeys(other, G)), _now())
    await agent.apply(rep, epoch, IndexWrite(dict.fromkeys(other, 0)), _now())
    got = await checked(gw, rep, sum(before.values()) + 1)
    (outcome,) = (got - before).keys()
    return outcome


async def test_an_honest_agent_under_heavy_churn_is_not_quarantined(redis_url: str) -> None:
    """The default removal log (16,384) and 5,000 evictions between each lookup and its
    check, each claim evicted and stored again by its request: every check is shown an
    eviction, none is unverifiable (max_unverifiable = 1 would quarantine at the first)."""
    async with stack(count=2, policy=STRICT % 1, redis_url=redis_url) as st:
        agent = RedisIndex.from_url(
            redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
        )
        try:
            # cleared a second before the first lookup: a clear is its log's floor, and a
            # lookup within clock_skew_ms of it cannot be told from one before it (R5)
            epoch = await agent.clear_replica(st.replica_id(0), ReplicaState.LIVE, _now() - 1_000)
            await agent.clear_replica(st.replica_id(1), ReplicaState.LIVE, _now() - 1_000)
            for i in range(3):
                assert await _evicted_and_restored(st, agent, epoch, 7100 + i, 5_000) == (
                    "evicted_restored"
                )
                assert not st.gw.quarantine.is_quarantined(st.replica_id(0))
        finally:
            await agent.close()


async def test_an_honest_log_too_short_for_its_churn_is_unverifiable_not_tampered(
    redis_url: str,
) -> None:
    """An agent whose removal log (64) is trimmed past the lookup by the churn before the
    check: its floor is one an honest log has, so the check is unverifiable (it used to be
    skipped), never a false claim; max_unverifiable of them among the last
    unverifiable_window (2) checked requests quarantine (the runbook: raise
    KVGATE_AGENT_REMOVAL_LOG), and a check between them moves the window on."""
    async with stack(count=2, policy=STRICT % 2, redis_url=redis_url) as st:
        rep = st.replica_id(0)
        agent = RedisIndex.from_url(
            redis_url,
            removal_log=64,
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
        try:
            epoch = await agent.clear_replica(rep, ReplicaState.LIVE, _now() - 1_000)  # as above
            await agent.clear_replica(st.replica_id(1), ReplicaState.LIVE, _now() - 1_000)
            assert await _evicted_and_restored(st, agent, epoch, 7200, 200) == "unverifiable"
            assert not st.gw.quarantine.is_quarantined(rep)
            # the log reaches back this time (no churn): a checked request in the window
            assert await _evicted_and_restored(st, agent, epoch, 7201, 0) == "evicted_restored"
            assert await _evicted_and_restored(st, agent, epoch, 7202, 200) == "unverifiable"
            assert not st.gw.quarantine.is_quarantined(rep)
            assert await _evicted_and_restored(st, agent, epoch, 7203, 200) == "unverifiable"
            assert st.gw.quarantine.is_quarantined(rep)
        finally:
            await agent.close()


class _FailingFloor(MemoryIndex):
    """An index whose log cannot tell and whose floor read fails: the gateway's problem."""

    async def removal_times(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[float | None] | None:
        return None

    async def removal_floor(self, replica: str) -> RemovalFloor:
        raise IndexError_("index unreachable")


async def test_a_floor_the_gateway_cannot_read_judges_nothing() -> None:
    """Skips of the gateway's own making (the index failed) count on no track."""
    index = _FailingFloor()
    async with stack(count=2, policy=STRICT % 1, build={"index": index}) as st:
        rep = st.replica_id(0)
        epoch = await index.clear_replica(rep, ReplicaState.LIVE, _now())
        await index.clear_replica(st.replica_id(1), ReplicaState.LIVE, _now())
        for i in range(2):
            prompt = words(400, 7300 + i)
            await index.apply(
                rep, epoch, IndexWrite({k: G for k in prompt_keys(st.gw, prompt, st.model)}), 1
            )
            raw = await st.client().completions.with_raw_response.create(
                model=st.model, prompt=prompt, max_tokens=1
            )
            assert raw.headers["x-kvgate-replica"] == rep
            assert (await checked(st.gw, rep, i + 1))["skipped"] == i + 1
        assert not st.gw.quarantine.is_quarantined(rep)
