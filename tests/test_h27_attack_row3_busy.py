"""`kvgate attack`'s row 3 on a busy host (two CPU hogs). The rogue (loadtest.attacks.node
._lie) when the honest agent beside it rewrites the replica's index under a new epoch
between the rogue's read of the epoch and its write: `kvgate attack --quick --only 3`
crashed with StaleEpochError ('apply r1: STALE epoch 2'); a real rogue reads the epoch
again and goes on lying. And the row's count of lies (_lie_until_quarantined), which
stopped after a fixed number of requests however many of them got no verdict."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cachecore.index.base import StaleEpochError
from cachecore.lifecycle import IndexWrite
from gateway.metrics import GatewayMetrics
from gateway.quarantine import ClaimCheck, QuarantineTracker
from loadtest.attacks.node import (
    LIE_TRIES,
    NO_VERDICT_ROOM,
    Q_K,
    Q_M,
    Q_MIN_CLAIMED,
    Q_MISSING,
    Q_RECOVER,
    _lie,
    _lie_until_quarantined,
    false_claims_held,
)
from policies.schema import QuarantinePolicy


class _ResyncingIndex:
    """r1's index as the rogue's credentials see it: a write under an epoch that is not the
    current one is refused as Redis refuses it (STALE), and the honest agent's rewrite
    bumps the epoch right after each of the rogue's first ``resyncs`` reads of it."""

    def __init__(self, resyncs: int) -> None:
        self.epoch = 1
        self.resyncs = resyncs
        self.written: list[tuple[int, IndexWrite]] = []

    async def meta(self, replica: str) -> Any:
        read = self.epoch
        if self.resyncs:
            self.resyncs -= 1
            self.epoch += 1  # the honest agent's rewrite lands after the read
        return SimpleNamespace(epoch=read)

    async def apply(self, replica: str, epoch: int, write: IndexWrite, now_ms: int) -> None:
        if epoch != self.epoch:
            raise StaleEpochError(f"apply {replica}: STALE epoch {self.epoch}")
        self.written.append((epoch, write))


def _any(rogue: _ResyncingIndex) -> Any:
    """The stand-in, where the row's functions take a RedisIndex."""
    return rogue


def _stack() -> Any:
    return SimpleNamespace(victim_keys=lambda prompt: [b"k1" * 8, b"k2" * 8])


async def test_the_rogue_rereads_its_epoch_when_a_resync_lands_before_its_write() -> None:
    rogue = _ResyncingIndex(resyncs=2)
    epoch, keys = await _lie(_stack(), rogue, "r1", "a prompt")  # type: ignore[arg-type]
    assert epoch == 3 and rogue.epoch == 3
    assert [e for e, _ in rogue.written] == [3]  # the lie, once, under the current epoch
    assert set(rogue.written[0][1].blocks) == set(keys)


async def test_a_rogue_refused_every_time_stops_after_its_tries() -> None:
    rogue = _ResyncingIndex(resyncs=LIE_TRIES)
    with pytest.raises(StaleEpochError):
        await _lie(_stack(), rogue, "r1", "a prompt")  # type: ignore[arg-type]
    assert rogue.written == [] and rogue.epoch == 1 + LIE_TRIES


# a busy host's 3d `raised` rogue: what each lying request came to ("unseen": the index
# lookup fell back, no check; "fast skipped": a check that gave up before the answer came)
_BUSY_RAISED = (
    "unseen", "skipped", "unseen", "unverifiable", "tampered", "unseen", "evicted",
    "fast skipped", "unseen", "tampered", "tampered",
)  # fmt: skip


def _row_stack(script: tuple[str, ...]) -> tuple[Any, Any]:
    """The row's stack as _lie_until_quarantined sees it: the real tracker and metrics, each
    request answered as ``script`` says (the replicas, agents and Redis left out: what is
    under test is the row's count)."""
    gw = SimpleNamespace(metrics=GatewayMetrics(), quarantine=_tracker())
    out = {"check": False}  # a claim check out: until its verdict is awaited
    steps = iter(script)

    def settled() -> bool:
        was, out["check"] = out["check"], False
        return not was

    async def ask(prompt: str) -> str:
        what = next(steps)
        if what == "unseen":
            return "r0"
        if what.startswith("fast "):
            what = what.removeprefix("fast ")
        else:
            out["check"] = True
        gw.metrics.claim_checks.labels("r1", what).inc()
        if what != "skipped":
            still = 0 if what == "evicted" else 19
            check = ClaimCheck("r1", 19, 0, still, unverifiable=what == "unverifiable")
            gw.quarantine.observe(check)
        return "r1"

    gw.background_settled = settled
    st = SimpleNamespace(
        g=SimpleNamespace(gw=gw),
        words=SimpleNamespace(text=lambda n: "lie"),
        cfg=SimpleNamespace(prompt_words=4),
        victim_keys=lambda prompt: [],
        ask=ask,
    )
    return st, gw


def _tracker() -> QuarantineTracker:
    return QuarantineTracker(
        QuarantinePolicy(
            missing_fraction=Q_MISSING, k=Q_K, m=Q_M, min_claimed_blocks=Q_MIN_CLAIMED,
            recover_after=Q_RECOVER,
        )
    )  # fmt: skip


async def test_requests_given_no_verdict_do_not_use_up_the_rows_lies() -> None:
    """Under two CPU hogs 3d's `raised` rogue read BROKEN, 'NOT quarantined' after its
    3 * K = 9 lying requests: most of them got no verdict on its count (lookups fell back,
    a check skipped, one judged unverifiable), so the gateway had fewer than K lies to
    judge when the row stopped. Now only the lies given a verdict use up the limit: it is
    quarantined at the 11th request, K judged among 8 excused, and the row holds. A check
    that judged before the answer came is excused once (by its outcome), not also as
    'no check came'."""
    st, gw = _row_stack(_BUSY_RAISED)
    requests, misrouted, excused = await _lie_until_quarantined(
        st, _any(_ResyncingIndex(0)), "r1", 3 * Q_K, track="tampered"
    )
    assert gw.quarantine.is_quarantined("r1")
    assert (requests, misrouted) == (11, 7)
    assert excused == {
        "unchecked": 4, "skipped": 2, "evicted": 1, "evicted_late": 0, "evicted_restored": 0,
        "unverifiable": 1,
    }  # fmt: skip
    assert false_claims_held(True, requests, Q_K, sum(excused.values()))


async def test_the_row_still_gives_up_on_a_gateway_that_never_quarantines() -> None:
    """The limit still holds for the lies given a verdict: a gateway that judges them and
    never acts on it is stopped after 3 * K of them, and the row reads it BROKEN; a host
    where no lie is ever seen stops at NO_VERDICT_ROOM times the limit."""
    st, gw = _row_stack(("tampered",) * 100)
    gw.quarantine.observe = lambda check: None  # judged, never acted on: the miss to catch
    requests, _, excused = await _lie_until_quarantined(st, _any(_ResyncingIndex(0)), "r1", 3 * Q_K)
    assert requests == 3 * Q_K and sum(excused.values()) == 0
    assert not false_claims_held(False, requests, Q_K, 0)
    st, gw = _row_stack(("unseen",) * 100)
    requests, _, excused = await _lie_until_quarantined(st, _any(_ResyncingIndex(0)), "r1", 3 * Q_K)
    assert requests == NO_VERDICT_ROOM * 3 * Q_K and excused["unchecked"] == requests
