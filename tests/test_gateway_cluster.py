"""``kvgate serve`` and ``kvgate agent`` on a REAL Redis Cluster (the ``redis_cluster``
fixture): the ``redis_cluster`` settings and flags, every Redis client they build going
through a cluster client (hiredis packing and connection limit included), failures of a
cluster client surfacing as the stores' own errors, and end to end: a gateway with its
index, load store, registry and API keys on the cluster, two simulated replicas whose agents
(built as ``kvgate agent`` builds them) write into the cluster, and a repeated long prefix
routed to the replica holding it."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from openai import AsyncOpenAI
from pydantic import SecretStr
from redis.asyncio.cluster import RedisCluster

from cachecore.agent import Agent, AgentSettings
from cachecore.agent.cli import configure as agent_configure
from cachecore.agent.cli import redis_stores
from cachecore.agent.cli import settings_from_args as agent_settings_from_args
from cachecore.index.base import IndexError_, ReplicaState
from cachecore.index.redis import RedisIndex
from cachecore.loadstate import LoadStoreError, RedisLoadStore
from cachecore.registry import RedisRegistry, RegistryError
from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.testing import PATIENT_TIMEOUT_S, RedisClusterServers, free_port
from gateway.auth import KeyStoreUnavailable, hash_key
from gateway.core import Gateway
from gateway.serve import build_gateway, serve_in_loop
from gateway.serve import configure as serve_configure
from gateway.serve import settings_from_args as serve_settings_from_args
from gateway.settings import GatewaySettings
from policies.schema import builtin_policy_path, load_policy
from tests.test_agent_helpers import until
from tests.test_gateway_e2e import cached, chat
from tests.test_gateway_support import ADMIN, FAST, SECRET, words
from tests.test_index_cluster import pick_per_shard

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

API_KEY = "sk-on-the-cluster"


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_configure(parser)
    return parser.parse_args(list(argv))


def _agent_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    agent_configure(parser)
    return parser.parse_args(list(argv))


def _agent_argv(*extra: str) -> list[str]:
    return [
        "--replica-id", "r0", "--engine-url", "http://127.0.0.1:1",
        "--events", "tcp://127.0.0.1:2", "--redis", "redis://127.0.0.1:3", *extra,
    ]  # fmt: skip


def _cluster_settings(url: str, **kw: Any) -> GatewaySettings:
    kw.setdefault("open_access", True)
    return GatewaySettings(redis_url=url, redis_cluster=True, **kw)


# ------------------------------------------------------------------ settings and flags


def test_the_cluster_switch_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_REDIS_CLUSTER", raising=False)
    monkeypatch.delenv("KVGATE_AGENT_REDIS_CLUSTER", raising=False)
    assert not serve_settings_from_args(_serve_args("--redis", "redis://h:1")).redis_cluster
    on = serve_settings_from_args(_serve_args("--redis", "redis://h:1", "--redis-cluster"))
    assert on.redis_cluster and on.redis_url == "redis://h:1"
    assert not agent_settings_from_args(_agent_args(*_agent_argv())).redis_cluster
    assert agent_settings_from_args(_agent_args(*_agent_argv("--redis-cluster"))).redis_cluster
    monkeypatch.setenv("KVGATE_REDIS_CLUSTER", "true")
    monkeypatch.setenv("KVGATE_AGENT_REDIS_CLUSTER", "1")
    assert serve_settings_from_args(_serve_args("--redis", "redis://h:1")).redis_cluster
    # the agent's flag, absent, leaves the environment's value alone
    assert agent_settings_from_args(_agent_args(*_agent_argv())).redis_cluster


def test_agent_environment_gives_the_port_and_prefix_and_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every agent setting with a flag also comes from KVGATE_AGENT_*: the HTTP port and
    the key prefix used to be fixed by the flags' defaults whatever the environment said."""
    for name in ("KVGATE_AGENT_HTTP_PORT", "KVGATE_AGENT_KEY_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    plain = agent_settings_from_args(_agent_args(*_agent_argv()))
    assert (plain.http_port, plain.key_prefix) == (9400, "kvg")
    monkeypatch.setenv("KVGATE_AGENT_HTTP_PORT", "9410")
    monkeypatch.setenv("KVGATE_AGENT_KEY_PREFIX", "envtest")
    env = agent_settings_from_args(_agent_args(*_agent_argv()))
    assert (env.http_port, env.key_prefix) == (9410, "envtest")
    flags = agent_settings_from_args(
        _agent_args(*_agent_argv("--http-port", "9420", "--key-prefix", "flag"))
    )
    assert (flags.http_port, flags.key_prefix) == (9420, "flag")


def test_bad_cluster_settings_fail_at_start_up() -> None:
    with pytest.raises(ValueError, match=r"redis_cluster.*needs redis_url"):
        build_gateway(GatewaySettings(redis_cluster=True, open_access=True))
    # a cluster has no databases but 0: refused when the gateway is built, not per request
    with pytest.raises(ValueError, match=r"redis_cluster is on.*'db' must be 0"):
        build_gateway(_cluster_settings("redis://127.0.0.1:7000/2"))
    agent = AgentSettings(
        replica_id="r0", engine_url="http://127.0.0.1:1", events="tcp://127.0.0.1:2",
        redis="redis://127.0.0.1:7000/2", redis_cluster=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="redis_cluster is on"):
        redis_stores(agent)


async def test_every_gateway_and_agent_client_is_a_cluster_client(cluster_url: str) -> None:
    gw = build_gateway(
        _cluster_settings(cluster_url, open_access=False, api_keys_redis=True, discover=True)
    )
    # what build_gateway handed the gateway (it starts them in Gateway.start)
    index, load_store, key_redis = gw._index_arg, gw._load_store, gw.key_store._redis
    assert isinstance(index, RedisIndex) and index.is_cluster
    assert isinstance(load_store, RedisLoadStore)
    assert isinstance(gw.registry, RedisRegistry)
    clients = [index.client, load_store.client, gw.registry.client, key_redis]
    assert all(isinstance(c, RedisCluster) for c in clients)
    agent = AgentSettings(
        replica_id="r0", engine_url="http://127.0.0.1:1", events="tcp://127.0.0.1:2",
        redis=cluster_url, redis_cluster=True,
    )  # fmt: skip
    a_index, a_load, a_registry = redis_stores(agent)
    assert a_registry is not None
    assert all(isinstance(s.client, RedisCluster) for s in (a_index, a_load, a_registry))
    for closable in (a_index, a_load, a_registry, index, load_store, gw.registry):
        await closable.close()
    assert key_redis is not None
    await key_redis.aclose()


async def test_cluster_index_packs_commands_in_c_with_its_connection_limit(
    cluster_url: str, redis_cluster: RedisClusterServers
) -> None:
    idx = RedisIndex.from_url(
        cluster_url,
        cluster=True,
        max_connections=7,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    try:
        await idx.lookup([b"k" * 16], ["r0", "r1", "r2"], 0)  # loads the slot map
        client = idx.client
        assert isinstance(client, RedisCluster)
        nodes = client.get_nodes()
        assert {n.port for n in nodes} == set(redis_cluster.ports)
        for node in nodes:  # discovered nodes, not only the seed, pack in C
            assert "CPacked" in node.connection_class.__name__
            assert node.max_connections == 7
        # the C packer writes what redis-py's Python packer writes
        conn = nodes[0].acquire_connection()
        try:
            args = ("EVALSHA", "ab" * 20, 1, "k{r:x}", 12, 1.5, b"\x00\xff")
            assert b"".join(conn.pack_command(*args)) == b"".join(
                redis.asyncio.Connection.pack_command(conn, *args)
            )
        finally:
            nodes[0].release(conn)
    finally:
        await idx.close()


async def test_a_cluster_client_reaching_no_node_fails_as_the_stores_errors() -> None:
    """redis-py's cluster client raises RedisClusterException (no RedisError) when no node
    answers; callers (the agent's retries, the gateway's fallback) only handle ours."""
    url = f"redis://127.0.0.1:{free_port()}"
    idx = RedisIndex.from_url(url, cluster=True)
    load = RedisLoadStore.from_url(url, cluster=True)
    reg = RedisRegistry.from_url(url, cluster=True)
    gw = build_gateway(_cluster_settings(url, open_access=False, api_keys_redis=True))
    try:
        with pytest.raises(IndexError_, match="cannot be connected"):
            await idx.lookup([b"k" * 16], ["r0"], 0)
        with pytest.raises(IndexError_):
            await idx.meta("r0")
        with pytest.raises(LoadStoreError):
            await load.snapshot(["r0"], 0)
        with pytest.raises(RegistryError):
            await reg.discover(0)
        with pytest.raises(KeyStoreUnavailable):  # the client gets a 503, not a 401
            await gw.key_store.tenant_for(f"Bearer {API_KEY}")
        assert gw.key_store.redis_errors == 1
    finally:
        for closable in (idx, load, reg, gw._index_arg, gw._load_store):
            if closable is not None:
                await closable.close()


def test_bad_gateway_settings_are_one_line_errors() -> None:
    """A refused setting (env or flag) is one line naming the field and its variable, exit
    2, like every other bad input of ``kvgate serve``; it was a pydantic traceback, exit 1."""
    import os
    import subprocess
    import sys

    for env, flags, field in (
        ({"KVGATE_FIRST_BYTE_TIMEOUT_S": "0"}, [], "KVGATE_FIRST_BYTE_TIMEOUT_S"),
        ({}, ["--key-prefix", "bad prefix"], "KVGATE_KEY_PREFIX"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--open", *flags],
            capture_output=True, text=True, timeout=60, env={**os.environ, **env},
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvgate serve: ") and field in lines[0]


async def test_the_gateway_reads_the_agents_key_namespace(redis_url: str) -> None:
    """``--key-prefix`` / KVGATE_KEY_PREFIX: the gateway's index, registry and API-key
    hash live in the agents' namespace. They were fixed to ``kvg``, so a gateway never
    saw an agent started with ``--key-prefix``."""
    from cachecore.index.layout import KeyLayout
    from cachecore.registry import Registration

    args = _serve_args("--redis", redis_url, "--key-prefix", "team-a", "--open")
    assert serve_settings_from_args(args).key_prefix == "team-a"
    with pytest.raises(ValueError, match="invalid key prefix"):
        GatewaySettings(key_prefix="no spaces")
    layout = KeyLayout("team-a")
    agent_index = RedisIndex.from_url(
        redis_url, layout, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    agent_reg = RedisRegistry.from_url(
        redis_url, layout, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    plain = redis.Redis.from_url(redis_url)
    gw = build_gateway(
        GatewaySettings(
            redis_url=redis_url,
            key_prefix="team-a",
            redis_timeout_s=PATIENT_TIMEOUT_S,
            api_keys_redis=True,
            api_keys_redis_timeout_s=PATIENT_TIMEOUT_S,
            discover=True,
        )
    )
    try:
        now = int(time.time() * 1000)
        await agent_index.set_state("r0", ReplicaState.LIVE, now)
        reg = Registration(
            replica_id="r0", url="http://127.0.0.1:9", model="m", block_size=16,
            capacity_blocks=100, agent_id="agent-r0", registered_ms=now,
        )  # fmt: skip
        await agent_reg.register(reg, 10_000, now)
        plain.hset("team-a:apikeys", hash_key("key-of-team-a"), "team_a")
        assert isinstance(gw._index_arg, RedisIndex)
        assert (await gw._index_arg.meta("r0")).state is ReplicaState.LIVE
        assert gw.registry is not None
        assert [r.replica_id for r in await gw.registry.discover(now)] == ["r0"]
        assert await gw.key_store.tenant_for("Bearer key-of-team-a") == "team_a"
    finally:
        plain.close()
        for closable in (agent_index, agent_reg, gw._index_arg, gw._load_store, gw.registry):
            if closable is not None:
                await closable.close()


# ------------------------------------------------------------------------- end to end


@contextlib.asynccontextmanager
async def cluster_agents(fleet: Fleet, ids: list[str], url: str) -> AsyncIterator[list[Agent]]:
    """One agent per replica, its index, load store and registry built as ``kvgate agent
    --redis URL --redis-cluster`` builds them."""
    agents: list[Agent] = []
    stores: list[Any] = []
    try:
        for rid, ep in zip(ids, fleet.endpoints, strict=True):
            settings = AgentSettings(
                replica_id=rid, engine_url=ep.url, events=ep.events_endpoint,
                replay=ep.replay_endpoint, topic="kv-events", redis=url, redis_cluster=True,
                scrape_interval_s=0.1, heartbeat_interval_s=0.2,
                redis_timeout_s=PATIENT_TIMEOUT_S,
            )  # fmt: skip
            index, load, registry = redis_stores(settings)
            stores += [index, load, registry]
            agents.append(Agent(settings, index, load, registry))
        for agent in agents:
            await agent.start()
        yield agents
    finally:
        for agent in agents:
            await agent.stop(deregister=True)
        for store in stores:
            await store.close()


async def test_gateway_routes_a_repeated_prefix_from_agents_writes_on_the_cluster(
    redis_cluster: RedisClusterServers, cluster_url: str
) -> None:
    per_shard = pick_per_shard(redis_cluster, [f"eng{i}" for i in range(64)], 1)
    ids = [rids[0] for rids in per_shard.values()][:2]  # two replicas, on two shards
    with redis.RedisCluster.from_url(cluster_url) as admin:  # as an operator adds a key
        admin.hset("kvg:apikeys", hash_key(API_KEY), "acme")
    probe = RedisIndex.from_url(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    registry = RedisRegistry.from_url(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    loads = RedisLoadStore.from_url(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    try:
        async with (
            run_fleet(FAST, count=2) as fleet,
            cluster_agents(fleet, ids, cluster_url) as agents,
        ):
            for agent in agents:
                await agent.wait_ready(10.0)

            async def live_registered_and_loaded() -> bool:
                now_ms = int(time.time() * 1000)
                metas = [await probe.meta(rid) for rid in ids]
                regs = {r.replica_id for r in await registry.discover(now_ms)}
                published = await loads.snapshot(ids, now_ms)  # the agents' engine load
                return (
                    all(m.state is ReplicaState.LIVE for m in metas)
                    and regs == set(ids)
                    and all(published[rid].metrics_ts_ms > 0 for rid in ids)
                )

            await until(live_registered_and_loaded, 10.0, 0.05)
            specs = [f"{rid}={ep.url}" for rid, ep in zip(ids, fleet.endpoints, strict=True)]
            settings = GatewaySettings(
                replicas=specs, redis_url=cluster_url, redis_cluster=True,
                redis_timeout_s=PATIENT_TIMEOUT_S, api_keys_redis=True,
                api_keys_redis_timeout_s=PATIENT_TIMEOUT_S, discover=True,
                port=free_port(), salt_secrets=[SecretStr(SECRET)], admin_key=SecretStr(ADMIN),
                seed=7,
            )  # fmt: skip
            # what is tested is that the cluster answers, not the 5 ms lookup budget: a
            # loaded CI machine may let one cluster lookup overrun it (seen once)
            default = load_policy(builtin_policy_path())
            index = default.index.model_copy(update={"lookup_timeout_ms": 2000.0})
            gw = build_gateway(settings, policy=default.model_copy(update={"index": index}))
            async with serve_in_loop(gw) as url:
                await _route_twice(gw, url, ids)
    finally:
        for closable in (probe, registry, loads):
            await closable.close()


async def _route_twice(gw: Gateway, url: str, ids: list[str]) -> None:
    assert gw.index is not None and gw.discovery is not None
    assert set(gw.discovery.discovered) == set(ids)  # registrations read off the cluster
    client = AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    model = (await client.models.list()).data[0].id  # the key was found on the cluster
    messages = chat(words(1500, 77), "the same question")
    first = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=4
    )
    holder = first.headers["x-kvgate-replica"]
    assert holder in ids and cached(first.parse().usage) == 0
    body = {"model": model, "messages": messages, "max_tokens": 4}

    async def stored_on_the_cluster() -> bool:
        # what the gateway's next lookup sees: the holder's agent confirmed its blocks
        # (stored, not just the gateway's own pending entries) in the cluster
        d = await gw.prepare("chat", "acme", dict(body), {}, "probe", True)
        m = d.matches[0][holder]
        return d.index_source == "primary" and m.stored_blocks * d.block_size >= 1400

    await until(stored_on_the_cluster, 5.0, 0.05)
    fallbacks, primary = gw.index.fallbacks, _lookups(gw, "primary")
    second = await client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=4
    )
    assert second.headers["x-kvgate-replica"] == holder
    assert cached(second.parse().usage) >= 1488
    assert int(second.headers["x-kvgate-predicted-cached-tokens"]) >= 1400
    # its lookup was answered by the cluster, not by the local decisions
    assert gw.index.fallbacks == fallbacks and _lookups(gw, "primary") == primary + 1
    # so were the shared load refreshes (in-flight heartbeats and snapshots)
    assert gw.refresher is not None and gw.refresher.errors == 0
    await client.close()


def _lookups(gw: Gateway, source: str) -> float:
    """Index lookups the gateway answered from ``source`` (its latency histogram's count)."""
    return sum(
        sample.value
        for metric in gw.metrics.lookup.collect()
        for sample in metric.samples
        if sample.name.endswith("_count") and sample.labels["source"] == source
    )
