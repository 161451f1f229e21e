"""Shared load state: both stores answer identically; crashed gateways do not leak
in-flight load; several gateway processes see one picture; one round trip per snapshot."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import IndexError_
from cachecore.loadstate import (
    PRUNE_AFTER_MS,
    EngineLoad,
    LoadRecord,
    LoadStore,
    LoadStoreError,
    MemoryLoadStore,
    RedisLoadStore,
    new_gateway_id,
    validate_gateway_id,
)
from cachecore.testing import PATIENT_TIMEOUT_S, free_port

TTL = 1000


def caller_clock(url: str) -> RedisLoadStore:
    """Simulated time: the callers' now_ms is the clock, as in the memory store (the
    production clock, Redis's, is tested in test_h25_load_clock)."""
    return RedisLoadStore.from_url(
        url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        gateway_ttl_ms=TTL,
        clock="caller",
    )


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[LoadStore]:
    s: LoadStore
    if request.param == "memory":
        s = MemoryLoadStore(gateway_ttl_ms=TTL)
    else:
        s = caller_clock(request.getfixturevalue("redis_url"))
    yield s
    await s.close()


async def test_engine_load_and_freshness(store: LoadStore) -> None:
    await store.publish_engine("a", EngineLoad(3, 7, 0.625, metrics_ts_ms=900), 500, 1000)
    snap = await store.snapshot(["a", "b"], 1200)
    a = snap["a"]
    assert (a.num_running, a.num_waiting, a.kv_usage, a.metrics_ts_ms) == (3, 7, 0.625, 900)
    assert a.fresh(1200, 300) and not a.fresh(1200, 299) and a.age_ms(1200) == 300
    assert snap["b"] == LoadRecord("b")
    assert not snap["b"].has_engine and snap["b"].age_ms(1) is None
    # the engine report expires by the store's clock (agent down)
    gone = (await store.snapshot(["a"], 1500))["a"]
    assert not gone.has_engine and gone.num_waiting == 0


async def test_engine_stall_round_trips(store: LoadStore) -> None:
    """How long the engine has been busy without progress (D17) travels as its start, on
    the agent's clock; 0 is not stalled; an expired report says nothing."""
    await store.publish_engine("a", EngineLoad(2, 3, 0.5, 900, stalled_since_ms=400), 500, 1000)
    a = (await store.snapshot(["a"], 1100))["a"]
    assert (a.stalled_since_ms, a.stalled_ms, a.num_waiting) == (400, 500, 3)
    await store.publish_engine("a", EngineLoad(2, 3, 0.5, 1900), 500, 2000)
    a = (await store.snapshot(["a"], 2100))["a"]
    assert (a.stalled_since_ms, a.stalled_ms) == (0, 0)
    await store.publish_engine("a", EngineLoad(2, 3, 0.5, 2900, stalled_since_ms=2000), 500, 3000)
    gone = (await store.snapshot(["a"], 3600))["a"]
    assert (gone.stalled_since_ms, gone.stalled_ms, gone.has_engine) == (0, 0, False)
    assert LoadRecord("x", stalled_since_ms=5).stalled_ms == 0  # no engine report


async def test_a_record_from_an_older_agent_reads_as_not_stalled(redis_url: str) -> None:
    """Records are hashes of named fields: one written without the stall fields (an agent
    older than D17) parses, not stalled; stall fields a newer agent left behind count only
    with the scrape that wrote them, so an older agent taking the key over (a rollback)
    cannot leave a stall that grows for ever."""
    red = caller_clock(redis_url)
    admin = aioredis.Redis.from_url(redis_url)
    key = "kvg:{r:a}:load"

    async def old_agent_publishes(ts: int) -> None:  # the pre-D17 publish script's fields
        await admin.hset(
            key,
            mapping={
                "running": 1,
                "waiting": 2,
                "kv_usage": "0.25",
                "metrics_ts_ms": ts,
                "expires_ms": ts + 5000,
            },
        )

    try:
        await old_agent_publishes(1000)
        a = (await red.snapshot(["a"], 1100))["a"]
        assert (a.num_running, a.num_waiting, a.kv_usage, a.metrics_ts_ms) == (1, 2, 0.25, 1000)
        assert (a.stalled_since_ms, a.stalled_ms) == (0, 0)
        await red.publish_engine(
            "a", EngineLoad(1, 2, 0.25, 2000, stalled_since_ms=1500), 5000, 2000
        )
        assert (await red.snapshot(["a"], 2100))["a"].stalled_ms == 500
        await old_agent_publishes(9000)
        a = (await red.snapshot(["a"], 9100))["a"]
        assert await admin.hexists(key, "stalled_since_ms")  # left behind, and ignored
        assert (a.metrics_ts_ms, a.stalled_since_ms, a.stalled_ms) == (9000, 0, 0)
    finally:
        await red.close()
        await admin.aclose()


