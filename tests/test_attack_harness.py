"""The attack suite's own rules (``loadtest.attacks``): what a row counts, read off the
gateway's real metrics."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.metrics import GatewayMetrics
from loadtest.attacks.node import _claim_checks, false_claims_held


def test_a_skipped_claim_check_does_not_count_against_the_bound() -> None:
    """`kvgate attack --quick --only 3` reported "false claims ... BROKEN" (exit 1, "AN
    ATTACK SUCCEEDED") in 2 of 3 runs on a shared host: one of the liar's checks was
    skipped (kvgate_claim_checks_total{outcome="skipped"}: the gateway could not tell an
    eviction from a lie), so quarantine came on the 4th lie, and the row judged 4 > K=3."""
    assert false_claims_held(True, 4, 3, skipped=1)
    assert false_claims_held(True, 3, 3, skipped=0)
    assert not false_claims_held(True, 4, 3, skipped=0)  # a 4th conclusive lie: broken
    assert not false_claims_held(False, 2, 3, skipped=0)  # never quarantined: broken


def test_claim_checks_are_read_per_replica_and_outcome() -> None:
    metrics = GatewayMetrics()
    metrics.claim_checks.labels("r1", "skipped").inc()
    metrics.claim_checks.labels("r1", "false").inc(3)
    metrics.claim_checks.labels("r0", "skipped").inc(5)
    gw = SimpleNamespace(metrics=metrics)
    assert _claim_checks(gw, "r1", "skipped") == 1
    assert _claim_checks(gw, "r1", "false") == 3
    assert _claim_checks(gw, "r2", "skipped") == 0
