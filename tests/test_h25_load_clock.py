"""The shared load store judges expiry and age on one clock (Redis's), not on each host's.

An agent stamped its load record's expiry ``now_ms + ttl_ms`` with its wall clock and a
gateway on another host judged it with its own: an agent 10 s behind the gateway published
records that read as expired at once (the replica's load unknown, routing fell back), one
10 s ahead left a dead agent's record alive 10 s past its TTL, and the report's age read
-10 s. Gateways' in-flight liveness had the same fault between gateway hosts. These tests
simulate the skew by offsetting a writer's ``now_ms`` against real time; the Redis clock
runs in real time, so each waits at most 0.6 s, and only waits past an expiry (never on a
race with one: TTLs that must hold are 5 s or more)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from cachecore.loadstate import EngineLoad, MemoryLoadStore, RedisLoadStore
from cachecore.testing import PATIENT_TIMEOUT_S, RedisClusterServers
from tests.test_index_cluster import pick_per_shard

pytestmark = pytest.mark.timeout(30)

SKEW_MS = 10_000
SLACK_MS = 3_000  # round trips and scheduling on a busy host: far below the skew


def wall_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[tuple[RedisLoadStore, RedisLoadStore]]:
    """An agent's and a gateway's stores on one Redis (production defaults)."""
    agent = RedisLoadStore.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    gateway = RedisLoadStore.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    yield agent, gateway
    await agent.close()
    await gateway.close()


@pytest.mark.parametrize("skew", [-SKEW_MS, SKEW_MS])
async def test_a_fresh_report_reads_fresh_whatever_the_agents_clock(
    stores: tuple[RedisLoadStore, RedisLoadStore], skew: int
) -> None:
    agent, gateway = stores
    at = wall_ms() + skew  # the agent's clock
    load = EngineLoad(2, 5, 0.5, metrics_ts_ms=at - 400, stalled_since_ms=at - 1400)
    await agent.publish_engine(f"skew{skew}", load, 5_000, at)
    now = wall_ms()
    rec = (await gateway.snapshot([f"skew{skew}"], now))[f"skew{skew}"]
    assert rec.has_engine and rec.num_waiting == 5  # agent 10 s behind: read as expired
    age = rec.age_ms(now)
    assert age is not None and 400 <= age < 400 + SLACK_MS  # agent ahead: age -9.6 s
    assert rec.fresh(now, 400 + SLACK_MS)
    assert rec.stalled_ms == 1000  # a difference on the agent's clock: no skew
    assert abs(rec.clock_skew_ms - skew) < SLACK_MS  # the offset, for an operator to see


async def test_a_dead_agent_ahead_of_the_gateway_is_not_kept_alive(
    stores: tuple[RedisLoadStore, RedisLoadStore],
) -> None:
    agent, gateway = stores
    at = wall_ms() + SKEW_MS
    await agent.publish_engine("ahead", EngineLoad(1, 1, 0.1, metrics_ts_ms=at), 300, at)
    await asyncio.sleep(0.6)  # past the 300 ms TTL on any clock; the agent is gone
    rec = (await gateway.snapshot(["ahead"], wall_ms()))["ahead"]
    assert not rec.has_engine and rec.num_waiting == 0  # lived on for its 10 s of skew


@pytest.mark.parametrize("skew", [-SKEW_MS, SKEW_MS])
async def test_a_gateways_liveness_is_judged_on_one_clock(redis_url: str, skew: int) -> None:
    """Gateway A's counts as gateway B reads them: alive while A heartbeats (A 10 s behind
    B: ignored at once, its liveness 5 s), gone once A stops (A ahead: counted 10 s on)."""
    a = RedisLoadStore.from_url(
        redis_url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        gateway_ttl_ms=5_000,
    )
    short = RedisLoadStore.from_url(
        redis_url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        gateway_ttl_ms=300,
    )
    b = RedisLoadStore.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    rid = f"gwskew{skew}"
    try:
        await a.add_inflight("gw-a", rid, 3, 300, wall_ms() + skew)
        rec = (await b.snapshot([rid], wall_ms()))[rid]
        assert (rec.inflight_requests, rec.gateways) == (3, 1)
        await short.heartbeat("gw-a", [rid], wall_ms() + skew)  # its last, then it crashes
        await asyncio.sleep(0.6)
        rec = (await b.snapshot([rid], wall_ms()))[rid]
        assert (rec.inflight_requests, rec.gateways) == (0, 0)
    finally:
        for s in (a, short, b):
            await s.close()


async def test_the_callers_clock_mode_answers_as_the_memory_store(redis_url: str) -> None:
    """``clock="caller"``: the callers' ``now_ms`` is the clock, as in the memory store (one
    process, one clock), so simulated time stays deterministic; no skew is measured."""
    red = RedisLoadStore.from_url(
        redis_url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        clock="caller",
    )
    mem = MemoryLoadStore()
    try:
        for s in (red, mem):
            await s.publish_engine("c", EngineLoad(1, 2, 0.25, 900, 400), 500, 1000)
        for t in (1100, 1499, 1500):
            assert (await red.snapshot(["c"], t)) == (await mem.snapshot(["c"], t)), t
        rec = (await red.snapshot(["c"], 1100))["c"]
        assert (rec.metrics_ts_ms, rec.stalled_ms, rec.clock_skew_ms) == (900, 500, 0)
        with pytest.raises(ValueError):
            RedisLoadStore(red.client, clock="agent")  # type: ignore[arg-type]
    finally:
        await red.close()


async def test_an_older_agents_record_is_read_without_a_stale_offset(
    stores: tuple[RedisLoadStore, RedisLoadStore], redis_url: str
) -> None:
    """A record without the clock fields (an agent older than this) reads as before: its
    stamps taken as the reader's clock, no skew measured. An older agent taking over a key
    a newer one left its offset in (a rollback) rewrites metrics_ts_ms but not the offset,
    which then no longer applies (``clock_at_ms`` is another scrape's)."""
    agent, gateway = stores
    admin = aioredis.Redis.from_url(redis_url)
    key = "kvg:{r:old}:load"

    async def old_agent_publishes(ts: int) -> None:  # the previous publish script's fields
        await admin.hset(
            key,
            mapping={"running": 1, "waiting": 2, "kv_usage": "0.25", "metrics_ts_ms": ts,
                     "expires_ms": ts + 5000, "stalled_since_ms": 0, "stalled_at_ms": ts},
        )  # fmt: skip

    try:
        at = wall_ms() + SKEW_MS
        await agent.publish_engine("old", EngineLoad(1, 2, 0.25, metrics_ts_ms=at), 5_000, at)
        assert await admin.hexists(key, "clock_offset_ms")
        ts = wall_ms() - 100
        await old_agent_publishes(ts)  # the rollback
        now = wall_ms()
        rec = (await gateway.snapshot(["old"], now))["old"]
        assert rec.has_engine and rec.metrics_ts_ms == ts and rec.clock_skew_ms == 0
        age = rec.age_ms(now)
        assert age is not None and 100 <= age < 100 + SLACK_MS
    finally:
        await admin.aclose()


async def test_on_a_cluster_each_shard_judges_on_its_own_clock(
    cluster_url: str, redis_cluster: RedisClusterServers
) -> None:
    """A snapshot runs once per shard (ids after the clock mode in ARGV there): every
    shard's records of an agent 10 s behind read fresh."""
    per_shard = pick_per_shard(redis_cluster, [f"eng{i}" for i in range(64)], 1)
    rids = [ids[0] for ids in per_shard.values()]
    agent = RedisLoadStore(RedisCluster.from_url(cluster_url))
    gateway = RedisLoadStore(RedisCluster.from_url(cluster_url))
    try:
        at = wall_ms() - SKEW_MS
        for rid in rids:
            await agent.publish_engine(rid, EngineLoad(1, 3, 0.5, metrics_ts_ms=at), 5_000, at)
        now = wall_ms()
        snap = await gateway.snapshot(rids, now)
        assert gateway.round_trips == len(rids)  # one call per shard
        for rid in rids:
            age = snap[rid].age_ms(now)
            assert snap[rid].num_waiting == 3 and age is not None and 0 <= age < SLACK_MS, rid
            assert abs(snap[rid].clock_skew_ms + SKEW_MS) < SLACK_MS, rid
    finally:
        await agent.close()
        await gateway.close()


async def test_the_gateway_logs_an_agent_clock_off_from_its_own_once(
    stores: tuple[RedisLoadStore, RedisLoadStore], caplog: pytest.LogCaptureFixture
) -> None:
    """The skew the store measures is what an operator needs for the checks that still
    compare an agent's stamps with the gateway's clock (D22's removal log): logged once
    when it passes CLOCK_SKEW_WARN_MS, once when it is back."""
    from gateway.load import InFlight, SharedLoadRefresher

    agent, gateway = stores
    refresher = SharedLoadRefresher(gateway, "gw-skew", InFlight(), lambda: ["clk"])

    async def publish_and_refresh(skew: int) -> None:
        at = wall_ms() + skew
        await agent.publish_engine("clk", EngineLoad(0, 0, 0.0, metrics_ts_ms=at), 5_000, at)
        await refresher.refresh_once()

    caplog.set_level("INFO", logger="gateway.load")
    for skew in (SKEW_MS, SKEW_MS, 0, 0):
        await publish_and_refresh(skew)
    said = [(r.levelname, r.getMessage()[:18]) for r in caplog.records]
    assert said == [
        ("WARNING", "agent clock differ"),
        ("INFO", "agent clock agrees"),
    ], said
    assert refresher.skewed == set()


async def test_an_offset_that_is_no_clocks_is_ignored(
    stores: tuple[RedisLoadStore, RedisLoadStore], redis_url: str
) -> None:
    """The record is its agent's to write: an offset that is no number, or beyond a day
    (NaN, inf, 1e300 parse as numbers in Redis's Lua), reads as no offset; never an error
    that would fail the other replicas' records read in the same call."""
    agent, gateway = stores
    admin = aioredis.Redis.from_url(redis_url)
    try:
        for rid in ("good", "odd"):
            at = wall_ms()
            await agent.publish_engine(rid, EngineLoad(1, 4, 0.5, metrics_ts_ms=at), 5_000, at)
        for junk in ("nan", "inf", "-inf", "1e300", "x", str(2 * 86_400_000)):
            await admin.hset("kvg:{r:odd}:load", "clock_offset_ms", junk)
            now = wall_ms()
            snap = await gateway.snapshot(["good", "odd"], now)
            assert snap["good"].num_waiting == 4 and snap["odd"].num_waiting == 4, junk
            age = snap["odd"].age_ms(now)
            assert snap["odd"].clock_skew_ms == 0, junk
            assert age is not None and 0 <= age < SLACK_MS, junk
    finally:
        await admin.aclose()