async def test_inflight_is_summed_across_gateways(store: LoadStore) -> None:
    await store.add_inflight("gw1", "a", 1, 4000, 0)
    await store.add_inflight("gw1", "a", 1, 1000, 0)
    await store.add_inflight("gw2", "a", 1, 500, 10)
    await store.add_inflight("gw2", "b", 2, 0, 10)
    snap = await store.snapshot(["a", "b"], 20)
    assert (snap["a"].inflight_requests, snap["a"].inflight_prefill_tokens) == (3, 5500)
    assert snap["a"].gateways == 2 and snap["b"].inflight_requests == 2
    # first token: prefill done; completion: request done
    await store.add_inflight("gw1", "a", 0, -4000, 30)
    await store.add_inflight("gw1", "a", -1, 0, 40)
    snap = await store.snapshot(["a"], 50)
    assert (snap["a"].inflight_requests, snap["a"].inflight_prefill_tokens) == (2, 1500)


async def test_crashed_gateway_counts_expire_and_are_pruned(store: LoadStore) -> None:
    await store.add_inflight("alive", "a", 2, 100, 0)
    await store.add_inflight("crashed", "a", 5, 9000, 0)
    for t in (400, 800, 1200, 1600):  # only "alive" heartbeats
        await store.heartbeat("alive", ["a"], t)
    snap = (await store.snapshot(["a"], 1700))["a"]
    assert (snap.inflight_requests, snap.inflight_prefill_tokens, snap.gateways) == (2, 100, 1)
    # a completion reported after the prune is a no-op; later dispatches count in full
    late = TTL + PRUNE_AFTER_MS + 10
    await store.heartbeat("alive", ["a"], late)
    await store.add_inflight("crashed", "a", -5, -9000, late + 10)
    await store.add_inflight("crashed", "a", 1, 10, late + 20)
    snap = (await store.snapshot(["a"], late + 30))["a"]
    assert (snap.inflight_requests, snap.inflight_prefill_tokens) == (3, 110)


async def test_lapsed_gateway_fields_are_pruned(redis_url: str) -> None:
    mem = MemoryLoadStore(gateway_ttl_ms=TTL)
    red = caller_clock(redis_url)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        for s in (mem, red):
            await s.add_inflight("crashed", "a", 5, 9000, 0)
            await s.heartbeat("alive", ["a"], TTL + PRUNE_AFTER_MS - 1)  # not yet
        assert "crashed" in mem._replicas["a"].gateways
        assert await admin.hexists("kvg:{r:a}:gw:inflight", "crashed:r")
        for s in (mem, red):
            await s.heartbeat("alive", ["a"], TTL + PRUNE_AFTER_MS + 1)
        assert set(mem._replicas["a"].gateways) == {"alive"}
        fields = await admin.hkeys("kvg:{r:a}:gw:inflight")
        assert sorted(fields) == [b"alive:x"]
        assert await admin.pttl("kvg:{r:a}:gw:inflight") > 0  # garbage-collected if idle
    finally:
        await red.close()
        await admin.aclose()


async def test_clean_shutdown_drops_counts(store: LoadStore) -> None:
    await store.add_inflight("gw1", "a", 3, 30, 0)
    await store.add_inflight("gw1", "b", 1, 10, 0)
    await store.drop_gateway("gw1", ["a", "b"])
    snap = await store.snapshot(["a", "b"], 1)
    assert snap["a"].inflight_requests == snap["b"].inflight_requests == 0


async def test_bad_input(store: LoadStore) -> None:
    with pytest.raises(ValueError):
        await store.add_inflight("bad:gw", "a", 1, 1, 0)
    with pytest.raises(ValueError):
        await store.snapshot(["bad replica"], 0)
    with pytest.raises(ValueError):
        EngineLoad(-1, 0, 0.0, 0)
    with pytest.raises(ValueError):
        EngineLoad(0, 0, 1.5, 0)
    with pytest.raises(ValueError):
        EngineLoad(0, 0, 0.0, 100, stalled_since_ms=101)  # a stall after its own scrape
    with pytest.raises(ValueError):
        EngineLoad(0, 0, 0.0, 100, stalled_since_ms=-1)
    assert await store.snapshot([], 0) == {}


