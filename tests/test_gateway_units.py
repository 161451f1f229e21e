"""Gateway components on their own: keys, limits, quarantine, replica specs, scopes, load."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import httpx
import orjson
import pytest
from pydantic import SecretStr

from cachecore.agent.progress import ProgressTracker
from cachecore.agent.scrape import EngineSnapshot
from cachecore.keys import BlockKeyer, ScopeKind
from cachecore.loadstate import EngineLoad, LoadRecord
from cachecore.scoring import Coefficients
from cachecore.testing import free_port
from gateway.auth import KeyFileError, KeyStore, check_admin, hash_key, load_key_file
from gateway.core import Gateway
from gateway.errors import GatewayError
from gateway.limits import TenantLimiter, TokenBucket
from gateway.load import InFlight, LoadTracker, SharedLoad, Ticket
from gateway.proxy import _refused
from gateway.quarantine import ClaimCheck, QuarantineTracker
from gateway.replicas import ReplicaPool, ReplicaSpec, ReplicaSpecError, parse_replica_spec
from gateway.settings import GatewaySettings
from gateway.tokenization import (
    EnginePromptTokenizer,
    LocalPromptTokenizer,
    completion_prompt,
    completion_prompt_packed,
)
from gateway.upstream import LeanTransport
from policies.schema import HealthPolicy, QuarantinePolicy, TenantLimits, parse_policy_text

# ---------------------------------------------------------------- auth


async def test_key_file_maps_hashes_to_tenants(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(f"keys:\n  - {{sha256: {hash_key('sk-a')}, tenant: acme}}\n")
    store = KeyStore(load_key_file(f))
    assert await store.tenant_for("Bearer sk-a") == "acme"
    assert await store.tenant_for("Bearer sk-b") is None
    assert await store.tenant_for("sk-a") is None  # not a bearer token
    assert await store.tenant_for(None) is None
    assert "sk-a" not in f.read_text()


@pytest.mark.parametrize(
    "text",
    ["keys: [{sha256: abc, tenant: t}]", "keys: [{sha256: %s, tenant: 'bad name'}]" % ("a" * 64)],
)
def test_bad_key_files_are_rejected(tmp_path: Path, text: str) -> None:
    f = tmp_path / "k.yaml"
    f.write_text(text)
    with pytest.raises(KeyFileError):
        load_key_file(f)


async def test_keys_in_redis(redis_url: str) -> None:
    from redis.asyncio import Redis

    r = Redis.from_url(redis_url)
    await r.hset("kvg:apikeys", hash_key("sk-r"), "beta")
    store = KeyStore(redis=r)
    assert await store.tenant_for("Bearer sk-r") == "beta"
    assert await store.tenant_for("Bearer nope") is None
    await r.aclose()


async def test_a_malformed_tenant_in_redis_is_logged_not_a_silent_401(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a key whose Redis hash value is no valid tenant name (a typo, a stray space)
    was refused like an unknown key, and nothing told the operator which entry was bad."""
    import logging

    from redis.asyncio import Redis

    r = Redis.from_url(redis_url)
    digest = hash_key("sk-typo")
    await r.hset("kvg:apikeys", digest, "acme corp")
    store = KeyStore(redis=r, cache_ttl_s=0.0)
    caplog.set_level(logging.WARNING, logger="gateway.auth")
    for _ in range(3):
        assert await store.tenant_for("Bearer sk-typo") is None
    warned = [rec for rec in caplog.records if "not a valid tenant name" in rec.getMessage()]
    assert len(warned) == 1  # once per key, not per request
    assert warned[0].__dict__["key_sha256"] == digest[:12]
    assert "sk-typo" not in caplog.text
    await r.delete("kvg:apikeys")
    await r.aclose()


