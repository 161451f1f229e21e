"""Guards for semantic mutations that no other test caught: auth, limits, the upstream
transport, routing and quarantine. Each test names the bug it guards against."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from cachecore.scoring import Coefficients, LoadView
from gateway import auth, routing
from gateway.auth import KeyStore, check_admin, hash_key, parse_key_file
from gateway.limits import TenantLimiter, TokenBucket
from gateway.quarantine import ClaimCheck, QuarantineTracker
from gateway.routing import Candidate, MissTieBreak, Router, RouteRequest, RoutingParams, Strategy
from gateway.upstream import LeanTransport
from policies.schema import QuarantinePolicy, TenantLimits
from tests.test_upstream import TIMEOUTS, echo_forever, read_request, server

# ------------------------------------------------------------------------------ auth

HASH = "kvg:apikeys"


class Clock:
    """A settable stand-in for ``time.monotonic`` in :mod:`gateway.auth` only."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def redis_keys(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[KeyStore, aioredis.Redis, Clock]]:
    clock = Clock()
    monkeypatch.setattr(auth, "time", SimpleNamespace(monotonic=clock))
    client = aioredis.Redis.from_url(redis_url)
    try:
        yield KeyStore(redis=client, redis_hash=HASH, cache_ttl_s=2.0), client, clock
    finally:
        await client.aclose()


async def test_redis_key_cache_expires(
    redis_keys: tuple[KeyStore, aioredis.Redis, Clock],
) -> None:
    """A1: a cached Redis lookup that never expires keeps a revoked key working forever
    (and an added key unknown forever)."""
    store, client, clock = redis_keys
    await client.hset(HASH, hash_key("sk-a"), "alice")
    assert await store.tenant_for("Bearer sk-a") == "alice"
    await client.hdel(HASH, hash_key("sk-a"))
    clock.now += 1.0  # within the TTL: the cache answers
    assert await store.tenant_for("Bearer sk-a") == "alice"
    clock.now += 1.5  # past the TTL
    assert await store.tenant_for("Bearer sk-a") is None
    # an unknown key added later resolves once the cached miss expires
    assert await store.tenant_for("Bearer sk-b") is None
    await client.hset(HASH, hash_key("sk-b"), "bob")
    clock.now += 2.5
    assert await store.tenant_for("Bearer sk-b") == "bob"


async def test_redis_tenant_value_is_validated(
    redis_keys: tuple[KeyStore, aioredis.Redis, Clock],
) -> None:
    """A2: a malformed tenant name stored in Redis accepted as a tenant."""
    store, client, _ = redis_keys
    await client.hset(HASH, hash_key("sk-bad"), "bad tenant!")
    await client.hset(HASH, hash_key("sk-ok"), "good.tenant-1")
    assert await store.tenant_for("Bearer sk-bad") is None
    assert await store.tenant_for("Bearer sk-ok") == "good.tenant-1"


async def test_only_bearer_tokens_resolve() -> None:
    """A3: another auth scheme ("Basic <key>") accepted as a bearer token."""
    store = KeyStore(keys={hash_key("sk-a"): "alice"})
    assert await store.tenant_for("Basic sk-a") is None
    assert await store.tenant_for("sk-a") is None
    assert await store.tenant_for("Bearer sk-a") == "alice"
    assert await store.tenant_for("bearer  sk-a ") == "alice"


async def test_upper_case_digest_in_key_file_resolves() -> None:
    """A6: an upper-case digest in the key file kept as is, so its key never matches."""
    keys = parse_key_file({"keys": [{"sha256": hash_key("sk-a").upper(), "tenant": "alice"}]})
    store = KeyStore(keys=keys)
    assert await store.tenant_for("Bearer sk-a") == "alice"


def test_admin_key_must_match_exactly() -> None:
    """A7: an admin key compared by prefix admits a longer or shorter key."""
    key = "admin-secret-key"
    assert check_admin(key, key)
    assert check_admin(f"Bearer {key}", key)
    for wrong in (key + "x", key[:-1], f"Bearer {key}x", f"Bearer {key[:-1]}", ""):
        assert not check_admin(wrong, key), wrong
    assert not check_admin(key, None)


