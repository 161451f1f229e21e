"""The rate limits' buckets at their edges: a clock read earlier than the last."""

from __future__ import annotations

import math

import pytest

from gateway.limits import TenantLimiter, TokenBucket
from policies.schema import TenantLimits


def test_a_bucket_read_with_an_earlier_clock_refills_nothing_twice() -> None:
    """A take at t=10 empties the bucket; a call with t=5 (a stale reading) moved the
    bucket's clock back to 5, so the next call at t=10 refilled 5 s that had already
    passed: 50 tokens the tenant never waited for."""
    bucket = TokenBucket(rate=10.0, burst=100.0, now=0.0)
    assert bucket.take(100.0, 10.0) == 0.0
    assert bucket.wait_s(1.0, 5.0) == pytest.approx(0.1)
    assert bucket.wait_s(50.0, 10.0) == pytest.approx(5.0)
    assert bucket.take(1.0, 10.2) == 0.0  # time moving on refills as before
    assert bucket.level == pytest.approx(1.0)


def test_a_tenant_limiter_does_not_admit_more_for_a_stale_clock() -> None:
    """The same through TenantLimiter.admit: a burst of 2 at 1/s, spent at t=100; a call
    carrying t=99 must not let t=100 admit again."""
    lim = TenantLimiter()
    limits = TenantLimits(requests_per_s=1.0, requests_burst=2.0)
    assert lim.admit("t", limits, 100.0) is None
    assert lim.admit("t", limits, 100.0) is None
    rej = lim.admit("t", limits, 99.0)
    assert rej is not None and rej.limit == "rate"
    rej = lim.admit("t", limits, 100.0)
    assert rej is not None and rej.limit == "rate"


@pytest.mark.parametrize("wait", [math.inf, math.nan, 1e300, -5.0])
def test_a_wait_no_bucket_can_give_is_still_a_429(wait: float) -> None:
    """A rate near zero made a limiter's wait inf, and int(inf) in the 429's Retry-After
    raised OverflowError: a 500 where a 429 was meant. The settings now bound the rates;
    the 429 bounds every caller: at most a day, at least a second."""
    from gateway.errors import rate_limited

    err = rate_limited("slow down", wait, "rate")
    secs = int(err.headers["Retry-After"])
    assert err.status == 429 and 1 <= secs <= 86_400