async def test_a_tenant_in_redis_that_is_no_utf8_is_refused_not_a_500(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review: a hash value that is no UTF-8 (binary written by another tool) raised
    UnicodeDecodeError from the lookup, every request with that key a 500 'internal
    gateway error' (and a Redis round trip, never cached), where 58d2c24 refuses and logs a
    malformed tenant."""
    import logging

    from redis.asyncio import Redis

    r = Redis.from_url(redis_url)
    digest = hash_key("sk-binary")
    await r.hset("kvg:apikeys", digest, b"\xffacme")
    store = KeyStore(redis=r)
    caplog.set_level(logging.WARNING, logger="gateway.auth")
    assert await store.tenant_for("Bearer sk-binary") is None
    assert any("not a valid tenant name" in rec.getMessage() for rec in caplog.records)
    await r.delete("kvg:apikeys")
    await r.aclose()


def test_admin_key_check() -> None:
    assert check_admin("Bearer s3cret", "s3cret") and check_admin("s3cret", "s3cret")
    assert not check_admin("wrong", "s3cret") and not check_admin(None, "s3cret")
    assert not check_admin("anything", None)  # no admin key: admin is closed


# ---------------------------------------------------------------- limits


def test_token_bucket_rate_burst_and_debt() -> None:
    b = TokenBucket(rate=10, burst=20, now=0.0)
    assert b.take(20, 0.0) == 0.0
    assert b.take(1, 0.0) == pytest.approx(0.1)
    assert b.take(1, 0.1) == 0.0
    big = TokenBucket(rate=100, burst=50, now=0.0)
    assert big.take(500, 0.0) == 0.0  # larger than burst: admitted on a full bucket, as debt
    assert big.take(1, 1.0) > 0  # and paid for


def test_tenant_limiter_rate_concurrency_tokens() -> None:
    lim = TenantLimiter()
    limits = TenantLimits(requests_per_s=1, requests_burst=2, max_concurrency=3)
    assert lim.admit("t", limits, 0.0) is None
    assert lim.admit("t", limits, 0.0) is None
    rej = lim.admit("t", limits, 0.0)
    assert rej is not None and rej.limit == "rate" and rej.retry_after_s == pytest.approx(1.0)
    assert lim.admit("other", limits, 0.0) is None  # per tenant
    conc = TenantLimits(max_concurrency=1)
    assert lim.admit("c", conc, 0.0) is None
    rej = lim.admit("c", conc, 0.0)
    assert rej is not None and rej.limit == "concurrency"
    lim.release("c")
    assert lim.admit("c", conc, 0.0) is None
    tok = TenantLimits(uncached_tokens_per_s=1000, uncached_tokens_burst=2000)
    assert lim.charge_uncached("f", tok, 2000, 0.0) is None
    rej = lim.charge_uncached("f", tok, 500, 0.0)
    assert rej is not None and rej.limit == "uncached_tokens"
    assert rej.retry_after_s == pytest.approx(0.5)
    # a refund (work no engine did) fills the bucket again, never past its burst
    lim.refund_uncached("f", 10**6, 0.0)
    assert lim.charge_uncached("f", tok, 2000, 0.0) is None
    assert lim.charge_uncached("f", tok, 1, 0.0) is not None


# ---------------------------------------------------------------- quarantine


def test_quarantine_after_k_of_m_false_claims_and_recovery() -> None:
    q = QuarantineTracker(QuarantinePolicy(missing_fraction=0.5, k=2, m=3, recover_after=2))
    lie = ClaimCheck("r", claimed_blocks=10, actual_blocks=0, still_claimed_blocks=10)
    truth = ClaimCheck("r", claimed_blocks=10, actual_blocks=10, still_claimed_blocks=10)
    assert q.observe(lie) is None
    assert q.observe(truth) is None
    assert q.observe(lie) is True and q.is_quarantined("r")
    assert q.observe(truth) is None
    assert q.observe(truth) is False and not q.is_quarantined("r")


def test_eviction_in_between_is_not_a_lie() -> None:
    q = QuarantineTracker(QuarantinePolicy(k=1, m=1))
    evicted = ClaimCheck("r", claimed_blocks=10, actual_blocks=0, still_claimed_blocks=3)
    assert q.observe(evicted) is None and not q.is_quarantined("r")
    small = ClaimCheck("r", claimed_blocks=1, actual_blocks=0, still_claimed_blocks=1)
    assert q.observe(small) is None  # below min_claimed_blocks
    # removed after the lookup and stored again: the claim stands, yet it was an eviction
    restored = ClaimCheck("r", 10, 0, 10, removed_since_lookup=True)
    assert q.observe(restored) is None and not q.is_quarantined("r")
    assert q.observe(ClaimCheck("r", 10, 0, 10)) is True  # the same without the removal


# ---------------------------------------------------------------- replica specs


def test_replica_spec_syntax() -> None:
    s = parse_replica_spec("http://127.0.0.1:8001/")
    assert (s.id, s.url, s.events, s.replay) == (
        "127.0.0.1-8001",
        "http://127.0.0.1:8001",
        None,
        None,
    )
    s = parse_replica_spec("http://h:1=tcp://h:2,tcp://h:3")
    assert (s.events, s.replay) == ("tcp://h:2", "tcp://h:3")
    s = parse_replica_spec("gpu-0=http://h:1=tcp://h:2,tcp://h:3")
    assert s.id == "gpu-0" and s.url == "http://h:1"
    for bad in ("h:1", "http://h:1=tcp://h:2", "http://h:1=udp://a,tcp://b", "a:b=http://h:1"):
        with pytest.raises(ReplicaSpecError):
            parse_replica_spec(bad)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        # an OpenAI client's base URL: every probe and request went to /v1/v1/..., the
        # replica was "unhealthy" and every request a 503, with no word of why
        ("http://127.0.0.1:8001/v1", "the engine's root URL, without /v1"),
        ("r0=http://127.0.0.1:8001/v1/", "the engine's root URL, without /v1"),
        # the default id of an IPv6 address holds ':' (the spec named no id at all)
        ("http://[::1]:8001", "give the replica an id: ID=http://[::1]:8001"),
        # credentials in the URL reached the health checks (httpx sends them) but never a
        # completion: healthy, and every request the engine's 401 as if the client's key
        ("http://user:pw@127.0.0.1:8001", "KVGATE_UPSTREAM_API_KEY"),
        ("http://127.0.0.1:8001?debug", "query or fragment"),
        # urllib's own words, naming no URL ("Port out of range 0-65535")
        ("http://127.0.0.1:99999", "replica URL 'http://127.0.0.1:99999': Port out of range"),
        ("http://127.0.0.1:port", "replica URL 'http://127.0.0.1:port': Port could not be cast"),
        ("http://127.0.0.1:8001#a", "query or fragment"),
    ],
)
def test_replica_specs_a_user_gets_wrong_say_what_to_write(spec: str, says: str) -> None:
    with pytest.raises(ReplicaSpecError, match=re.escape(says)):
        parse_replica_spec(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "http://user:s3cret@127.0.0.1:99999",  # the port's error came first, URL and all
        "http://user:s3cret@127.0.0.1:port",
        "ftp://user:s3cret@127.0.0.1:8001",  # the scheme's error too
        "http://user:s3cret@:8001",  # no host
        "r0=http://user:s3cret@127.0.0.1:8001/v1?x#y",
        "http://user:s3cret=x@127.0.0.1:8001",  # an "=" in it cut the URL inside the secret
        "http://:s3cret@127.0.0.1:8001",
        "http://127.0.0.1:8001=tcp://u:s3cret@127.0.0.1:2,tcp://127.0.0.1:3",
    ],
)
def test_a_replica_spec_error_never_echoes_url_credentials(spec: str) -> None:
    """Review: the URL's credentials were refused without echoing them (29b3a78), but the
    port and scheme checks before that refusal quoted the whole URL, password included,
    in the one line `kvgate serve` prints and logs."""
    with pytest.raises(ReplicaSpecError) as err:
        parse_replica_spec(spec)
    assert "s3cret" not in str(err.value)
    assert "KVGATE_UPSTREAM_API_KEY" in str(err.value)
    assert "must not carry credentials" in str(err.value)
    assert ",tcp" not in str(err.value)  # the host it names ends where the URL does


# ---------------------------------------------------------------- scopes


def gateway_with(policy_text: str) -> Gateway:
    return Gateway(
        GatewaySettings(salt_secrets=[SecretStr("x" * 32)], open_access=True),
        parse_policy_text(policy_text),
    )


def test_scope_resolution() -> None:
    gw = gateway_with(
        """
tenants:
  a: {trust_group: g}
  b: {}
  s: {sensitive: {default: none, allow_header: true, models: [med]}}
trust_groups: {g: [a]}
"""
    )
    pol = gw.policy
    scope, _ = gw.resolve_scope("a", pol.tenant("a"), {}, {}, "m")
    assert scope.kind is ScopeKind.GROUP and scope.name == "g"
    scope, _ = gw.resolve_scope("b", pol.tenant("b"), {}, {}, "m")
    assert scope.kind is ScopeKind.TENANT and scope.name == "b"
    with pytest.raises(GatewayError) as err:
        gw.resolve_scope("b", pol.tenant("b"), {"x-kvgate-sensitive": "session"}, {}, "m")
    assert err.value.status == 403
    hdr = {"x-kvgate-sensitive": "session", "x-kvgate-session": "s1"}
    scope, key = gw.resolve_scope("s", pol.tenant("s"), hdr, {}, "m")
    assert scope.kind is ScopeKind.SESSION and scope.ephemeral and key == "s/s1"
    assert gw.minter.salt(scope).startswith("kvg1:e:")
    scope, key = gw.resolve_scope("s", pol.tenant("s"), {"x-kvgate-sensitive": "session"}, {}, "m")
    assert scope.kind is ScopeKind.REQUEST and key is None  # no session id: per request
    scope, _ = gw.resolve_scope("s", pol.tenant("s"), {}, {"user": "u"}, "med")
    assert scope.kind is ScopeKind.SESSION  # the policy rule for model "med"
    with pytest.raises(GatewayError):
        gw.resolve_scope("s", pol.tenant("s"), {"x-kvgate-sensitive": "yes"}, {}, "m")


def test_tenants_in_different_scopes_get_different_salts() -> None:
    gw = gateway_with("tenants: {a: {}, b: {}}")
    sa, _ = gw.resolve_scope("a", gw.policy.tenant("a"), {}, {}, "m")
    sb, _ = gw.resolve_scope("b", gw.policy.tenant("b"), {}, {}, "m")
    assert gw.minter.salt(sa) != gw.minter.salt(sb)


# ---------------------------------------------------------------- load


def test_inflight_accounting_and_shared_merge() -> None:
    inf = InFlight()
    t = inf.dispatch("r", 1000)
    assert inf.own("r") == (1000, 1, 0)
    inf.first_token(t)
    assert inf.own("r") == (0, 0, 1)
    inf.done(t)
    inf.done(t)  # idempotent
    assert inf.own("r") == (0, 0, 0)
    assert inf.pending_deltas["r"] == [0, 0]
    t2 = inf.dispatch("r", 500)
    tracker = LoadTracker(
        inf, lambda: {"r": SharedLoad(running=7, waiting=2, other_queued_tokens=300)}
    )
    v = tracker.views(["r", "q"], {"r": 16})["r"]
    assert v.queued_prefill_tokens == 800 and v.running == 7 and v.waiting == 2 and v.capacity == 16
    inf.done(t2)


def test_an_engine_stall_past_the_grace_is_overdue_time_the_larger_not_the_sum() -> None:
    """D17: the stall an agent reports counts, past the grace, as the same overdue time a
    late stream does (D16); a replica's overdue time is the larger of the two."""
    inf = InFlight()
    shared = {"r": SharedLoad(running=1, stalled_ms=2500.0), "q": SharedLoad(running=1)}
    tracker = LoadTracker(inf, lambda: shared)
    caps: dict[str, int | None] = {}
    v = tracker.views(["r", "q"], caps, 100.0, 2.0)
    assert (v["r"].overdue_ms, v["q"].overdue_ms) == (500.0, 0.0)
    assert tracker.views(["r"], caps, 100.0, 3.0)["r"].overdue_ms == 0.0  # within the grace
    assert tracker.views(["r"], caps, 100.0, None)["r"].overdue_ms == 0.0  # grace off
    assert tracker.views(["r"], caps)["r"].overdue_ms == 0.0  # unwatched (the simulator)
    # a stream 1.2 s past its due time plus the grace: the larger of 1200 and 500
    t = inf.dispatch("r", 10, expected=97.8 - 1.0)
    assert tracker.views(["r"], caps, 100.0, 2.0)["r"].overdue_ms == pytest.approx(1200.0)
    shared["r"] = SharedLoad(running=1, stalled_ms=4000.0)
    assert tracker.views(["r"], caps, 100.0, 2.0)["r"].overdue_ms == 2000.0
    inf.done(t)
    # no stall: the very same view as without the field
    shared["r"] = SharedLoad(running=1)
    assert tracker.views(["r"], caps, 100.0, 2.0) == LoadTracker(
        inf, lambda: {"r": SharedLoad(running=1)}
    ).views(["r"], caps, 100.0, 2.0)


def test_a_stall_the_longest_waiting_prefill_explains_is_not_charged() -> None:
    """vLLM counts a prompt's tokens when its prefill completes: one long prefill with
    nothing decoding beside it stands the counters still. The stall is charged only past
    the grace plus the predicted prefill of the longest request this gateway has waiting
    there; without such a request (or without coefficients) all of it past the grace."""
    inf = InFlight()
    shared = {"r": SharedLoad(running=1, stalled_ms=5000.0)}
    tracker = LoadTracker(inf, lambda: shared)
    caps: dict[str, int | None] = {}
    coeffs = Coefficients(overhead_ms=30.0, prefill_ms_per_token=0.25)
    assert tracker.views(["r"], caps, 100.0, 2.0, coeffs)["r"].overdue_ms == 3000.0
    short = inf.dispatch("r", 400)  # 130 ms of prefill
    long = inf.dispatch("r", 8000)  # 2,030 ms: the longest explains that much of the stall
    assert tracker.views(["r"], caps, 100.0, 2.0, coeffs)["r"].overdue_ms == 970.0
    assert tracker.views(["r"], caps, 100.0, 2.0)["r"].overdue_ms == 3000.0
    inf.first_token(long)
    assert tracker.views(["r"], caps, 100.0, 2.0, coeffs)["r"].overdue_ms == 2870.0
    inf.done(short)
    assert tracker.views(["r"], caps, 100.0, 2.0, coeffs)["r"].overdue_ms == 3000.0
    inf.done(long)
    # a stall within what the longest request explains is no overdue time at all
    shared["r"] = SharedLoad(running=1, stalled_ms=3000.0)
    t = inf.dispatch("r", 8000)
    assert tracker.views(["r"], caps, 100.0, 2.0, coeffs)["r"].overdue_ms == 0.0
    inf.done(t)


def test_first_tokens_drop_the_waiting_tickets_in_order() -> None:
    """The waiting tickets stay bounded by the waiting ones even where no view ever reads
    them (the simulator): a ticket leaves at its first token, in any order; a stream also
    leaves D16's queue once every earlier stream has its first token."""
    inf = InFlight()
    a, b, c = inf.dispatch("r", 1), inf.dispatch("r", 2), inf.dispatch("r", 3)
    inf.first_token(b)
    assert len(inf._own["r"].waiting) == 2 and inf.longest_queued("r") == 3
    inf.first_token(a)
    assert len(inf._own["r"].waiting) == 1
    inf.done(c)
    assert len(inf._own["r"].waiting) == 0 and inf.longest_queued("r") == 0.0
    for _ in range(1000):
        inf.done(inf.dispatch("r", 5))
        inf.done(inf.dispatch("r", 5, expected=1.0))
    assert len(inf._own["r"].waiting) == 0 and len(inf._own["r"].watched) == 0


def _tickets_alive() -> int:
    gc.collect()
    return sum(isinstance(o, Ticket) for o in gc.get_objects())


def test_finished_non_streamed_tickets_are_not_held_behind_a_waiting_stream() -> None:
    """One stream still waiting for its first chunk (which may take up to the first-byte
    timeout) must not keep the non-streamed requests that finished after it (found in
    review: one queue of every ticket, pruned from the front, held them all)."""
    inf = InFlight()
    base = _tickets_alive()
    stream = inf.dispatch("r", 100_000, expected=10.0)
    for _ in range(1000):
        inf.done(inf.dispatch("r", 50))  # non-streamed requests served meanwhile
    assert _tickets_alive() - base <= 2, _tickets_alive() - base
    inf.done(stream)


def test_overdue_s_walks_streams_only() -> None:
    """D16's scan (every replica, every decision) covers streams only; waiting
    non-streamed requests (up to the engine's queue) must not add to its cost."""
    walked = 0

    class Counting(float):
        def __rsub__(self, other: object) -> float:
            nonlocal walked
            walked += 1
            return float(other) - float(self)  # type: ignore[arg-type]

    inf = InFlight()
    for _ in range(100):
        t = inf.dispatch("r", 500)
        t.expected = Counting(t.expected)
    assert inf.overdue_s("r", 100.0, 2.0) == 0.0
    assert walked == 0, walked


def test_a_long_prefill_is_not_charged_as_a_stall_once_it_ends() -> None:
    """vLLM counts a prompt's tokens when its prefill completes, the step that emits its
    first token, but the agent reports the stall's end only at its next scrape. Meanwhile
    the request that explained the stall has left the queue: the stall is capped by the
    time since the progress the gateway saw (found in review). A wedge after that progress
    is still charged."""
    scrape_s, grace_s = 1.0, 2.0
    coeffs = Coefficients(overhead_ms=0.0, prefill_ms_per_token=1.0)  # 5,000 tokens: 5 s
    tracker = ProgressTracker()
    idle = EngineSnapshot(0, 0, 0.0, prompt_tokens=100.0, generation_tokens=10.0)
    busy = EngineSnapshot(1, 0, 0.1, prompt_tokens=100.0, generation_tokens=10.0)
    assert tracker.observe(idle, 0.0) == 0.0
    # the request arrives at t=0.5 and prefills (as predicted) until t=5.5; the counters
    # stand still till then
    stalled_s = 0.0
    for k in range(1, 6):  # scrapes at t = 1..5
        stalled_s = tracker.observe(busy, k * scrape_s)
    metrics_ts = 1_000_000
    load = EngineLoad(1, 0, 0.1, metrics_ts, metrics_ts - int(stalled_s * 1000))
    rec = LoadRecord("r", 1, 0, 0.1, metrics_ts, stalled_since_ms=load.stalled_since_ms)
    assert rec.stalled_ms == 4000  # the last report before the prefill ends
    shared = {"r": SharedLoad(running=1, stalled_ms=float(rec.stalled_ms))}
    inf = InFlight()
    lt = LoadTracker(inf, lambda: shared)
    t = inf.dispatch("r", 5000, expected=5.5)  # a stream
    assert lt.views(["r"], {}, 5.2, grace_s, coeffs)["r"].overdue_ms == 0.0  # explained
    inf.first_token(t)  # t=5.5: the first chunk, as Gateway.on_first_token records it
    inf.progressed("r", 5.5)
    # t=5.6: the agent's next scrape (t=6) has not come yet; the report still says 4 s
    assert lt.views(["r"], {}, 5.6, grace_s, coeffs)["r"].overdue_ms == 0.0
    # the engine wedges after that first chunk: a report of a 4.5 s stall at t=10 is
    # charged past the grace
    shared["r"] = SharedLoad(running=1, stalled_ms=4500.0)
    assert lt.views(["r"], {}, 10.0, grace_s, coeffs)["r"].overdue_ms == pytest.approx(2500.0)
    # with no progress ever seen (another gateway's traffic), the report alone counts
    assert lt.views(["q"], {}, 10.0, grace_s, coeffs) == {
        "q": LoadTracker(inf).views(["q"], {}, 10.0, grace_s, coeffs)["q"]
    }
    shared["q"] = SharedLoad(running=1, stalled_ms=4500.0)
    assert lt.views(["q"], {}, 10.0, grace_s, coeffs)["q"].overdue_ms == 2500.0
    inf.done(t)


async def test_the_refresher_logs_a_stall_once_when_it_passes_the_grace_and_once_at_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import time

    from cachecore.loadstate import EngineLoad, MemoryLoadStore
    from gateway.load import SharedLoadRefresher

    store = MemoryLoadStore()
    grace: list[float | None] = [2000.0]
    ref = SharedLoadRefresher(store, "gw", InFlight(), lambda: ["r"], grace_ms=lambda: grace[0])

    async def publish(stalled_ms: int) -> None:
        now = int(time.time() * 1000)
        since = now - stalled_ms if stalled_ms else 0
        await store.publish_engine("r", EngineLoad(1, 0, 0.0, now, since), 5000, now)
        await ref.refresh_once()

    def said(words: str) -> int:
        return sum(words in r.getMessage() for r in caplog.records)

    caplog.set_level("INFO", logger="gateway.load")
    for ms in (0, 1000, 2500, 3500, 4500):  # scrapes: within the grace, then past it
        await publish(ms)
    assert ref.snapshot()["r"].stalled_ms == 4500
    assert said("busy without progress") == 1 and ref.stalled == {"r"}
    await publish(0)
    await publish(0)
    assert said("no longer charged") == 1 and ref.stalled == set()
    await publish(3000)
    grace[0] = None  # the policy turned the charge off: no longer stalled past a grace
    await publish(4000)
    assert said("busy without progress") == 2 and said("no longer charged") == 2


async def test_the_refresher_does_not_report_a_stall_its_own_long_prefill_explains(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM counts a prompt only when its prefill completes: an 8k-token prefill reads as a
    2 s stall. The log follows the charge (InFlight.unexplained_stall_ms): no warning while
    this gateway's waiting request explains the stall, one once it no longer does."""
    import time

    from cachecore.loadstate import EngineLoad, MemoryLoadStore
    from cachecore.scoring import Coefficients
    from gateway.load import SharedLoadRefresher

    store = MemoryLoadStore()
    inflight = InFlight()
    coeffs = Coefficients(overhead_ms=30.0, prefill_ms_per_token=0.25)
    ref = SharedLoadRefresher(
        store, "gw", inflight, lambda: ["r"], grace_ms=lambda: 2000.0, coeffs=lambda: coeffs
    )

    async def publish(stalled_ms: int) -> None:
        now = int(time.time() * 1000)
        await store.publish_engine("r", EngineLoad(1, 0, 0.0, now, now - stalled_ms), 5000, now)
        await ref.refresh_once()

    def said(words: str) -> int:
        return sum(words in r.getMessage() for r in caplog.records)

    caplog.set_level("INFO", logger="gateway.load")
    long = inflight.dispatch("r", 8000.0)  # explains 30 + 0.25 x 8000 = 2,030 ms past the grace
    await publish(3500)
    await publish(4000)
    assert said("busy without progress") == 0 and ref.stalled == set()
    inflight.done(long)
    short = inflight.dispatch("r", 100.0)  # explains 55 ms: the rest is charged
    await publish(4000)
    assert said("busy without progress") == 1 and ref.stalled == {"r"}
    rec = next(r for r in caplog.records if "busy without progress" in r.getMessage())
    assert rec.__dict__["charged_ms"] == pytest.approx(4000 - 2000 - 55, abs=1.0)
    inflight.done(short)


# ---------------------------------------------------------------- discovery


async def test_discovery_adds_allowlisted_replicas_only_and_drops_expired() -> None:
    import httpx

    from cachecore.registry import MemoryRegistry, Registration, ReplicaAllowlist
    from gateway.discovery import Discovery
    from gateway.replicas import ReplicaPool, ReplicaSpec
    from policies.schema import HealthPolicy

    def reg(rid: str, url: str) -> Registration:
        return Registration(
            replica_id=rid, url=url, model="m", block_size=16, capacity_blocks=100,
            agent_id=f"agent-{rid}", registered_ms=0,
        )  # fmt: skip

    registry = MemoryRegistry()
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        pool.add(ReplicaSpec("static-1", "http://10.0.0.1:8000"))
        allow = ReplicaAllowlist(["http://10.0.0.2:8000", "pinned=http://10.0.0.3:8000"])
        counted: dict[str, int] = {}
        disc = Discovery(
            registry, allow, pool, {"static-1"},
            on_count=lambda outcome, n: counted.update({outcome: counted.get(outcome, 0) + n}),
        )  # fmt: skip
        await registry.register(reg("gpu-2", "http://10.0.0.2:8000"), 1000, now_ms=0)
        await registry.register(reg("rogue", "http://evil.example:80"), 1000, now_ms=0)
        await registry.register(reg("thief", "http://10.0.0.3:8000"), 1000, now_ms=0)
        await disc.refresh_once(now_ms=10)
        assert sorted(pool.ids()) == ["gpu-2", "static-1"]
        assert disc.rejected == 2  # not allowlisted; pinned to another id
        assert counted == {"rejected": 2}  # kvgate_discovery_events_total{outcome}
        await disc.refresh_once(now_ms=5000)  # every registration expired: within the grace
        assert sorted(pool.ids()) == ["gpu-2", "static-1"]
        await disc.refresh_once(now_ms=5010)  # gone since the read at 10, 5 s ago
        assert pool.ids() == ["static-1"]  # static replicas stay


async def test_a_persisting_rejected_registration_is_logged_once_and_counted_each_refresh(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import httpx

    from cachecore.registry import MemoryRegistry, Registration, ReplicaAllowlist
    from gateway.discovery import Discovery
    from gateway.replicas import ReplicaPool
    from policies.schema import HealthPolicy

    def reg(rid: str, url: str) -> Registration:
        return Registration(
            replica_id=rid, url=url, model="m", block_size=16, capacity_blocks=100,
            agent_id=f"agent-{rid}", registered_ms=0,
        )  # fmt: skip

    def logged() -> list[tuple[str, str, str]]:
        return [
            (r.__dict__["replica"], r.__dict__["url"], r.__dict__["reason"])
            for r in caplog.records
            if r.getMessage().startswith("replica registration rejected")
        ]

    registry = MemoryRegistry()
    counted: dict[str, int] = {}
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy())
        allow = ReplicaAllowlist(["pinned=http://10.0.0.3:8000"])
        disc = Discovery(
            registry, allow, pool, set(),
            on_count=lambda outcome, n: counted.update({outcome: counted.get(outcome, 0) + n}),
        )  # fmt: skip
        caplog.set_level("WARNING", logger="gateway.discovery")
        await registry.register(reg("rogue", "http://evil.example:80"), 60_000, now_ms=0)
        for t in range(3):  # the agent's heartbeat keeps it registered
            await disc.refresh_once(now_ms=10 + t)
        assert logged() == [("rogue", "http://evil.example:80", "not_allowlisted")]
        assert counted == {"rejected": 3} and disc.rejected == 3
        # a new reason (the same id now claims a pinned URL) is news: logged once more
        await registry.register(reg("rogue", "http://10.0.0.3:8000"), 60_000, now_ms=20)
        await disc.refresh_once(now_ms=30)
        await disc.refresh_once(now_ms=31)
        assert logged()[1:] == [("rogue", "http://10.0.0.3:8000", "pinned_to_other_id")]
        assert counted == {"rejected": 5}


# ---------------------------------------------------------------- SSE relay


def test_sse_filter_reads_usage_and_drops_the_chunk_nobody_asked_for() -> None:
    from gateway.proxy import Usage, filter_events

    usage_chunk = (
        b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":32}}}'
    )
    stream = (
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + usage_chunk + b"\n\ndata: [DONE]\n\n"
    )
    u = Usage()
    out, done = filter_events(stream, u, keep_usage=False)
    assert done and b"usage" not in out and b'"content":"a"' in out and out.endswith(b"[DONE]\n\n")
    assert (u.prompt, u.cached, u.completion) == (40, 32, 2)
    kept, _ = filter_events(stream.replace(b"\n\n", b"\r\n\r\n"), Usage(), keep_usage=True)
    assert b'"cached_tokens":32' in kept
    nospace, done = filter_events(b"data:[DONE]\n\n", Usage(), keep_usage=False)
    assert done and nospace == b"data:[DONE]\n\n"


# ---------------------------------------------------------------- tokenization


def test_segment_cache_is_exact() -> None:
    import random

    from cachecore.tokenizer import builtin_tokenizer
    from gateway.tokenization import LocalPromptTokenizer

    tok = builtin_tokenizer()
    lp = LocalPromptTokenizer(tok)
    assert lp.segments.enabled
    rng = random.Random(5)
    vocab = tok.word_vocabulary
    pieces = ["héllo wörld ✓", "\n\n", "  spaced  ", "<|im_end|>", "<|endoftext|>x", "数字 123"]
    system = vocab.text(300, rng)
    for i in range(40):
        user = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 6))) + vocab.text(20, rng)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        assert lp.chat_sync({"messages": msgs}) == tok.encode_chat(msgs), i
        assert lp.completion_sync({"prompt": system + user}) == tok.encode(system + user)
    assert lp.segments.hits >= 38  # the shared system prompt was tokenized twice (admission)