# ------------------------------------------------------------------------------ limits


def test_token_bucket_refill_is_capped_at_burst() -> None:
    """LM4: refill without the burst cap lets a long-idle tenant send far past its burst."""
    bucket = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    assert bucket.take(20.0, 100.0) == 0.0
    wait = bucket.take(1.0, 100.0)
    assert wait > 0
    assert wait == pytest.approx(0.1)


def test_configure_clamps_the_level_to_a_lower_burst() -> None:
    """LM5: lowering the burst keeps the old, larger level, so the new limit is not applied."""
    bucket = TokenBucket(rate=10.0, burst=20.0, now=0.0)
    bucket.configure(10.0, 5.0)
    assert bucket.level <= 5.0
    assert bucket.take(5.0, 0.0) == 0.0
    assert bucket.take(1.0, 0.0) > 0


def test_release_does_not_go_below_zero() -> None:
    """LM7: an extra release drives in_flight negative and lifts the concurrency limit."""
    lim = TenantLimiter()
    limits = TenantLimits(max_concurrency=1)
    assert lim.admit("t", limits, 0.0) is None
    lim.release("t")
    lim.release("t")
    assert lim.in_flight("t") == 0
    assert lim.admit("t", limits, 1.0) is None
    rej = lim.admit("t", limits, 1.0)
    assert rej is not None and rej.limit == "concurrency"


# ------------------------------------------------------------------------------ upstream


