"""Tenant rate limits the limiter cannot wait for: refused when the policy is loaded."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from gateway.errors import rate_limited
from gateway.limits import TenantLimiter
from policies.schema import MIN_RATE_PER_S, PolicyError, TenantLimits, parse_policy_text


@pytest.mark.parametrize("field", ["requests_per_s", "uncached_tokens_per_s"])
@pytest.mark.parametrize("rate", ["1e-320", "5e-324", "1e-7"])
def test_a_rate_too_small_to_wait_for_is_refused(field: str, rate: str) -> None:
    """`requests_per_s: 1e-320` was accepted: the limiter's wait (1 / 1e-320) overflowed to
    inf and the 429's Retry-After (int(inf)) raised OverflowError, so every rate-limited
    request of that tenant was a 500. Shown through the limiter as the gateway runs it."""
    text = f"tenants:\n  acme:\n    limits: {{{field}: {rate}}}\n"
    try:
        policy = parse_policy_text(text)
    except PolicyError as exc:
        assert f"tenants.acme.limits.{field}: Input should be greater than or equal to" in str(exc)
        return
    limits = policy.tenant("acme").limits  # unfixed: what a rate-limited request then met
    limiter = TenantLimiter()
    if field == "requests_per_s":
        assert limiter.admit("acme", limits, 0.0) is None
        rejection = limiter.admit("acme", limits, 0.0)
    else:
        assert limiter.charge_uncached("acme", limits, 1.0, 0.0) is None
        rejection = limiter.charge_uncached("acme", limits, 1.0, 0.0)
    assert rejection is not None
    rate_limited(rejection.message, rejection.retry_after_s, rejection.limit)
    pytest.fail(f"{field}: {rate} accepted (its wait: {rejection.retry_after_s} s)")


def test_the_smallest_rate_keeps_every_wait_finite() -> None:
    """At the floor, with a prompt far past any body limit, the wait and its 429 stay
    finite."""
    limits = TenantLimits(
        requests_per_s=MIN_RATE_PER_S,
        requests_burst=1.0,
        uncached_tokens_per_s=MIN_RATE_PER_S,
        uncached_tokens_burst=1.0,
    )
    limiter = TenantLimiter()
    assert limiter.admit("acme", limits, 0.0) is None
    assert limiter.charge_uncached("acme", limits, 10.0**9, 0.0) is None  # into debt
    for rejection in (
        limiter.admit("acme", limits, 0.0),
        limiter.charge_uncached("acme", limits, 10.0**9, 0.0),
    ):
        assert rejection is not None and math.isfinite(rejection.retry_after_s)
        error = rate_limited(rejection.message, rejection.retry_after_s, rejection.limit)
        assert error.status == 429 and int(error.headers["Retry-After"]) >= 1


@pytest.mark.parametrize("name", ["KVGATE_API_KEYS_MISS_RATE", "KVGATE_API_KEYS_MISS_RATE_GLOBAL"])
def test_an_unknown_key_budget_too_small_to_wait_for_is_refused(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_API_KEYS_MISS_RATE=1e-320` was accepted: past the burst, a refused lookup's
    wait (its shortfall / 1e-320) was inf and the 429's Retry-After raised OverflowError,
    a 500 for every unknown key. 0 (no budget) stays accepted."""
    from cachecore.argtypes import settings_error
    from gateway.auth import KeyLookupRefused, _check_budgets
    from gateway.limits import TokenBucket
    from gateway.settings import GatewaySettings

    monkeypatch.setenv(name, "0")
    GatewaySettings()
    monkeypatch.setenv(name, "1e-320")
    try:
        settings = GatewaySettings()
    except ValidationError as exc:
        says = f"({name}): 0 (no budget) or at least 1e-06 per second"
        assert says in settings_error(exc), settings_error(exc)
        return
    # unfixed: the key store's budget as it is built from these settings, spent
    rate = getattr(settings, name.removeprefix("KVGATE_").lower())
    bucket = TokenBucket(rate, 1.0, 0.0)
    bucket.charge(1.0, 0.0)
    with pytest.raises(KeyLookupRefused) as refused:
        _check_budgets(((bucket, KeyLookupRefused),), 0.0)
    rate_limited(str(refused.value), refused.value.retry_after_s, "unknown_keys")
    pytest.fail(f"{name}=1e-320 accepted (its wait: {refused.value.retry_after_s} s)")