def test_segment_cache_keeps_shared_segments_under_unique_traffic() -> None:
    import random

    from cachecore.tokenizer import SegmentCache, builtin_tokenizer

    tok = builtin_tokenizer()
    cache = SegmentCache(tok, max_entries=8)
    rng = random.Random(1)
    shared = tok.word_vocabulary.text(200, rng)
    for _ in range(2):
        cache.encode(shared)  # seen twice: admitted
    for i in range(100):  # one-off segments: never admitted, never evict the shared one
        cache.encode(tok.word_vocabulary.text(120, random.Random(i)))
    hits = cache.hits
    assert cache.encode(shared) == tok.encode(shared)
    assert cache.hits == hits + 1


def test_segment_cache_first_sightings_take_fixed_memory() -> None:
    """The admission filter is allocated whole: unique traffic does not grow it, and a
    segment seen a second time is admitted."""
    import random

    from cachecore.tokenizer import SegmentCache, builtin_tokenizer

    tok = builtin_tokenizer()
    cache = SegmentCache(tok, max_entries=64)
    slots = cache._seen_once.buffer_info()[1]
    assert slots == 4 * 64
    for i in range(2000):  # ten times the table's size in one-off segments
        cache.encode(tok.word_vocabulary.text(120, random.Random(i)))
    assert cache._seen_once.buffer_info()[1] == slots
    assert len(cache._cache) == 0  # none of them was admitted
    doc = tok.word_vocabulary.text(150, random.Random(-1))
    cache.encode(doc)
    cache.encode(doc)  # the second sighting admits it
    assert len(cache._cache) == 1 and cache.encode(doc) == tok.encode(doc)


