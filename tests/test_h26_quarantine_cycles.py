"""W3: D22's bound on a rogue's lies across quarantine cycles. A rogue that lied until
quarantined, answered truthfully for recover_after checks and started again had a fresh
count each cycle: two thirds of its checked requests were unjudged lies. Repeat offenders
now prove themselves longer (recover_after doubles per quarantine remembered, up to
recover_after_max; forgive_after clean checks forget one), and a rebuild lifts a first
offence only. The rogues here play against the tracker itself, every strategy bounded in
checked requests; the honest replica's cost is pinned beside them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gateway.policy_store import isolation_weakenings
from gateway.quarantine import ClaimCheck, QuarantineTracker, max_repeats, recover_needed
from policies.schema import Policy, QuarantinePolicy
from tests.test_gateway_faults import checked, claim, prompt_keys
from tests.test_gateway_support import ADMIN, stack, words

pytestmark = pytest.mark.timeout(60)

DEFAULT = QuarantinePolicy()
HORIZON = 20_000  # checked requests each rogue plays (D22's bound is per checked request)

TRUTH = ClaimCheck("r", 10, 10, 10)
JUDGED_LIE = ClaimCheck("r", 10, 0, 10)  # the log could tell: false
UNJUDGED_LIE = ClaimCheck("r", 10, 0, 10, unverifiable=True)  # the log could not tell

# a rogue's move, given (quarantined, checks since its last release): its next check
Strategy = Callable[[bool, int], ClaimCheck]


def _play(policy: QuarantinePolicy, strategy: Strategy, *, rebuild: bool) -> int:
    """Feed HORIZON checked requests; the lies the rogue told while in service (those
    routed by its claims: a quarantined replica's are ignored). With ``rebuild`` its agent
    clears its index the moment it is quarantined (the gateway then calls release)."""
    q = QuarantineTracker(policy)
    lies, since = 0, 0
    for _ in range(HORIZON):
        if rebuild and q.is_quarantined("r") and q.release("r"):
            since = 0
        quarantined = q.is_quarantined("r")
        check = strategy(quarantined, since)
        if not quarantined and check is not TRUTH:
            lies += 1
        if q.observe(check) is False:
            since = 0
        else:
            since += 1
    return lies


def _greedy(lie: ClaimCheck) -> Strategy:
    """W3's rogue: lie whenever in service, the truth while quarantined."""
    return lambda quarantined, since: TRUTH if quarantined else lie


def _patient(lie: ClaimCheck, wait: int) -> Strategy:
    """Truthful for ``wait`` checks after each release (forgiveness), then lie until
    quarantined."""
    return lambda quarantined, since: TRUTH if quarantined or since < wait else lie


def _under_rate(lie: ClaimCheck, count: int, window: int) -> Strategy:
    """``count`` lies per ``window`` checks, just under a track's trigger."""
    return lambda quarantined, since: TRUTH if quarantined or since % window >= count else lie


def _bound(policy: QuarantinePolicy, per: int, window: int) -> float:
    """D22's bound over HORIZON checked requests for a track that quarantines at ``per``
    lies among ``window`` checked ones: each stretch in service of F checks holds at most
    (per - 1) * ceil(F / window) + 1 lies; a quarantine is entered at most max_repeats +
    (checks in service) / forgive_after + (checks quarantined) / recover_after_max + 1
    times (past the cap each lasts recover_after_max; below it each raises the repeats,
    which only forgive_after clean checks lower; a rebuild ends a first offence only)."""
    top = max_repeats(policy)
    slowest = min(policy.forgive_after, policy.recover_after_max)
    entries = top + HORIZON / slowest + 1
    return (per - 1) * HORIZON / window + per * (entries + 1)


STRATEGIES: list[tuple[str, Callable[[ClaimCheck], Strategy]]] = [
    ("greedy", _greedy),
    *[(f"patient{w}", lambda lie, w=w: _patient(lie, w)) for w in (3, 6, 500, 999, 1000, 2001)],
]


@pytest.mark.parametrize("rebuild", [False, True])
@pytest.mark.parametrize(("name", "make"), STRATEGIES)
def test_an_unjudged_liar_is_held_to_d22s_bound_over_any_horizon(
    name: str, make: Callable[[ClaimCheck], Strategy], rebuild: bool
) -> None:
    """Before: the greedy rogue's 6 lies per 9 checked requests (13,333 of 20,000); now
    at most (2 * 6 - 1) per 1,000 checked requests plus a start-up allowance (D22)."""
    lies = _play(DEFAULT, make(UNJUDGED_LIE), rebuild=rebuild)
    bound = _bound(DEFAULT, DEFAULT.max_unverifiable, DEFAULT.unverifiable_window)
    assert lies <= bound, (name, lies, bound)
    # the greedy cycler gets far less than even the bound: it pays 1,000 truthful checks
    # a cycle once its repeats reach the cap
    if name == "greedy":
        assert lies <= DEFAULT.max_unverifiable * (max_repeats(DEFAULT) + 1 + HORIZON / 1000)


def test_just_under_the_trigger_is_d22s_bound_itself() -> None:
    """The rate the window allows within one cycle is still allowed (5 in every 1,000:
    never quarantined), and one more a window is not."""
    lies = _play(DEFAULT, _under_rate(UNJUDGED_LIE, 5, 1000), rebuild=False)
    assert lies == 5 * HORIZON // 1000
    q = QuarantineTracker(DEFAULT)
    for _ in range(6):
        q.observe(UNJUDGED_LIE)
    assert q.is_quarantined("r")


@pytest.mark.parametrize("rebuild", [False, True])
@pytest.mark.parametrize(("name", "make"), STRATEGIES)
def test_a_judged_liar_gains_nothing_from_cycling(
    name: str, make: Callable[[ClaimCheck], Strategy], rebuild: bool
) -> None:
    """The k-of-m track the same way: k lies per k + recover_after checks (half of them)
    before; now below its own within-cycle rate, (k - 1) / m, plus the allowance."""
    lies = _play(DEFAULT, make(JUDGED_LIE), rebuild=rebuild)
    assert lies <= _bound(DEFAULT, DEFAULT.k, DEFAULT.m), (name, lies)
    assert lies <= DEFAULT.k * (max_repeats(DEFAULT) + 2 + 2 * HORIZON / 1000), (name, lies)


def test_recover_after_doubles_per_repeat_up_to_the_cap() -> None:
    p = QuarantinePolicy(recover_after=3, recover_after_max=20)
    assert [recover_needed(p, n) for n in range(6)] == [3, 6, 12, 20, 20, 20]
    assert max_repeats(p) == 3
    assert max_repeats(DEFAULT) == 9  # 3 * 2**9 = 1,536 >= 1,000 > 768
    # a recover_after at or above the cap: no escalation, as before
    flat = QuarantinePolicy(recover_after=50, recover_after_max=20)
    assert max_repeats(flat) == 0 and recover_needed(flat, 4) == 50


def _agree_until_released(q: QuarantineTracker, limit: int = 10_000) -> int:
    for n in range(1, limit + 1):
        if q.observe(TRUTH) is False:
            return n
    raise AssertionError("never released")


SMALL = QuarantinePolicy(
    k=2, m=3, recover_after=2, recover_after_max=16, forgive_after=50, max_unverifiable=3
)


def test_an_honest_replica_caught_once_recovers_as_before_and_is_forgiven() -> None:
    """The honest cost: a first quarantine needs recover_after agreeing checks (as before),
    one soon after twice as many; forgive_after clean checks in service forget one, and a
    bad check among them starts that count again."""
    q = QuarantineTracker(SMALL)
    for expect in (2, 4, 8, 16, 16):  # quarantined again at once each time: up to the cap
        q.observe(JUDGED_LIE)
        assert q.observe(JUDGED_LIE) is True
        assert q.standing("r")["quarantine_recover_after"] == expect
        assert _agree_until_released(q) == expect
    assert q.standing("r") == {
        "quarantined": False,
        "quarantine_repeats": 3,  # the cap's: 2 * 2**3 = 16
        "quarantine_recover_after": 16,
    }
    for _ in range(49):
        assert q.observe(TRUTH) is None
    q.observe(ClaimCheck("r", 10, 0, 10))  # one bad check: not yet quarantined (k = 2)...
    for _ in range(49):  # ...but the clean count starts again
        q.observe(TRUTH)
    assert q.standing("r")["quarantine_repeats"] == 3
    q.observe(TRUTH)
    assert q.standing("r")["quarantine_repeats"] == 2  # 50 clean: one forgotten
    for _ in range(100):
        q.observe(TRUTH)
    assert q.standing("r")["quarantine_repeats"] == 0
    q.observe(JUDGED_LIE)
    assert q.observe(JUDGED_LIE) is True
    assert _agree_until_released(q) == 2  # forgiven: as a first offence


def test_the_unverifiable_track_escalates_too() -> None:
    """W3's own case: the rogue that keeps its floor just ahead of each lookup."""
    q = QuarantineTracker(SMALL)
    needs = []
    for _ in range(4):
        got = [q.observe(UNJUDGED_LIE) for _ in range(3)]
        assert got[-1] is True
        needs.append(_agree_until_released(q))
    assert needs == [2, 4, 8, 16]


def test_a_rebuild_lifts_a_first_offence_only() -> None:
    """A rogue agent clears its index when quarantined: the first time it is released at
    once (an honest rebuild), a repeat is not, whatever it proved in between."""
    q = QuarantineTracker(SMALL)
    q.observe(JUDGED_LIE)
    q.observe(JUDGED_LIE)
    assert q.release("r") and not q.is_quarantined("r")
    for _ in range(20):  # proven since (the rebuild flag's rule alone would re-arm)
        q.observe(TRUTH)
    q.observe(JUDGED_LIE)
    assert q.observe(JUDGED_LIE) is True
    assert not q.release("r") and q.is_quarantined("r")
    assert _agree_until_released(q) == 4


def test_a_reload_that_lowers_the_cap_lowers_what_is_remembered() -> None:
    q = QuarantineTracker(SMALL)
    for _ in range(4):
        q.observe(JUDGED_LIE)
        q.observe(JUDGED_LIE)
        _agree_until_released(q)
    assert q.standing("r")["quarantine_repeats"] == 3
    q.configure(SMALL.model_copy(update={"recover_after_max": 4}))
    assert q.standing("r") == {
        "quarantined": False,
        "quarantine_repeats": 1,
        "quarantine_recover_after": 4,
    }
    assert q.standing("other")["quarantine_recover_after"] == 2  # never checked


def test_lowering_the_cap_or_the_forgiveness_is_a_weakening() -> None:
    """Either lets a repeat offender back sooner: a file reload that lowers them waits for
    the file to keep still, as for recover_after."""
    old = Policy()

    def quarantine(cap: int, forgive: int) -> Policy:
        q = QuarantinePolicy(recover_after_max=cap, forgive_after=forgive)
        return Policy(quarantine=q)

    assert isolation_weakenings(old, quarantine(100, 50)) == [
        "quarantine.recover_after_max: 1000 -> 100",
        "quarantine.forgive_after: 1000 -> 50",
    ]
    assert isolation_weakenings(old, quarantine(5000, 5000)) == []


async def test_admin_replicas_shows_a_repeat_offenders_standing() -> None:
    """A real gateway: the liar's second quarantine needs twice the agreeing checks, and
    /admin/replicas says how many quarantines it is remembered for and what it needs."""
    policy = (
        "quarantine: {missing_fraction: 0.5, k: 1, m: 1, min_claimed_blocks: 2,"
        " recover_after: 1, settle_s: 0.3}"
    )
    async with stack(count=2, policy=policy) as st, st.http() as h:
        gw, c = st.gw, st.client()
        liar, other = st.replica_id(0), st.replica_id(1)
        assert gw.pool is not None
        gw.pool.cordon(other)  # every request goes to the liar
        n = 0

        async def ask(seed: int, lie: bool) -> None:
            nonlocal n
            prompt = words(400, seed)
            if not lie:  # the engine holds it first: the claim is true
                await c.completions.create(model=st.model, prompt=prompt, max_tokens=1)
            await claim(gw, liar, prompt_keys(gw, prompt, st.model))
            await c.completions.create(model=st.model, prompt=prompt, max_tokens=1)
            n += 1
            assert sum((await checked(gw, liar, n)).values()) == n

        async def standing() -> dict[str, object]:
            got = (await h.get("/admin/replicas", headers={"x-admin-key": ADMIN})).json()
            rep = next(r for r in got["replicas"] if r["id"] == liar)
            return {k: v for k, v in rep.items() if k.startswith("quarantine")}

        await ask(3000, lie=True)
        assert gw.quarantine.is_quarantined(liar)
        assert await standing() == {
            "quarantined": True,
            "quarantine_repeats": 1,
            "quarantine_recover_after": 1,
        }
        await ask(3001, lie=False)
        assert not gw.quarantine.is_quarantined(liar)
        await ask(3002, lie=True)
        assert await standing() == {
            "quarantined": True,
            "quarantine_repeats": 2,
            "quarantine_recover_after": 2,  # a repeat: twice recover_after
        }
        await ask(3003, lie=False)
        assert gw.quarantine.is_quarantined(liar)
        await ask(3004, lie=False)
        assert await standing() == {
            "quarantined": False,
            "quarantine_repeats": 2,
            "quarantine_recover_after": 4,  # what a third would need
        }
