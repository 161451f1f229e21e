"""Per-tenant admission control: request rate, concurrency, and uncached prefill tokens.

The uncached-token budget is the flooding defence that acts on what reaches the engines
(vLLM has no per-tenant quota): a tenant streaming unique long prompts spends its budget
and gets 429s instead of flushing everyone else's prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.schema import TenantLimits, bucket_burst


class TokenBucket:
    """``rate`` units per second, up to ``burst``. Invariant: ``0 <= level <= burst`` except
    after an oversized take, which may leave it negative (debt) so that one request larger
    than the burst is admitted when the bucket is full, and then paid for, or a
    :meth:`charge` (work done after a :meth:`wait_s` check that others also passed)."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self._t = now

    def configure(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.level = min(self.level, burst)

    def _refill(self, now: float) -> None:
        # an earlier ``now`` than the last (a caller's stale reading) refills nothing and
        # leaves the clock where it was: moved back, the interval since then was refilled
        # a second time at the next call
        if now > self._t:
            self.level = min(self.burst, self.level + (now - self._t) * self.rate)
            self._t = now

    def give(self, amount: float, now: float) -> None:
        """Return ``amount`` taken for work that was not done (up to ``burst``)."""
        self._refill(now)
        self.level = min(self.burst, self.level + amount)

    def wait_s(self, amount: float, now: float) -> float:
        """What :meth:`take` would answer for ``amount``, taking nothing."""
        self._refill(now)
        need = min(amount, self.burst)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> float:
        """Take ``amount``; return 0.0 on success, else the seconds to wait before retrying."""
        wait = self.wait_s(amount, now)
        if not wait:
            self.level -= amount
        return wait

    def charge(self, amount: float, now: float) -> None:
        """Take ``amount`` whatever the level, into debt if need be (repaid by the refill)."""
        self._refill(now)
        self.level -= amount


@dataclass(slots=True)
class _TenantState:
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None
    in_flight: int = 0
    replays: int = 0  # of in_flight: streamed retrievals (admit's ``replay``)


@dataclass(frozen=True, slots=True)
class Rejection:
    limit: str  # "rate" | "concurrency" | "uncached_tokens"
    retry_after_s: float
    message: str


class TenantLimiter:
    """Holds every tenant's buckets; survives policy reloads (limits are re-applied)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _TenantState] = {}

    def _state(self, tenant: str, limits: TenantLimits, now: float) -> _TenantState:
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _TenantState()
        st.requests = _bucket(st.requests, limits.requests_per_s, limits.requests_burst, now)
        st.tokens = _bucket(
            st.tokens, limits.uncached_tokens_per_s, limits.uncached_tokens_burst, now
        )
        return st

    def admit(
        self,
        tenant: str,
        limits: TenantLimits,
        now: float,
        concurrency: bool = True,
        replay: bool = False,
    ) -> Rejection | None:
        """Admit a request (rate and concurrency). On success the caller must call
        :meth:`release` exactly once when the request ends, with the same ``replay``.
        ``concurrency`` false: counted but not held to ``max_concurrency`` (a Responses
        retrieval or cancel, no engine work: a tenant whose background runs hold every slot
        still polls and cancels them). ``replay``: a streamed retrieval, held to
        ``max_concurrency`` among the tenant's replays alone: no engine work either, but it
        holds its upstream connection as long as the run it replays (vLLM's replay past a
        run's events waits, for ever once the run is over, up to the gateway's timeouts): one
        tenant's replays, unbounded, could hold a replica's every connection
        (KVGATE_MAX_CONNECTIONS) from every other tenant. A tenant whose background runs
        hold every slot still has as many replays, to resume their streams."""
        st = self._state(tenant, limits, now)
        held = st.replays if replay else st.in_flight
        if (
            (concurrency or replay)
            and limits.max_concurrency is not None
            and held >= limits.max_concurrency
        ):
            what = "streamed retrievals" if replay else "requests"
            return Rejection("concurrency", 1.0, f"too many concurrent {what} for this key")
        if st.requests is not None:
            wait = st.requests.take(1.0, now)
            if wait > 0:
                return Rejection("rate", wait, "request rate limit exceeded for this key")
        st.in_flight += 1
        st.replays += replay
        return None

    def charge_uncached(
        self, tenant: str, limits: TenantLimits, tokens: float, now: float
    ) -> Rejection | None:
        st = self._state(tenant, limits, now)
        if st.tokens is None or tokens <= 0:
            return None
        wait = st.tokens.take(tokens, now)
        if wait > 0:
            return Rejection(
                "uncached_tokens", wait, "uncached prompt token budget exceeded for this key"
            )
        return None

    def debit_uncached(self, tenant: str, tokens: float, now: float) -> None:
        """Take, after the request was admitted and into debt if need be (repaid by the
        refill), prefill beyond what :meth:`charge_uncached` took: a Responses follow-up's
        stored conversation, which its engine reports after it runs (D30), or a rerouted
        request's prefix its new replica lacks."""
        st = self._tenants.get(tenant)
        if st is not None and st.tokens is not None and tokens > 0:
            st.tokens.charge(tokens, now)

    def refund_uncached(self, tenant: str, tokens: float, now: float) -> None:
        """Give back what :meth:`charge_uncached` took for a request no engine computed
        (refused by the engine, or no replica reachable): the budget limits prefill work,
        and a tenant whose malformed requests fail fast must not be locked out for them."""
        st = self._tenants.get(tenant)
        if st is not None and st.tokens is not None and tokens > 0:
            st.tokens.give(tokens, now)

    def refund_request(self, tenant: str, now: float) -> None:
        """Give back the request rate token :meth:`admit` took for a request refused before
        any work by a bound on runs at once, not on requests (the background watch caps,
        D33): up to the bucket's burst, never above it."""
        st = self._tenants.get(tenant)
        if st is not None and st.requests is not None:
            st.requests.give(1.0, now)

    def release(self, tenant: str, replay: bool = False) -> None:
        st = self._tenants.get(tenant)
        if st is not None and st.in_flight > 0:
            st.in_flight -= 1
        if replay and st is not None and st.replays > 0:
            st.replays -= 1

    def in_flight(self, tenant: str) -> int:
        st = self._tenants.get(tenant)
        return st.in_flight if st else 0


def _bucket(
    current: TokenBucket | None, rate: float | None, burst: float | None, now: float
) -> TokenBucket | None:
    if rate is None:
        return None
    b = bucket_burst(rate, burst)
    if current is None:
        return TokenBucket(rate, b, now)
    if current.rate != rate or current.burst != b:
        current.configure(rate, b)
    return current