def test_segment_cache_is_bounded_in_tokens_and_evicts_least_recently_used() -> None:
    import random

    from cachecore.tokenizer import SegmentCache, builtin_tokenizer

    tok = builtin_tokenizer()
    cache = SegmentCache(tok, max_entries=100, max_tokens=1000)
    rng = random.Random(3)
    texts = [tok.word_vocabulary.text(300, rng) for _ in range(6)]  # 300 tokens each
    sizes = [len(tok.encode(t)) for t in texts]

    def held() -> list[int]:
        return [i for i, t in enumerate(texts) if ("s", t) in cache._cache]

    for i, t in enumerate(texts):
        for _ in range(2):  # seen twice: admitted
            assert cache.encode(t, "s") == tok.encode(t)
        assert cache.cached_tokens <= 1000
        assert cache.cached_tokens == sum(len(v) for v in cache._cache.values())
        if i == 2:
            assert held() == [0, 1, 2]  # 3 x 300 fit
            cache.encode(texts[0], "s")  # 0 is now the most recently used
        if i == 3:
            assert held() == [0, 2, 3]  # 1 was the least recently used
    assert held() == [3, 4, 5]
    big = tok.word_vocabulary.text(1200, rng)  # larger than the whole budget
    before = dict(cache._cache)
    for _ in range(2):
        assert cache.encode(big, "s") == tok.encode(big)
    assert dict(cache._cache) == before  # not cached, nothing evicted for it
    # a count bound still holds when it is the tighter one
    small = SegmentCache(tok, max_entries=2, max_tokens=10**6)
    for t in texts:
        for _ in range(2):
            small.encode(t, "s")
    assert len(small._cache) == 2 and small.cached_tokens == sizes[4] + sizes[5]


