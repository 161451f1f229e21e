"""``kvgate index`` (gateway/index_cli.py) on a real redis-server: stats per replica, the
orphan sweep, and forgetting departed replicas (refused while registered or recently
updated; every key gone, at once; a returning agent rebuilds a fresh replica).

Keys are written by a real RedisIndex, RedisRegistry and RedisLoadStore, and in the agent
tests by a real agent (tests/test_agent_helpers.Rig) following a fake engine's events. The
command runs in-process (through ``gateway.cli.main``, or its module's ``run`` in a thread
where the test's own loop runs the agent) and as a subprocess (``.venv/bin/kvgate``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from cachecore.index.base import ReplicaState
from cachecore.index.layout import KeyLayout, acl_setuser_args, gateway_acl_rules
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.loadstate import EngineLoad, RedisLoadStore
from cachecore.registry import RedisRegistry, Registration
from cachecore.testing import PATIENT_TIMEOUT_S, RedisClusterServers
from gateway import index_cli
from gateway.cli import main
from tests.test_agent_helpers import BS, Rig, until

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[1]
KVGATE = ROOT / ".venv" / "bin" / "kvgate"
PREFIX = "kvgt"
L = KeyLayout(PREFIX)
G = int(Tier.GPU)
KEYS = BlockKeyer(4).keys(list(range(40)), "kvg1:t", "m")  # 10 chained keys
HOUR_MS = 3_600_000


def now_ms() -> int:
    return int(time.time() * 1000)


def kvgate(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kvgate ARGV`` in-process, through the real entry point; its SIGTERM handler is put
    back afterwards (main installs one for the commands it runs)."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = main(list(argv))
    finally:
        signal.signal(signal.SIGTERM, before)
    out = capsys.readouterr()
    return code, out.out, out.err


async def kvgate_in_thread(
    argv: Sequence[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """``kvgate index ARGV`` in-process while this test's loop runs an agent: the module's
    own parser and ``run`` (its asyncio.run) in a thread (main's signal handler needs the
    main thread)."""
    parser = argparse.ArgumentParser(prog="kvgate index")
    index_cli.configure(parser)
    args = parser.parse_args(list(argv))
    code = await asyncio.to_thread(index_cli.run, args)
    out = capsys.readouterr()
    return code, out.out, out.err


def reg(rid: str) -> Registration:
    return Registration(
        replica_id=rid,
        url=f"http://127.0.0.1:9/{rid}",
        model="m",
        block_size=4,
        capacity_blocks=100,
        agent_id=f"agent-{rid}",
        registered_ms=now_ms(),
    )


async def replica_keys(client: Any, rid: str) -> set[bytes]:
    return {k async for k in client.scan_iter(match=f"{L.tag(rid)}*", count=1000)}


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[tuple[RedisIndex, str]]:
    """Three replicas on a real Redis, written as agents and gateways write them:

    * ``live``: registered, updated now, 4 stored entries, 2 pending, a load record;
    * ``gone``: its agent left an hour ago (no registration), 3 stored entries, a removal
      log, an in-flight record and the pending zset of its old epoch;
    * ``ghost``: no meta at all, only an orphaned block hash of epoch 3 (a meta lost)."""
    index = RedisIndex.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    registry = RedisRegistry(index.client, L)
    load = RedisLoadStore(index.client, L, clock="caller")  # writes of the past: old now_ms
    now = now_ms()
    e = await index.clear_replica("live", ReplicaState.LIVE, now)
    await index.apply("live", e, IndexWrite(dict.fromkeys(KEYS[:4], G), {1: b"r" * 20}, seq=7), now)
    await index.add_pending("live", KEYS[4:6], 60_000, now)
    await registry.register(reg("live"), 60_000, now)
    await load.publish_engine("live", EngineLoad(1, 0, 0.5, now), 60_000, now)
    old = now - HOUR_MS
    await index.add_pending("gone", KEYS[:2], 60_000, old)  # epoch 0's: a clear leaves it
    e = await index.clear_replica("gone", ReplicaState.LIVE, old)
    await index.apply("gone", e, IndexWrite(dict.fromkeys(KEYS[:4], G), {2: b"r" * 20}), old)
    await index.apply("gone", e, IndexWrite({KEYS[3]: 0}), old)  # a removal: rm:<epoch>
    await load.add_inflight("gw1", "gone", 1, 100, old)
    await index.client.hset(L.blocks("ghost", 3), KEYS[0], G)
    yield index, redis_url
    await index.close()


def cli(url: str, *argv: str) -> list[str]:
    action, *rest = argv
    return ["index", action, "--redis", url, "--key-prefix", PREFIX, *rest]


# ---------------------------------------------------------------------------------- stats


def test_stats_json_names_each_replica_and_the_totals(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = fleet
    code, out, err = kvgate(cli(url, "stats", "--json"), capsys)
    assert code == 0, err
    doc = json.loads(out)
    rows = {r["replica"]: r for r in doc["replicas"]}
    assert list(rows) == ["ghost", "gone", "live"]
    live, gone, ghost = rows["live"], rows["gone"], rows["ghost"]
    assert (live["state"], live["epoch"], live["stored"], live["mirror"]) == ("live", 1, 4, 1)
    assert live["pending"] == 2 and live["registered"] == "yes"
    assert 0 <= live["updated_age_s"] < 60
    assert -60 < live["routed_age_s"] < -50  # its pending entries live a minute more
    # meta, b:1, m:1, gw:p:1, reg, load
    assert live["keys"] == 6
    assert (gone["state"], gone["stored"], gone["removals"], gone["registered"]) == (
        "live", 3, 1, "no"
    )  # fmt: skip
    assert 3500 < gone["updated_age_s"] < 3700
    assert gone["keys"] == 6  # meta, b:1, m:1, rm:1, gw:p:0, gw:inflight
    assert ghost["state"] is None and ghost["epoch"] is None and ghost["keys"] == 1
    assert ghost["updated_age_s"] is None and ghost["stored"] == 0
    assert ghost["routed_age_s"] is None
    assert 3500 < gone["routed_age_s"] < 3600  # its in-flight record lapsed 59m ago
    totals = doc["totals"]
    assert totals == {
        "replicas": 3, "registered": 1, "stored": 7, "mirror": 2, "pending": 2, "keys": 13,
    }  # fmt: skip
    assert doc["used_memory"] > 100_000


def test_stats_table_by_default(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = fleet
    code, out, _ = kvgate(cli(url, "stats"), capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "REPLICA", "STATE", "EPOCH", "STORED", "MIRROR", "PENDING", "REMOVALS", "KEYS",
        "UPDATED", "ROUTED", "REGISTERED",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[1:4]}
    assert rows["live"][1:8] == ["live", "1", "4", "1", "2", "0", "6"]
    assert rows["live"][-2:] == ["now", "yes"]  # its pending entries are live
    # its agent wrote an hour ago; its gateways' entries lapsed 59 minutes ago
    assert rows["gone"][-5:] == ["1h", "ago", "59m", "ago", "no"]
    assert rows["ghost"][1:4] == ["(no", "meta)", "-"] and rows["ghost"][-3:] == ["-", "-", "no"]
    assert lines[4].startswith("UPDATED -: no agent stamp")  # ghost has no meta
    assert lines[5].startswith("3 replicas (1 registered), 7 stored entries, 2 pending, 13 keys")
    assert "used_memory" in lines[5]


def test_stats_reads_the_gateways_redis_setting(
    redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --redis: KVGATE_REDIS_URL and KVGATE_KEY_PREFIX, as `kvgate serve` reads them."""
    client = redis.Redis.from_url(redis_url)
    client.hset(L.meta("r1"), mapping={"epoch": 2, "state": "cold", "updated_ms": now_ms()})
    client.close()
    monkeypatch.setenv("KVGATE_REDIS_URL", redis_url)
    monkeypatch.setenv("KVGATE_KEY_PREFIX", PREFIX)
    code, out, err = kvgate(["index", "stats", "--json"], capsys)
    assert code == 0, err
    (row,) = json.loads(out)["replicas"]
    assert (row["replica"], row["state"], row["epoch"]) == ("r1", "cold", 2)
    monkeypatch.setenv("KVGATE_KEY_PREFIX", "other")
    code, out, _ = kvgate(["index", "stats", "--json"], capsys)
    assert code == 0 and json.loads(out)["replicas"] == []