def test_gateway_ids() -> None:
    a, b = new_gateway_id(), new_gateway_id()
    assert a != b and validate_gateway_id(a) == a


async def test_two_gateway_processes_share_one_picture(redis_url: str) -> None:
    g1 = caller_clock(redis_url)
    g2 = caller_clock(redis_url)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        replicas = [f"r{i}" for i in range(16)]
        for i, r in enumerate(replicas):
            await g1.publish_engine(r, EngineLoad(i, i * 2, i / 16, 5), 10_000, 5)
            await g1.add_inflight("gw-1", r, 1, 100 * i, 5)
            await g2.add_inflight("gw-2", r, 2, 10, 5)
        await g2.snapshot(replicas, 6)  # loads the script
        before = (await admin.info("commandstats"))["cmdstat_evalsha_ro"]["calls"]
        trips = g2.round_trips
        s1, s2 = await g1.snapshot(replicas, 6), await g2.snapshot(replicas, 6)
        assert s1 == s2
        assert g2.round_trips - trips == 1
        after = (await admin.info("commandstats"))["cmdstat_evalsha_ro"]["calls"]
        assert after - before == 2  # one per snapshot, whatever the number of replicas
        assert [s1[r].inflight_requests for r in replicas] == [3] * 16
        assert s1["r5"].inflight_prefill_tokens == 510 and s1["r5"].num_waiting == 10
    finally:
        await g1.close()
        await g2.close()
        await admin.aclose()


async def test_redis_unreachable_raises() -> None:
    s = RedisLoadStore.from_url(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(LoadStoreError):
            await s.snapshot(["a"], 0)
        with pytest.raises(IndexError_):
            await s.add_inflight("g", "a", 1, 1, 0)
        with pytest.raises(LoadStoreError):
            await s.heartbeat("g", ["a"], 0)
    finally:
        await s.close()


async def test_counts_a_store_lost_come_back_with_the_next_heartbeat(
    store: LoadStore, request: pytest.FixtureRequest
) -> None:
    """A store that lost a gateway's fields (a Redis restart, a prune) while its requests
    were in flight: the later deltas are clamped at zero, so under steady load (one request
    done, one dispatched) the other gateways read 1 for as long as it was never idle. The
    heartbeat writes the gateway's own counts as they are: back within one heartbeat."""
    from gateway.load import InFlight, SharedLoadRefresher

    mine, theirs = InFlight(), InFlight()
    a = SharedLoadRefresher(store, "gw-a", mine, lambda: ["r1"])
    b = SharedLoadRefresher(store, "gw-b", theirs, lambda: ["r1"])
    tickets = [mine.dispatch("r1", 100) for _ in range(10)]
    await a.refresh_once()
    await b.refresh_once()
    assert b.snapshot()["r1"].other_requests == 10
    if isinstance(store, MemoryLoadStore):  # the data is lost
        store._replicas.clear()
    else:
        client = aioredis.from_url(request.getfixturevalue("redis_url"))
        await client.flushall()
        await client.aclose()
    for i in range(30):  # steady load: the count never reaches zero
        mine.done(tickets[i % 10])
        tickets[i % 10] = mine.dispatch("r1", 100)
        a._last_hb = 0.0 if i == 29 else a._last_hb  # the last round is a heartbeat's
        await a.refresh_once()
    await b.refresh_once()
    shared = b.snapshot()["r1"]
    assert (shared.other_requests, shared.other_queued_tokens) == (10, 1000.0)


async def test_a_gateway_restarted_under_its_id_clears_what_it_left(store: LoadStore) -> None:
    """An operator-set --gateway-id: the new process's heartbeat kept the dead one's counts
    alive on replicas it had not sent to yet; it writes zero there now."""
    from gateway.load import InFlight, SharedLoadRefresher

    await store.add_inflight("gw-a", "r1", 5, 500, 0)  # what the previous process left
    fresh = SharedLoadRefresher(store, "gw-a", InFlight(), lambda: ["r1"])
    await fresh.refresh_once()  # its first refresh heartbeats
    rec = (await store.snapshot(["r1"], 1))["r1"]
    assert (rec.inflight_requests, rec.inflight_prefill_tokens) == (0, 0)