async def test_gateway_settings_bound_the_tokenizer_cache() -> None:
    s = GatewaySettings(tokenizer_cache_tokens=12345, salt_secrets=["s" * 32])  # type: ignore[list-item]
    gw = Gateway(s, parse_policy_text(""))
    await gw.start()
    try:
        assert gw.tokenizers is not None
        assert gw.tokenizers.local(gw.policy.models.default).segments.max_tokens == 12345
    finally:
        await gw.stop()
    with pytest.raises(ValueError):
        GatewaySettings(tokenizer_cache_tokens=0)


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.replicas import parse_replica_spec

    monkeypatch.setenv("KVGATE_SALT_SECRETS", "first-secret-0123456789, second-secret-0123456789")
    monkeypatch.setenv("KVGATE_REPLICAS", "http://a:1,gpu=http://b:2")
    monkeypatch.setenv("KVGATE_PORT", "9123")
    monkeypatch.setenv("KVGATE_ADMIN_KEY", "zq-admin-7731")
    s = GatewaySettings()
    assert [x.get_secret_value() for x in s.salt_secrets] == [
        "first-secret-0123456789",
        "second-secret-0123456789",
    ]
    assert s.replicas == ["http://a:1", "gpu=http://b:2"] and s.port == 9123
    assert s.admin_key is not None and "zq-admin-7731" not in repr(s)  # secrets never print
    gw = Gateway(s, parse_policy_text(""))
    assert gw.minter.n_secrets == 2
    # a spec with embedded agents holds a comma of its own (URL=EVENTS,REPLAY)
    monkeypatch.setenv(
        "KVGATE_REPLICAS",
        "r0=http://a:1=tcp://a:5557,tcp://a:5558, http://b:2, r2=http://c:3=ipc:///e,ipc:///r",
    )
    s = GatewaySettings()
    assert s.replicas == [
        "r0=http://a:1=tcp://a:5557,tcp://a:5558",
        "http://b:2",
        "r2=http://c:3=ipc:///e,ipc:///r",
    ]
    specs = [parse_replica_spec(x) for x in s.replicas]
    assert [sp.events for sp in specs] == ["tcp://a:5557", None, "ipc:///e"]