async def test_abandoned_stream_does_not_return_to_the_pool() -> None:
    """U1: a stream closed before its end put back in the keep-alive pool; the next request
    on that connection would read the rest of the old answer."""
    chunks = [b"data: %03d\n\n" % i for i in range(50)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(4):  # bounded: a few requests per connection
            req = await read_request(reader)
            body = req.split(b"\r\n\r\n", 1)[1]
            if body != b"long":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n" % (len(chunks[0]), chunks[0]))
            await writer.drain()
            await asyncio.sleep(0.05)  # the client reads one chunk and hangs up meanwhile
            for c in chunks[1:]:
                writer.write(b"%x\r\n%s\r\n" % (len(c), c))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    t = LeanTransport()
    try:
        async with server(handler) as (url, conns):
            resp = await t.post(url, "/v1/completions", [], b"long", TIMEOUTS)
            it = resp.aiter_raw()
            first = await asyncio.wait_for(anext(it), 2.0)
            assert first == chunks[0]
            await resp.aclose()
            key = t._hosts[url]
            assert not t._idle.get(key)
            await asyncio.sleep(0.1)  # the server has sent the rest of the stream by now
            for i in range(2):
                body = b'{"n": %d}' % i
                resp = await t.post(url, "/v1/completions", [], body, TIMEOUTS)
                assert resp.status_code == 200
                assert await asyncio.wait_for(resp.aread(), 2.0) == body
                await resp.aclose()
            assert len(conns) == 2
    finally:
        await t.aclose()


async def test_idle_connections_per_host_are_capped() -> None:
    """U5: the idle-per-host cap not enforced keeps every connection of a burst open."""
    t = LeanTransport(max_idle_per_host=1)
    try:
        async with server(echo_forever) as (url, conns):
            resps = await asyncio.wait_for(
                asyncio.gather(*(t.post(url, "/x", [], b"%d" % i, TIMEOUTS) for i in range(3))),
                2.0,
            )
            assert len(conns) == 3
            for i, resp in enumerate(resps):
                assert await resp.aread() == b"%d" % i
                await resp.aclose()
            assert len(t._idle[t._hosts[url]]) == 1
            assert t._active[t._hosts[url]] == 0
    finally:
        await t.aclose()


# ------------------------------------------------------------------------------ routing

C = Coefficients()


def test_scope_trees_are_bounded() -> None:
    """RT9: the per-scope miss trees never forgotten: one entry per scope forever."""
    r = Router(RoutingParams(), random.Random(1))
    cands = [Candidate("a", LoadView()), Candidate("b", LoadView())]
    for i in range(routing.MAX_SCOPE_TREES + 10):
        req = RouteRequest(prompt_tokens=64, block_size=16, scope_key=f"tenant:{i}")
        r.decide(req, cands, C)
        if i % 1000 == 999:  # tenant:0 stays in use: least recently used is someone else
            r.decide(RouteRequest(64, 16, scope_key="tenant:0"), cands, C)
    assert len(r._scope_trees) <= routing.MAX_SCOPE_TREES
    assert "tenant:0" in r._scope_trees and "tenant:1" not in r._scope_trees
    assert f"tenant:{routing.MAX_SCOPE_TREES + 9}" in r._scope_trees


@pytest.mark.parametrize(
    ("strategy", "tie_break"),
    [
        (Strategy.EXPECTED_LATENCY, MissTieBreak.ROUND),
        (Strategy.EXPECTED_LATENCY, MissTieBreak.SCOPE_TREE),
        (Strategy.PREFIX_AFFINITY, MissTieBreak.SCOPE_TREE),
        (Strategy.ROUND_ROBIN, MissTieBreak.SCOPE_TREE),
        (Strategy.RANDOM, MissTieBreak.SCOPE_TREE),
    ],
)
def test_explain_in_between_changes_no_decision(
    strategy: Strategy, tie_break: MissTieBreak
) -> None:
    """RT11: a preview (route/explain) that leaks tie rounds, trees or RNG draws into the
    router steers the real decisions after it."""
    cands = [Candidate(f"r{i}", LoadView()) for i in range(4)]
    params = RoutingParams(miss_tie_break=tie_break)
    plain, explained = Router(params, random.Random(9)), Router(params, random.Random(9))
    make: Callable[[int], RouteRequest] = lambda i: RouteRequest(  # noqa: E731
        prompt_tokens=32 * (1 + i % 3), block_size=16, scope_key="tenant:x"
    )
    for i in range(40):
        for j in range(2):
            with explained.preview():
                explained.decide(make(i + j + 1), cands, C, strategy)
        got = explained.decide(make(i), cands, C, strategy)
        want = plain.decide(make(i), cands, C, strategy)
        assert (got.replica, got.reason) == (want.replica, want.reason), i


# ------------------------------------------------------------------------------ quarantine


def check(claimed: int, actual: int, replica: str = "r") -> ClaimCheck:
    return ClaimCheck(replica, claimed, actual, still_claimed_blocks=claimed)


LIE, TRUTH = check(4, 0), check(4, 4)


def test_quarantine_window_holds_the_last_m_checks() -> None:
    """Q6: a window longer than m counts a bad check that has aged out (k=2, m=3:
    lie, truth, truth, lie holds one lie in its last three)."""
    q = QuarantineTracker(QuarantinePolicy(k=2, m=3))
    for c in (LIE, TRUTH, TRUTH, LIE):
        assert q.observe(c) is None
    assert not q.is_quarantined("r")
    assert q.observe(LIE) is True  # lie, truth... last three: truth, lie, lie
    assert q.is_quarantined("r")


def test_missing_exactly_the_fraction_is_bad() -> None:
    """Q1: a check missing exactly missing_fraction of its claim not counted as bad."""
    q = QuarantineTracker(QuarantinePolicy(k=1, m=1, missing_fraction=0.5))
    assert q.observe(check(4, 3)) is None  # a quarter missing: fine
    assert not q.is_quarantined("r")
    assert q.observe(check(4, 2)) is True
    assert q.is_quarantined("r")


def test_a_claim_of_exactly_min_claimed_blocks_is_checked() -> None:
    """Q7: a claim of exactly min_claimed_blocks skipped (only larger ones checked)."""
    q = QuarantineTracker(QuarantinePolicy(k=1, m=1, min_claimed_blocks=2))
    assert q.observe(check(1, 0)) is None  # under the minimum: not checked
    assert not q.is_quarantined("r")
    assert q.observe(check(2, 0)) is True
    assert q.is_quarantined("r")
