"""The agent on a real Redis: persistence of the mirror across agent restarts, full resync
after a Redis restart or outage, the agent's own ACL user, and the standalone CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import redis

from cachecore.index.base import ReplicaState
from cachecore.index.layout import KeyLayout, acl_setuser_args, agent_acl_rules
from cachecore.index.redis import RedisIndex
from cachecore.loadstate import RedisLoadStore
from cachecore.registry import RedisRegistry
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer, free_port
from tests.test_agent_helpers import BS, Rig, counter_total, until

pytestmark = pytest.mark.redis


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def _index(url: str) -> RedisIndex:
    return RedisIndex.from_url(
        url,
        KeyLayout("kvgt"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )


@pytest.fixture
async def redis_rig(redis_url: str) -> AsyncIterator[Rig]:
    index = _index(redis_url)
    r = Rig(index)
    yield r
    await r.close()
    await index.close()


async def test_agent_restart_on_redis_restores_mirror_and_replays(redis_rig: Rig) -> None:
    r = redis_rig
    await r.start()
    eng = r.engine
    ev, h = eng.store(toks(0, 4))
    await r.publish(ev)
    await r.settle()
    await r.stop_agent()
    child, _ = eng.store(toks(300, 2), parent=h[-1], tenant=None)
    await r.publish(child)
    await r.publish(eng.remove(h[2:3]))
    await r.start()
    await r.settle()
    assert await r.index_keys() == eng.keys()
    assert r.agent is not None
    for sync in r.agent.syncs.values():
        await sync.check_invariants()


async def test_an_unreadable_mirror_field_on_redis_is_dropped_not_retried(redis_rig: Rig) -> None:
    """A mirror hash field no agent writes (not an engine hash's 8 or 18 bytes) made the
    restarting agent retry its load for ever as if Redis were down."""
    r = redis_rig
    await r.start()
    eng = r.engine
    ev, _ = eng.store(toks(0, 3))
    await r.publish(ev)
    await r.settle()
    await r.stop_agent()
    index = r.index
    assert isinstance(index, RedisIndex)
    epoch = (await index.meta("r0")).epoch
    await index.client.hset(index.layout.mirror("r0", epoch), b"abc", b"\x01\x00\x00\x00")
    agent = await r.start()  # ready within wait_ready's 10 s, or this fails
    await r.settle()
    assert counter_total(agent.metrics.clears, cause="corrupt_mirror") == 1
    assert await r.index_keys() == eng.keys()  # rebuilt from the engine's replay


async def test_redis_restart_is_resynced_from_the_mirror(redis_own: RedisServer) -> None:
    index = _index(redis_own.url)
    r = Rig(index)
    try:
        await r.start()
        eng = r.engine
        ev, _ = eng.store(toks(0, 3))
        await r.publish(ev)
        await r.settle()
        redis_own.restart()  # all data lost, new run_id

        async def resynced() -> bool:
            try:
                return await r.index_keys() == eng.keys()
            except Exception:
                return False

        # no event arrives: the periodic check alone must notice the new run_id
        await until(resynced, 10.0)
        assert r.agent is not None
        causes = {
            c: counter_total(r.agent.metrics.resyncs, cause=c)
            for c in ("index_restarted", "index_lost", "index_error")
        }
        assert sum(causes.values()) >= 1, causes
        ev2, _ = eng.store(toks(100, 2), tenant="b")
        await r.publish(ev2)
        await r.settle()
        assert await r.index_keys() == eng.keys()
        for sync in r.agent.syncs.values():
            await sync.check_invariants()
        assert (await index.meta("r0")).state is ReplicaState.LIVE
    finally:
        await r.close()
        await index.close()


async def test_redis_outage_loses_no_write(redis_own: RedisServer) -> None:
    index = _index(redis_own.url)
    r = Rig(index)
    try:
        await r.start()
        eng = r.engine
        ev, h = eng.store(toks(0, 3))
        await r.publish(ev)
        await r.settle()
        redis_own.stop()
        for i in range(5):  # events keep coming while Redis is down
            e, _ = eng.store(toks(1000 + 10 * i, 1), tenant=f"o{i}")
            await r.publish(e)
        await r.publish(eng.remove(h[-1:]))
        await asyncio.sleep(0.5)
        redis_own.start()

        async def back() -> bool:
            try:
                return await r.index_keys() == eng.keys()
            except Exception:
                return False

        await until(back, 15.0)
        assert r.agent is not None
        assert counter_total(r.agent.metrics.index_errors) >= 1
        assert counter_total(r.agent.metrics.resyncs) >= 1
        # the rewrite carries the seq of the mirror it wrote, not the last write before
        # the outage: an agent restarted now replays nothing twice, so one removal per
        # block still empties it (with the outage's seq, evictions left keys behind)
        await r.settle()
        last = r.source.buffer[-1][0]
        assert (await index.meta("r0")).last_seq == last
        await r.stop_agent()
        await r.start()
        for hashes in list(eng.held.items())[:3]:
            await r.publish(eng.remove([hashes[0]]))
        await r.settle()
        assert await r.index_keys() == eng.keys()
    finally:
        await r.close()
        await index.close()


async def test_agent_works_with_its_own_acl_user(redis_url: str) -> None:
    layout = KeyLayout("kvgt")
    admin = redis.Redis.from_url(redis_url)
    password = uuid.uuid4().hex
    admin.execute_command(*acl_setuser_args("agent-r0", password, agent_acl_rules("r0", layout)))  # type: ignore[no-untyped-call]
    port = redis_url.split(":")[-1].split("/")[0]
    url = f"redis://agent-r0:{password}@127.0.0.1:{port}/0"
    index, load = (
        _index(url),
        RedisLoadStore.from_url(
            url, layout, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
        ),
    )
    registry = RedisRegistry.from_url(
        url, layout, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    r = Rig(index)
    try:
        await r.start(load_store=load, registry=registry)
        ev, _ = r.engine.store(toks(0, 2))
        await r.publish(ev)
        await r.settle()
        assert await r.index_keys() == r.engine.keys()

        async def registered() -> bool:
            return bool(await registry.discover(int(time.time() * 1000), ["r0"]))

        await until(registered)
        # the same credentials cannot touch another replica
        with pytest.raises(Exception, match=r"(?i)no permissions|NOPERM"):
            await index.clear_replica("r1", ReplicaState.LIVE, 0)
    finally:
        await r.close()
        for c in (index, load, registry):
            await c.close()
        admin.execute_command("ACL", "DELUSER", "agent-r0")  # type: ignore[no-untyped-call]
        admin.close()


async def test_cli_agent_process_end_to_end(redis_url: str, tmp_path: Path) -> None:
    r = Rig(_index(redis_url))
    await r.stub.start()
    http_port = free_port()
    cmd = [
        sys.executable, "-m", "gateway.cli", "agent",
        "--replica-id", "r0", "--engine-url", r.stub.url,
        "--events", r.events_ep, "--replay", str(r.replay_ep),
        "--redis", redis_url, "--key-prefix", "kvgt",
        "--redis-timeout", str(PATIENT_TIMEOUT_S),
        "--http-port", str(http_port), "--scrape-interval", "0.1",
        "--heartbeat-interval", "0.2", "--log-level", "WARNING", "--handover-window", "3",
    ]  # fmt: skip
    # stderr to a file, not a pipe nobody reads: a full pipe would block the agent's
    # logging (and with it the agent); the file is shown if the agent fails to stop
    err_path = tmp_path / "agent.stderr"
    err = err_path.open("wb")
    proc = subprocess.Popen(  # noqa: ASYNC220 - a child process, started once
        cmd, stdout=subprocess.DEVNULL, stderr=err, env=os.environ
    )
    try:
        async with httpx.AsyncClient() as client:

            async def healthy() -> bool:
                try:
                    resp = await client.get(f"http://127.0.0.1:{http_port}/health")
                except httpx.HTTPError:
                    return False
                return resp.status_code == 200

            await until(healthy, 30.0, 0.1)
            await asyncio.sleep(0.3)  # subscription reaches the PUB

            async def indexed() -> bool:
                return await r.index_keys() == r.engine.keys()

            # ZMQ drops what is published before the agent's subscription reaches the PUB,
            # which a busy host may take longer than the pause to do: a lone batch lost so
            # was never indexed. Each later batch shows the agent the gap (replayed), so
            # publish another until the index holds them all, 5 at most
            for i in range(5):
                ev, _ = r.engine.store(toks(100 * i, 3))
                await r.publish(ev)
                with contextlib.suppress(AssertionError):  # until()'s timeout
                    await until(indexed, 2.0)
                    break
            await until(indexed, 10.0)
            registry = RedisRegistry.from_url(
                redis_url,
                KeyLayout("kvgt"),
                socket_timeout_s=PATIENT_TIMEOUT_S,
                connect_timeout_s=PATIENT_TIMEOUT_S,
            )

            async def registered() -> bool:
                return bool(await registry.discover(int(time.time() * 1000), ["r0"]))

            await until(registered, 10.0)
            proc.send_signal(signal.SIGTERM)
            try:
                code = await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, err_path.read_text(errors="replace")[-4000:]
            # its engine serves: the registration is left to the next agent for the
            # --handover-window (tests/test_agent_handover.py), then lapses
            assert await registry.discover(int(time.time() * 1000), ["r0"]) != []
            left = await registry.client.pttl(registry.layout.registration("r0"))
            assert 0 < left <= 3_000, left
            await registry.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err.close()
        assert r.agent is None
        await r.close()
        await r.index.close()


def test_cli_agent_http_port_in_use_is_a_one_line_error(redis_url: str) -> None:
    """Two agents on one host with the same --http-port: the second says so in one line
    and exits 2 (the bind in the server's constructor escaped the handler: a traceback)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [
            sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r9",
            "--engine-url", "http://127.0.0.1:9", "--events", "tcp://127.0.0.1:9",
            "--redis", redis_url, "--key-prefix", "kvgt", "--no-register",
            "--http-port", str(port), "--log-level", "WARNING",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=os.environ)
    assert done.returncode == 2, done.stderr
    assert "cannot listen on" in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("field", ["last_seq", "engine_start", "updated_ms", "epoch"])
async def test_a_corrupt_meta_value_on_redis_is_rebuilt_not_retried(
    redis_rig: Rig, field: str
) -> None:
    """A meta field no agent writes (a broken tool's non-numeric last_seq, epoch, ...) made
    the restarting agent retry its load for ever, logging "index not reachable at startup"
    every few seconds: it never became ready. It must log once, count a clear with cause
    corrupt_meta and rebuild the replica from the engine's replay. A non-numeric epoch,
    which HINCRBY refuses, is replaced by the clear's time in ms (it was retried until an
    operator repaired the field)."""
    r = redis_rig
    await r.start()
    eng = r.engine
    ev, _ = eng.store(toks(0, 3))
    await r.publish(ev)
    await r.settle()
    await r.stop_agent()
    index = r.index
    assert isinstance(index, RedisIndex)
    meta_key = index.layout.meta("r0")
    await index.client.hset(meta_key, field, b"abc")
    agent = await r.start()  # ready within wait_ready's 10 s, or this fails
    await r.settle()
    assert counter_total(agent.metrics.clears, cause="corrupt_meta") == 1
    raw = await index.client.hget(meta_key, "epoch")
    assert raw is not None
    epoch = int(raw)
    assert epoch > 1_000_000_000_000 if field == "epoch" else epoch >= 1
    assert await r.index_keys() == eng.keys()  # rebuilt from the engine's replay
    for sync in agent.syncs.values():
        await sync.check_invariants()