async def test_passive_ejection_and_return() -> None:
    import httpx

    from gateway.replicas import ReplicaPool, ReplicaSpec
    from policies.schema import HealthPolicy

    now = [100.0]
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(
            client, HealthPolicy(eject_after_failures=3, eject_s=5), clock=lambda: now[0]
        )
        pool.add(ReplicaSpec("a", "http://10.0.0.1:1"))
        pool.add(ReplicaSpec("b", "http://10.0.0.2:1"))
        for _ in range(2):
            pool.record_failure("a")
        pool.record_success("a")  # consecutive only
        for _ in range(2):
            pool.record_failure("a")
        assert [r.id for r in pool.candidates("m")] == ["a", "b"]
        pool.record_failure("a")
        assert [r.id for r in pool.candidates("m")] == ["b"]
        now[0] += 5.1
        assert [r.id for r in pool.candidates("m")] == ["a", "b"]
        pool.record_failure("b", definitive=True)  # a refused connection: out at once
        assert [r.id for r in pool.candidates("m")] == ["a"]
        pool.cordon("a")
        assert pool.candidates("m") == []


async def test_a_refused_upstream_connection_is_a_definitive_failure() -> None:
    """The proxy's transport reports a refused connection as a ConnectError (the OSError
    as its cause): it must count as definitive for outlier ejection, a read timeout not."""
    t = LeanTransport()
    timeouts = {"connect": 1.0, "read": 1.0, "write": 1.0, "pool": 1.0}
    try:
        with pytest.raises(httpx.TransportError) as info:
            await t.post(f"http://127.0.0.1:{free_port()}", "/v1/completions", [], b"{}", timeouts)
    finally:
        await t.aclose()
    assert _refused(info.value)
    assert not _refused(httpx.ReadTimeout("slow engine"))


# ---------------------------------------------------------------- engine tokenization