def test_redis_problems_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachecore.testing import free_port

    monkeypatch.delenv("KVGATE_REDIS_URL", raising=False)
    cases = {
        f"redis://127.0.0.1:{free_port()}/0": "Redis failed: time: ",  # nothing listens
        "redis://127.0.0.1:abc/0": "KVGATE_REDIS_URL",
        "redis://u:hunter2@127.0.0.1:1/db": "database must be a number",
        "": "KVGATE_REDIS_URL",
    }
    for url, says in cases.items():
        argv = ["index", "stats"] + (["--redis", url] if url else [])
        code, out, err = kvgate(argv, capsys)
        assert code == 2 and out == "", (url, out)
        assert err.count("\n") == 1 and err.startswith("kvgate index: ") and says in err, err
        assert "hunter2" not in err
    code, _, err = kvgate(["index", "forget", "--redis", "redis://127.0.0.1:1/0"], capsys)
    assert code == 2 and "REPLICA ids or --departed" in err
    with pytest.raises(SystemExit) as exc:
        kvgate(["index", "forget", "no{pe}"], capsys)
    assert exc.value.code == 2 and "invalid replica id" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- sweep


def test_sweep_prints_what_it_removed(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, url = fleet
    sync = redis.Redis.from_url(url)
    try:
        # an orphan: live's b:5, an epoch its meta does not point at
        sync.hset(L.blocks("live", 5), KEYS[0], G)
        code, out, err = kvgate(cli(url, "sweep"), capsys)
        assert code == 0, err
        # ghost's b:3 (no meta: epoch 0), gone's gw:p:0 and live's b:5
        removed = sorted(line.split()[1] for line in out.splitlines()[:-1])
        assert removed == sorted([L.blocks("ghost", 3), L.pending("gone", 0), L.blocks("live", 5)])
        assert out.splitlines()[-1].startswith("removed 3 orphaned keys of ")
        assert sync.exists(L.blocks("live", 1), L.blocks("gone", 1)) == 2  # current epochs
        code, out, _ = kvgate(cli(url, "sweep"), capsys)
        assert out.startswith("removed 0 orphaned keys")
        sync.hset(L.blocks("live", 6), KEYS[0], G)
        sync.hset(L.blocks("live", 7), KEYS[0], G)
        code, out, _ = kvgate(cli(url, "sweep", "--max-keys", "1"), capsys)
        assert code == 0 and "stopped at --max-keys 1 with keys left to examine" in out
    finally:
        sync.close()


# --------------------------------------------------------------------------------- forget


async def test_forget_refuses_registered_and_recent_replicas(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    index, url = fleet
    before = {r: await replica_keys(index.client, r) for r in ("live", "gone", "ghost")}
    code, out, err = await kvgate_in_thread(cli(url, "forget", "gone", "live")[1:], capsys)
    assert code == 2 and out == ""
    assert "not forgetting live: it is registered" in err and "nothing forgotten" in err
    # registration gone (its agent stopped) but updated a minute ago, under --idle-for
    await index.client.delete(L.registration("live"))
    code, _, err = await kvgate_in_thread(cli(url, "forget", "live")[1:], capsys)
    assert code == 2 and "its meta was updated " in err and "--idle-for 10m" in err
    code, _, err = await kvgate_in_thread(cli(url, "forget", "gone", "nosuch")[1:], capsys)
    assert code == 2 and "nosuch: holds no keys" in err
    code, _, err = await kvgate_in_thread(
        cli(url, "forget", "gone", "--idle-for", "2h")[1:], capsys
    )
    assert code == 2 and "updated 1h ago (under --idle-for 2h)" in err
    for rid, keys in before.items():  # nothing was touched
        assert await replica_keys(index.client, rid) == keys - {L.registration(rid).encode()}


async def test_forget_unlinks_every_key_of_the_replica_and_no_other(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    index, url = fleet
    live_keys = await replica_keys(index.client, "live")
    assert len(await replica_keys(index.client, "gone")) == 6
    code, out, err = await kvgate_in_thread(cli(url, "forget", "gone", "ghost")[1:], capsys)
    assert code == 0, err
    assert out.splitlines() == [
        "forgot gone: 6 keys (epoch 1, 3 stored entries, 0 pending)",
        "forgot ghost: 1 key (no meta, 0 stored entries, 0 pending)",
    ]
    assert await replica_keys(index.client, "gone") == set()
    assert await replica_keys(index.client, "ghost") == set()
    assert await replica_keys(index.client, "live") == live_keys
    # --force: registered and updated now, forgotten all the same
    code, out, _ = await kvgate_in_thread(cli(url, "forget", "live", "--force")[1:], capsys)
    assert code == 0 and out.startswith("forgot live: 6 keys")
    assert await index.client.dbsize() == 0


async def test_forget_departed_takes_the_unregistered_idle_ones(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    index, url = fleet
    argv = cli(url, "forget", "--departed", "--idle-for", "30m", "--dry-run")[1:]
    code, out, _ = await kvgate_in_thread(argv, capsys)
    assert code == 0
    assert out.splitlines() == [
        "would forget ghost: 1 key (no meta, 0 stored entries, 0 pending)",
        "would forget gone: 6 keys (epoch 1, 3 stored entries, 0 pending)",
    ]
    assert len(await replica_keys(index.client, "gone")) == 6  # a dry run
    code, out, _ = await kvgate_in_thread(
        cli(url, "forget", "--departed", "--idle-for", "2h")[1:], capsys
    )
    assert code == 0
    assert out.splitlines() == ["forgot ghost: 1 key (no meta, 0 stored entries, 0 pending)"]
    code, out, _ = await kvgate_in_thread(
        cli(url, "forget", "--departed", "--idle-for", "30m")[1:], capsys
    )
    assert code == 0
    assert out.splitlines() == ["forgot gone: 6 keys (epoch 1, 3 stored entries, 0 pending)"]
    assert set(await index.keys_by_replica()) == {"live"}
    code, out, _ = await kvgate_in_thread(cli(url, "forget", "--departed")[1:], capsys)
    assert code == 0 and out == "no departed replica (unregistered, idle for 10m)\n"
    code, _, err = await kvgate_in_thread(cli(url, "forget", "--departed", "--force")[1:], capsys)
    assert code == 2 and "no --force" in err


async def test_the_forget_script_checks_again_as_it_unlinks(fleet: tuple[RedisIndex, str]) -> None:
    """The command looks first, then unlinks: an agent that registers or writes between
    the two must find its replica whole (the script refuses), never half gone."""
    index, _ = fleet
    keys = await index.keys_by_replica()
    gone = set(keys["gone"])
    await RedisRegistry(index.client, L).register(reg("gone"), 60_000, now_ms())
    got = await index.forget_replica("gone", keys["gone"], now_ms=now_ms(), idle_ms=600_000)
    assert got.refused == "registered" and got.unlinked == 0
    await index.client.delete(L.registration("gone"))
    await index.set_state("gone", ReplicaState.LIVE, now_ms())  # its agent wrote just now
    got = await index.forget_replica("gone", keys["gone"], now_ms=now_ms(), idle_ms=600_000)
    assert got.refused == "recent" and got.updated_ms is not None
    assert await replica_keys(index.client, "gone") == gone
    # keys created after the look: the current epoch's pending zset, found from the meta
    await index.client.delete(L.pending("gone", 0))
    scanned = [k for k in keys["gone"] if k != L.pending("gone", 0).encode()]
    await index.add_pending("gone", KEYS[:1], 60_000, now_ms())
    got = await index.forget_replica("gone", scanned, now_ms=now_ms(), idle_ms=0)
    assert got.refused == "" and await replica_keys(index.client, "gone") == set()


# ----------------------------------------------------------------------- a returning agent


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


@pytest.fixture
async def agent_rig(redis_url: str) -> AsyncIterator[tuple[Rig, RedisRegistry, str]]:
    index = RedisIndex.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    registry = RedisRegistry.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    r = Rig(index)
    yield r, registry, redis_url
    await r.close()
    await registry.close()
    await index.close()


async def test_an_agent_back_after_forget_builds_a_fresh_replica(
    agent_rig: tuple[Rig, RedisRegistry, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The replica's agent leaves and its keys are forgotten; later its id comes back on
    another engine (a name reused after a scale-down). Its agent finds no meta and builds
    the replica anew, holding exactly the new engine's blocks: an old block hash left behind
    would be taken into the new replica, whose first epoch is 1 again (a clear unlinks only
    the keys of the epoch its meta names, none when there is no meta)."""
    r, registry, url = agent_rig
    await r.start(registry=registry)
    eng = r.engine
    ev, _ = eng.store(toks(0, 6))
    await r.publish(ev)
    await r.settle()
    assert await r.index_keys() == eng.keys() and len(eng.keys()) == 6
    index = r.index
    assert isinstance(index, RedisIndex)
    r.stub.up = False  # a scale-down: the engine goes first, so the clean stop deregisters
    await r.stop_agent()
    code, out, err = await kvgate_in_thread(
        cli(url, "forget", "r0", "--idle-for", "0s")[1:], capsys
    )
    assert code == 0 and out.startswith("forgot r0: "), err
    assert await replica_keys(index.client, "r0") == set()
    back = Rig(index)  # another engine and event stream, the same replica id
    try:
        agent = await back.start(registry=registry)
        ev, _ = back.engine.store(toks(500, 3), tenant="b")
        await back.publish(ev)
        await back.settle()
        assert await back.index_keys() == back.engine.keys() and len(back.engine.keys()) == 3
        for sync in agent.syncs.values():
            await sync.check_invariants()
        assert (await index.meta("r0")).state is ReplicaState.LIVE
    finally:
        await back.close()


async def test_forcing_a_running_agents_replica_out_makes_it_rebuild(
    agent_rig: tuple[Rig, RedisRegistry, str], capsys: pytest.CaptureFixture[str]
) -> None:
    r, registry, url = agent_rig
    agent = await r.start(registry=registry)
    eng = r.engine
    ev, _ = eng.store(toks(0, 5))
    await r.publish(ev)
    await r.settle()

    async def registered() -> bool:
        return bool(await registry.discover(now_ms(), ["r0"]))

    await until(registered)
    code, _, err = await kvgate_in_thread(cli(url, "forget", "r0")[1:], capsys)
    assert code == 2 and "r0: it is registered" in err
    code, out, err = await kvgate_in_thread(cli(url, "forget", "r0", "--force")[1:], capsys)
    assert code == 0 and out.startswith("forgot r0: "), err
    index = r.index

    async def rebuilt() -> bool:
        return await r.index_keys() == eng.keys() and await registered()

    await until(rebuilt, 10.0)  # its index check finds the meta gone: a resync
    ev2, _ = eng.store(toks(100, 2), tenant="b")
    await r.publish(ev2)
    await r.settle()
    assert await r.index_keys() == eng.keys()
    for sync in agent.syncs.values():
        await sync.check_invariants()
    assert (await index.meta("r0")).state is ReplicaState.LIVE


# ------------------------------------------------------------- as a process, with its ACL


def test_as_a_subprocess_with_the_sweeper_acl(fleet: tuple[RedisIndex, str]) -> None:
    """`.venv/bin/kvgate index ...` as an operator's job runs it: as the sweeper ACL user
    (gateway_acl_rules(sweeper=True)), which is all it needs."""
    _, url = fleet
    admin = redis.Redis.from_url(url)
    rules = gateway_acl_rules(L, sweeper=True)
    admin.execute_command(*acl_setuser_args("sweeper", "s3cret-sweep", rules))  # type: ignore[no-untyped-call]
    port = url.split(":")[-1].split("/")[0]
    user_url = f"redis://sweeper:s3cret-sweep@127.0.0.1:{port}/0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(KVGATE), *cli(user_url, *argv)],
            capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
        )  # fmt: skip

    try:
        got = run("stats", "--json")
        assert got.returncode == 0, got.stderr
        rows = json.loads(got.stdout)["replicas"]
        assert [r["replica"] for r in rows] == ["ghost", "gone", "live"]
        got = run("forget", "live")
        assert got.returncode == 2 and got.stderr.splitlines()[0].startswith(
            "kvgate index forget: not forgetting live: it is registered"
        )
        got = run("forget", "gone")
        assert got.returncode == 0 and got.stdout.startswith("forgot gone: 6 keys"), got.stderr
        got = run("sweep")
        assert got.returncode == 0 and got.stdout.splitlines() == [
            f"removed {L.blocks('ghost', 3)}", "removed 1 orphaned keys of 4 examined"
        ]  # fmt: skip
        assert admin.exists(L.meta("gone"), L.blocks("gone", 1)) == 0
        got = run("stats")
        assert got.returncode == 0 and got.stdout.splitlines()[1].split()[:2] == ["live", "live"]
        bad = subprocess.run(
            [str(KVGATE), "index", "stats", "--redis", f"redis://sweeper:wrong@127.0.0.1:{port}/0"],
            capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
        )  # fmt: skip
        assert bad.returncode == 2 and bad.stdout == ""
        assert len(bad.stderr.splitlines()) == 1 and "wrong" not in bad.stderr, bad.stderr
    finally:
        admin.execute_command("ACL", "DELUSER", "sweeper")  # type: ignore[no-untyped-call]
        admin.close()


# ----------------------------------------------------------------------------- on Cluster


async def test_stats_and_forget_on_redis_cluster(
    cluster_url: str, redis_cluster: RedisClusterServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two replicas on every shard: stats reads each where its slot lives, forget unlinks
    each replica's keys on its own node (one slot per replica)."""
    from redis.asyncio.cluster import RedisCluster

    from tests.test_index_cluster import pick_per_shard

    per_shard = pick_per_shard(redis_cluster, [f"c{i}" for i in range(64)], 2)
    rids = sorted(rid for pair in per_shard.values() for rid in pair)
    index = RedisIndex.from_url(
        cluster_url,
        L,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    admin = RedisCluster.from_url(cluster_url)
    try:
        old = now_ms() - HOUR_MS
        for rid in rids:
            e = await index.clear_replica(rid, ReplicaState.LIVE, old)
            await index.apply(rid, e, IndexWrite(dict.fromkeys(KEYS[:3], G), {3: b"x"}), old)
            await index.add_pending(rid, KEYS[3:4], 60_000, old)
        argv = ["--redis", cluster_url, "--redis-cluster", "--key-prefix", PREFIX]
        code, out, err = await kvgate_in_thread(["stats", "--json", *argv], capsys)
        assert code == 0, err
        rows = json.loads(out)["replicas"]
        assert [r["replica"] for r in rows] == sorted(rids)
        assert all((r["stored"], r["mirror"], r["keys"]) == (3, 1, 4) for r in rows)
        gone = [pair[0] for pair in per_shard.values()]  # one of each shard's two
        code, out, err = await kvgate_in_thread(["forget", *gone, *argv], capsys)
        assert code == 0, err
        assert len(out.splitlines()) == 3
        left = {k async for k in admin.scan_iter(match=L.replica_keys_pattern())}
        assert {p[0] for k in left if (p := L.parse(k.decode()))} == set(rids) - set(gone)
        assert len(left) == 4 * 3
    finally:
        await admin.aclose()
        await index.close()


async def test_a_meta_made_no_hash_is_shown_and_forgotten(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A broken tool or rogue agent may turn a meta into a string (its ACL allows DEL and
    SET): stats flags the replica instead of failing for every replica, and forget removes
    it (no agent keeps such a meta up to date)."""
    index, url = fleet
    await index.client.set(L.meta("rogue"), b"not a hash")
    await index.client.hset(L.blocks("rogue", 0), KEYS[0], G)
    code, out, err = await kvgate_in_thread(cli(url, "stats")[1:], capsys)
    assert code == 0, err
    row = next(line.split() for line in out.splitlines() if line.startswith("rogue "))
    assert row[1:3] == ["unknown!", "0"] and row[7] == "2"
    assert "! a key or meta field no agent writes" in out
    code, out, err = await kvgate_in_thread(cli(url, "forget", "rogue")[1:], capsys)
    assert code == 0 and out.startswith("forgot rogue: 2 keys"), err
    assert await replica_keys(index.client, "rogue") == set()


async def test_forget_of_more_keys_than_one_script_takes(fleet: tuple[RedisIndex, str]) -> None:
    """Past 1,024 epoch-scoped keys (orphans of many lost metas) the surplus goes first, as
    the sweeper would take it (never the current epoch's), and the rest in the one script:
    refused, the replica keeps its current epoch; forgotten, nothing is left."""
    index, _ = fleet
    pipe = index.client.pipeline(transaction=False)
    for epoch in range(2, 1202):
        pipe.hset(L.blocks("gone", epoch), KEYS[0], G)
    await pipe.execute()
    keys = (await index.keys_by_replica())["gone"]
    assert len(keys) == 6 + 1200
    await index.set_state("gone", ReplicaState.LIVE, now_ms())
    got = await index.forget_replica("gone", keys, now_ms=now_ms(), idle_ms=600_000)
    assert got.refused == "recent"
    held = await replica_keys(index.client, "gone")
    assert {L.meta("gone").encode(), L.blocks("gone", 1).encode()} <= held and len(held) < 1206
    assert await index.replica_blocks("gone") == dict.fromkeys(KEYS[:3], G)
    got = await index.forget_replica("gone", keys, now_ms=now_ms(), idle_ms=600_000, force=True)
    assert got.refused == "" and got.unlinked == len(held)
    assert await replica_keys(index.client, "gone") == set()
