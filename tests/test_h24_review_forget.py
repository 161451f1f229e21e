"""``kvgate index forget`` leaves alone a replica that gateways route to, meta or none.

A replica with no agent (static, gateway-only) has no meta: its only keys are the gateways'
pending zset (``gw:p:<epoch>``) and in-flight record (``gw:inflight``). Idleness used to be
read from the meta alone, so ``forget --departed --idle-for 24h`` took such a replica while
live gateways wrote for it seconds ago. On a real redis-server, keys written by a real
RedisIndex and RedisLoadStore, the command run through its module's ``run``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cachecore.index.base import ReplicaState
from cachecore.index.redis import RedisIndex
from cachecore.loadstate import RedisLoadStore
from cachecore.testing import PATIENT_TIMEOUT_S
from tests.test_h24_index_cli import HOUR_MS, KEYS, L, cli, kvgate_in_thread, now_ms, replica_keys

pytestmark = pytest.mark.redis


@pytest.fixture
async def static(redis_url: str) -> AsyncIterator[tuple[RedisIndex, RedisLoadStore, str]]:
    """``static-a``: no agent, routed to just now (a pending entry, a gateway's in-flight
    record); ``gone``: an agent's replica left two hours ago, its gateways' entries too."""
    index = RedisIndex.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    load = RedisLoadStore(index.client, L, clock="caller")  # writes of the past: old now_ms
    now = now_ms()
    await index.add_pending("static-a", KEYS[:2], 60_000, now)
    await load.add_inflight("gw1", "static-a", 3, 300, now)
    old = now - 2 * HOUR_MS
    e = await index.clear_replica("gone", ReplicaState.LIVE, old)
    await index.add_pending("gone", KEYS[:1], 60_000, old)
    await load.add_inflight("gw1", "gone", 1, 100, old)
    assert e == 1
    yield index, load, redis_url
    await index.close()


async def test_departed_leaves_a_routed_replica_without_meta(
    static: tuple[RedisIndex, RedisLoadStore, str], capsys: pytest.CaptureFixture[str]
) -> None:
    index, _, url = static
    before = await replica_keys(index.client, "static-a")
    assert len(before) == 2  # gw:p:0, gw:inflight; no meta
    argv = cli(url, "forget", "--departed", "--idle-for", "24h", "--dry-run")[1:]
    code, out, err = await kvgate_in_thread(argv, capsys)
    assert (code, out, err) == (0, "no departed replica (unregistered, idle for 1d)\n", "")
    argv = cli(url, "forget", "--departed", "--idle-for", "1h")[1:]
    code, out, err = await kvgate_in_thread(argv, capsys)
    assert code == 0, err
    assert out.splitlines() == ["forgot gone: 3 keys (epoch 1, 0 stored entries, 1 pending)"]
    assert await replica_keys(index.client, "static-a") == before
    # named: refused with the reason; --force takes it all the same
    code, out, err = await kvgate_in_thread(cli(url, "forget", "static-a")[1:], capsys)
    assert code == 2 and out == ""
    assert "not forgetting static-a: gateways are routing to it" in err
    code, out, err = await kvgate_in_thread(cli(url, "forget", "static-a", "--force")[1:], capsys)
    assert code == 0, err
    assert await replica_keys(index.client, "static-a") == set()


async def test_the_forget_script_judges_the_gateways_entries(
    static: tuple[RedisIndex, RedisLoadStore, str],
) -> None:
    """The atomic re-check sees each sign alone: a live pending entry, a live gateway's
    in-flight liveness, and one that expired under ``idle_ms`` ago."""
    index, load, _ = static
    keys = (await index.keys_by_replica())["static-a"]
    now = now_ms()
    got = await index.forget_replica("static-a", keys, now_ms=now, idle_ms=HOUR_MS)
    assert got.refused == "active" and got.active_ms is not None and got.active_ms > now
    await index.client.delete(L.pending("static-a", 0))  # the in-flight record alone
    got = await index.forget_replica("static-a", keys, now_ms=now_ms(), idle_ms=HOUR_MS)
    assert got.refused == "active"
    # a check unlinks nothing, whatever it answers
    got = await index.forget_replica("static-a", keys, now_ms=now_ms(), idle_ms=0, check=True)
    assert got.refused == "" and got.unlinked == 0
    assert await replica_keys(index.client, "static-a") == {L.inflight("static-a").encode()}
    # its gateways stopped 30 minutes ago: idle for 10 minutes, not for an hour
    await index.client.delete(L.inflight("static-a"))
    await load.add_inflight("gw2", "static-a", 1, 10, now_ms() - 30 * 60_000)
    got = await index.forget_replica("static-a", keys, now_ms=now_ms(), idle_ms=HOUR_MS)
    assert got.refused == "active" and got.active_ms is not None
    assert now_ms() - got.active_ms > 29 * 60_000
    got = await index.forget_replica("static-a", keys, now_ms=now_ms(), idle_ms=600_000)
    assert got.refused == "" and got.unlinked == 1
    assert await replica_keys(index.client, "static-a") == set()