async def test_engine_tokenizer_sends_the_scope_salt_and_the_rendering_fields() -> None:
    """What the gateway asks the engine: render gets the whole chat request (tools and
    template kwargs render as they will), /tokenize vLLM's chat fields; both carry the
    scope's salt in place of the client's."""
    seen: list[tuple[str, dict[str, object]]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, orjson.loads(request.content)))
        return httpx.Response(200, json={"tokens": [1, 2, 3], "prompt_token_ids": [1, 2, 3]})

    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "chat_template_kwargs": {"x": 1},
        "continue_final_message": False,
        "cache_salt": "the client's",
        "max_tokens": 3,
        "stream": True,
    }
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        for mode in ("render", "tokenize"):
            tok = EnginePromptTokenizer(mode, client, lambda tried: "http://engine")
            assert await tok.chat(chat, "scope-salt") == [1, 2, 3]
        tok = EnginePromptTokenizer("tokenize", client, lambda tried: "http://engine")
        await tok.completion({"model": "m", "prompt": "hello", "cache_salt": "x"}, "s2")
        assert await tok.completion({"model": "m", "prompt": [7, 8]}, "s2") == [7, 8]
    (p1, render), (p2, tokenize), (p3, prompt) = seen  # a token-id prompt asks nothing
    assert p1 == "/v1/chat/completions/render" and p2 == p3 == "/tokenize"
    assert render == {**chat, "cache_salt": "scope-salt"}
    assert tokenize == {
        "model": "m",
        "messages": chat["messages"],
        "tools": tools,
        "chat_template_kwargs": {"x": 1},
        "continue_final_message": False,
        "cache_salt": "scope-salt",
    }
    assert prompt == {"model": "m", "prompt": "hello", "cache_salt": "s2"}


async def test_engine_tokenize_takes_a_reasoning_effort_as_its_template_variables() -> None:
    """vLLM's /tokenize has no reasoning_effort: the gateway sends it as the chat
    completion passes it to the template (with enable_thinking), so a template reading it
    is tokenized as the engine will render it (review of D31)."""
    seen: list[dict[str, object]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(orjson.loads(request.content))
        return httpx.Response(200, json={"tokens": [1]})

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.MockTransport(engine)) as client:
        tok = EnginePromptTokenizer("tokenize", client, lambda tried: "http://engine")
        await tok.chat({**chat, "reasoning_effort": "low", "chat_template_kwargs": {"x": 1}}, "s")
        with pytest.raises(GatewayError) as exc:
            await tok.chat({**chat, "reasoning_effort": "extreme"}, "s")
    assert exc.value.param == "reasoning_effort"
    assert seen == [
        {**chat, "cache_salt": "s",
         "chat_template_kwargs": {"x": 1, "reasoning_effort": "low", "enable_thinking": True}}
    ]  # fmt: skip


# ---------------------------------------------------------------- shared load refresh


@pytest.mark.parametrize("stage", ["add_inflight", "heartbeat", "snapshot"])
async def test_shared_refresh_failure_never_writes_a_delta_twice(stage: str) -> None:
    import time
    from typing import Any

    from cachecore.loadstate import MemoryLoadStore
    from gateway.load import SharedLoadRefresher

    class FlakyStore(MemoryLoadStore):
        """Fails once at ``stage``; for add_inflight, on the second replica's write (the
        first one has reached the store by then)."""

        fail_at: str | None = None

        async def add_inflight(self, gid: str, rid: str, dr: int, dt: int, now: int) -> None:
            if self.fail_at == "add_inflight" and rid == "r2":
                self.fail_at = None
                raise ConnectionError("redis timeout")
            await super().add_inflight(gid, rid, dr, dt, now)

        async def heartbeat(self, gid: str, reps: Any, now: int, counts: Any = None) -> None:
            if self.fail_at == "heartbeat":
                self.fail_at = None
                raise ConnectionError("redis timeout")
            await super().heartbeat(gid, reps, now, counts)

        async def snapshot(self, reps: Any, now: int) -> Any:
            if self.fail_at == "snapshot":
                self.fail_at = None
                raise ConnectionError("redis timeout")
            return await super().snapshot(reps, now)

    store = FlakyStore()
    mine, theirs = InFlight(), InFlight()
    reps = ["r1", "r2"]
    gw_a = SharedLoadRefresher(store, "gw-a", mine, lambda: reps)
    gw_b = SharedLoadRefresher(store, "gw-b", theirs, lambda: reps)

    async def store_counts() -> dict[str, tuple[int, int]]:
        snap = await store.snapshot(reps, int(time.time() * 1000))
        return {r: (s.inflight_requests, s.inflight_prefill_tokens) for r, s in snap.items()}

    t1, t2 = mine.dispatch("r1", 100), mine.dispatch("r2", 50)
    store.fail_at = stage
    await gw_a.refresh_once()
    assert gw_a.errors == 1 and store.fail_at is None
    await gw_a.refresh_once()
    assert await store_counts() == {"r1": (1, 100), "r2": (1, 50)}
    await gw_b.refresh_once()
    assert {r: s.other_requests for r, s in gw_b.snapshot().items()} == {"r1": 1, "r2": 1}
    mine.done(t1)
    mine.done(t2)
    await gw_a.refresh_once()
    assert await store_counts() == {"r1": (0, 0), "r2": (0, 0)}
    await gw_b.refresh_once()
    assert {r: s.other_requests for r, s in gw_b.snapshot().items()} == {"r1": 0, "r2": 0}
    assert mine.pending_deltas == {}


# ---------------------------------------------------------------- health and ejection


class _Health:
    """``GET /health`` answers for a ReplicaPool under test: 200 while ``ok``."""

    def __init__(self) -> None:
        self.ok = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200 if self.ok else 503, json={})


async def test_refused_connect_needs_eject_s_and_fresh_healthy_after_ok_checks() -> None:
    from gateway.replicas import ReplicaPool, ReplicaSpec
    from policies.schema import HealthPolicy

    now = [100.0]
    health = _Health()
    policy = HealthPolicy(healthy_after=3, unhealthy_after=1, eject_s=30)
    async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
        pool = ReplicaPool(client, policy, clock=lambda: now[0])
        rep = pool.add(ReplicaSpec("a", "http://10.0.0.1:1"))
        for _ in range(5):  # a long OK streak before the crash must not count afterwards
            await pool.check_once()
        pool.record_failure("a", definitive=True)
        assert pool.candidates("m") == []
        await pool.check_once()  # one OK check: not enough
        assert not rep.healthy and pool.candidates("m") == []
        await pool.check_once()
        pool.record_failure("a")  # a late failure restarts the OK streak
        for _ in range(2):
            await pool.check_once()
        assert not rep.healthy
        await pool.check_once()  # the third OK check since the last failure
        assert rep.healthy and pool.candidates("m") == []  # eject_s has not passed
        now[0] += 30.1
        assert [r.id for r in pool.candidates("m")] == ["a"]
        # a replica that recovers only after eject_s still needs its healthy_after OK checks
        pool.record_failure("a", definitive=True)
        now[0] += 31
        health.ok = False
        await pool.check_once()
        health.ok = True
        for _ in range(2):
            await pool.check_once()
        assert pool.candidates("m") == []
        await pool.check_once()
        assert [r.id for r in pool.candidates("m")] == ["a"]


