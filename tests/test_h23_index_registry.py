"""Registration conflicts: one engine rank claimed twice (no Redis needed)."""

from __future__ import annotations

from cachecore.registry import ReplicaAllowlist
from tests.test_registry import reg


def test_rank_zero_and_no_rank_are_one_claim_on_a_url() -> None:
    """An engine without data parallelism is rank 0 (the allowlist's rank check reads an
    absent rank as 0, and so does the pool's rank assignment): a registration naming no
    rank and one naming rank 0 at one URL claim the same engine, and must meet the
    url_conflict rule. They were both accepted (claims keyed by the raw rank: None != 0),
    so an agent could put a replica of its own in front of another's engine."""
    allow = ReplicaAllowlist(["http://10.0.0.1:8000"])
    honest, twin = reg("eng"), reg("imposter", dp=0)
    accepted, rejected = allow.accept([honest, twin])
    assert accepted == []
    assert sorted((r.replica_id, r.reason) for r in rejected) == [
        ("eng", "url_conflict"),
        ("imposter", "url_conflict"),
    ]
    # data-parallel ranks of one engine still share its URL
    dp0, dp1 = reg("e", dp=0), reg("e@dp1", dp=1)
    assert allow.accept([dp0, dp1]) == ([dp0, dp1], [])