async def test_on_change_follows_routability_both_ways_including_expiry() -> None:
    import asyncio

    from gateway.replicas import ReplicaPool, ReplicaSpec
    from policies.schema import HealthPolicy

    seen: list[tuple[str, bool]] = []
    back = asyncio.Event()

    def changed(replica: str, routable: bool) -> None:
        seen.append((replica, routable))
        if routable:
            back.set()

    health = _Health()
    policy = HealthPolicy(eject_after_failures=1, eject_s=0.05, healthy_after=1)
    async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
        pool = ReplicaPool(client, policy, on_change=changed)
        pool.add(ReplicaSpec("a", "http://10.0.0.1:1"))
        pool.record_failure("a")  # a passive ejection ends by itself, with no health round
        assert seen == [("a", False)]
        await asyncio.wait_for(back.wait(), 2)
        assert seen == [("a", False), ("a", True)] and pool.candidates("m")
        pool.record_failure("a", definitive=True)  # back on the OK check after eject_s
        await pool.check_once()
        assert seen[2:] == [("a", False)]
        await asyncio.sleep(0.1)
        assert seen[2:] == [("a", False), ("a", True)]
        pool.drain("a")
        pool.cordon("a", on=False)
        assert seen[4:] == [("a", False), ("a", True)]

    # with a clock the loop does not follow, a health round reports the expiry
    now = [100.0]
    seen.clear()
    async with httpx.AsyncClient(transport=httpx.MockTransport(health)) as client:
        pool = ReplicaPool(
            client,
            HealthPolicy(eject_after_failures=1, eject_s=5),
            on_change=lambda r, ok: seen.append((r, ok)),
            clock=lambda: now[0],
        )
        pool.add(ReplicaSpec("a", "http://10.0.0.1:1"))
        pool.record_failure("a")
        await pool.check_once()
        assert seen == [("a", False)]
        now[0] += 5.1
        await pool.check_once()
        assert seen == [("a", False), ("a", True)]


def test_a_replica_whose_models_are_unknown_does_not_decide_what_a_name_means() -> None:
    """A just-discovered replica (models not read yet) serves everything until probed: it
    must not turn an adapter name into a base model, nor be the only replica left."""
    pool = ReplicaPool(httpx.AsyncClient(), HealthPolicy())
    r0 = pool.add(ReplicaSpec("r0", "http://a:1"))
    r0.models, r0.lora_base = {"base", "lora-a"}, {"lora-a": "base"}
    pool.add(ReplicaSpec("r1", "http://b:1"))  # models None
    reps = pool.candidates("lora-a")
    assert pool.base_model("lora-a", reps) == ("base", "lora-a")
    assert [r.id for r in pool.same_meaning("lora-a", "lora-a", "base", reps)] == ["r0", "r1"]


async def test_the_embedded_index_keeps_the_agents_removal_log_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVGATE_AGENT_REMOVAL_LOG sizes the index's removal log; with embedded agents the
    index is the gateway's own, which kept the default whatever the variable said."""
    from cachecore.index.memory import MemoryIndex
    from gateway.replicas import parse_replica_spec

    monkeypatch.setenv("KVGATE_AGENT_REMOVAL_LOG", "0")
    spec = "r0=http://127.0.0.1:9=tcp://127.0.0.1:9,tcp://127.0.0.1:10"
    for replicas, expected in (([spec], 0), (["http://127.0.0.1:9"], None)):
        s = GatewaySettings(replicas=replicas, open_access=True, salt_secrets=[SecretStr("s" * 32)])
        specs = [parse_replica_spec(r) for r in s.replicas]
        gw = Gateway(s, parse_policy_text(""), replica_specs=specs)  # no agent hook
        await gw.start()
        try:
            assert gw.index is not None and isinstance(gw.index.primary, MemoryIndex)
            if expected is None:  # no embedded agent: the index's own default
                assert gw.index.primary.removal_log == MemoryIndex().removal_log
            else:
                assert gw.index.primary.removal_log == expected
        finally:
            await gw.stop()


async def test_token_id_prompt_comes_packed_and_keys_alike() -> None:
    from cachecore.tokenizer import builtin_tokenizer

    ids = [5, 0, 2**32 - 1, 7] * 40
    prompt, packed = completion_prompt_packed({"prompt": ids})
    assert prompt is ids and packed is not None and list(packed) == ids
    keyer = BlockKeyer(16)
    for cap in (None, 3):
        assert keyer.keys(packed, "s", "m", None, cap) == keyer.keys(ids, "s", "m", None, cap)
    assert completion_prompt_packed({"prompt": "hi"}) == ("hi", None)
    assert completion_prompt({"prompt": [ids[:3], [1]]}) == ids[:3]  # a batch: the first
    with pytest.raises(GatewayError):
        completion_prompt({"prompt": [1, -1, 2, 3]})  # not token ids
    lp = LocalPromptTokenizer(builtin_tokenizer())
    tokens, keyed = await lp.completion_packed({"prompt": ids})
    assert tokens is ids and list(keyed) == ids
    tokens, keyed = await lp.completion_packed({"prompt": "hello world"})
    assert tokens == await lp.completion({"prompt": "hello world"}) and keyed is tokens


async def test_an_unhealthy_replica_is_logged_with_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review: "replica unhealthy" said nothing of why: a refused connection, a 404 (a URL
    that is not the engine's root) and a TLS verification failure read alike."""
    import logging

    from cachecore.testing import free_port
    from gateway.replicas import ReplicaPool, ReplicaSpec
    from policies.schema import HealthPolicy

    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})

    policy = HealthPolicy(unhealthy_after=1)
    caplog.set_level(logging.WARNING, logger="gateway.replicas")
    async with httpx.AsyncClient(transport=httpx.MockTransport(not_found)) as client:
        pool = ReplicaPool(client, policy)
        pool.add(ReplicaSpec("a", "http://10.0.0.1:1"))
        await pool.check_once()
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(client, policy)
        pool.add(ReplicaSpec("b", f"http://127.0.0.1:{free_port()}"))  # nothing listens
        await pool.check_once()
    reasons = {
        r.__dict__["replica"]: r.__dict__.get("reason", "")
        for r in caplog.records
        if r.getMessage() == "replica unhealthy"
    }
    assert reasons["a"] == "GET http://10.0.0.1:1/health: HTTP 404", reasons
    assert reasons["b"].startswith("GET http://127.0.0.1:") and "ConnectError" in reasons["b"]


def test_index_lookup_and_fallback_series_exist_from_the_start() -> None:
    """The local-index histogram and the fallback counters appeared only at the first index
    timeout: 16+ series at once, late in a soak (its growth check failed on them) and
    missing from a dashboard's rate() until then."""
    from prometheus_client import generate_latest

    from gateway.metrics import GatewayMetrics

    text = generate_latest(GatewayMetrics().registry).decode()
    for series in (
        'kvgate_index_lookup_seconds_count{source="primary"} 0.0',
        'kvgate_index_lookup_seconds_count{source="local"} 0.0',
        'kvgate_index_fallbacks_total{reason="timeout"} 0.0',
        'kvgate_index_fallbacks_total{reason="error"} 0.0',
    ):
        assert series in text, series
