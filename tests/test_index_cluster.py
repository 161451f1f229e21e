"""RedisIndex and RedisLoadStore on a REAL Redis Cluster (3 primaries, no replicas, started by
the ``redis_cluster`` fixture with ``redis-cli --cluster create``).

Replica ids are chosen by the layout's slot arithmetic so that they land on every shard (and
checked against the servers' own ``CLUSTER KEYSLOT`` / ``CLUSTER SLOTS``). Covered: lookups
equal MemoryIndex's on the same writes (tiers, pending, states, a cleared replica, unknown
replicas), one script call per shard per lookup (counted by the client and by every node's
``INFO commandstats``), agent writes (split and pipelined), gateway pending writes, clears,
the orphan sweeper and script reloads, each replica's keys on the node owning its slot, the
differential property driver of test_index_property, load records through RedisLoadStore,
a fresh client whose first call is a lookup, and the agent and gateway ACLs on a cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster

from cachecore.index.base import IndexError_, PrefixIndex, ReplicaState, StaleEpochError
from cachecore.index.layout import (
    KeyLayout,
    acl_setuser_args,
    agent_acl_rules,
    gateway_acl_rules,
)
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import IndexWrite, Tier, chain_values
from cachecore.loadstate import EngineLoad, MemoryLoadStore, RedisLoadStore
from cachecore.testing import PATIENT_TIMEOUT_S, RedisClusterServers
from tests.test_index_property import REPLICAS as PROPERTY_REPLICAS
from tests.test_index_property import Driver, fixed_program, op

pytestmark = pytest.mark.redis

L = KeyLayout()
G, C, D, R = int(Tier.GPU), int(Tier.CPU), int(Tier.DISK), int(Tier.REMOTE)
KEYER = BlockKeyer(4)
A = KEYER.keys(list(range(48)), "kvg1:t", "m")  # 12 chained keys
B = KEYER.keys(list(range(24)) + [7] * 24, "kvg1:t", "m")  # shares A's first 6 keys
OTHER = KEYER.keys([5] * 40, "kvg1:other", "m")  # stored nowhere
assert A[:6] == B[:6] and A[6] != B[6]


# ------------------------------------------------------------------ the cluster's shape


def slot_owners(cluster: RedisClusterServers) -> list[tuple[int, int, int]]:
    """``(first slot, last slot, port)`` of every slot range, as the servers report it."""
    with redis.Redis("127.0.0.1", cluster.ports[0], socket_timeout=2) as c:
        rows = c.execute_command("CLUSTER", "SLOTS")
    return sorted((int(r[0]), int(r[1]), int(r[2][1])) for r in rows)


def owner(owners: Sequence[tuple[int, int, int]], slot: int) -> int:
    return next(port for lo, hi, port in owners if lo <= slot <= hi)


def pick_per_shard(
    cluster: RedisClusterServers, names: Sequence[str], per_shard: int
) -> dict[int, list[str]]:
    """``per_shard`` of ``names`` on each shard (port), by the layout's slot arithmetic,
    which must equal the server's ``CLUSTER KEYSLOT`` of every key of the replica."""
    owners = slot_owners(cluster)
    assert {port for _, _, port in owners} == set(cluster.ports)
    assert sum(hi - lo + 1 for lo, hi, _ in owners) == 16384
    picked: dict[int, list[str]] = {port: [] for port in cluster.ports}
    with redis.Redis("127.0.0.1", cluster.ports[0], socket_timeout=2) as c:
        for rid in names:
            slot = L.slot(rid)
            for key in (L.meta(rid), L.blocks(rid, 3), L.pending(rid, 3), L.load(rid)):
                assert c.execute_command("CLUSTER", "KEYSLOT", key) == slot
            port = owner(owners, slot)
            if len(picked[port]) < per_shard:
                picked[port].append(rid)
    assert all(len(v) == per_shard for v in picked.values()), picked
    return picked


@pytest.fixture(scope="module")
def shards(redis_cluster: RedisClusterServers) -> dict[int, list[str]]:
    """Two replica ids per shard, DP-rank ids among them."""
    names = [n for i in range(64) for n in (f"eng{i}", f"m@dp{i}")]
    return pick_per_shard(redis_cluster, names, 2)


@pytest.fixture(scope="module")
def ghosts(redis_cluster: RedisClusterServers) -> list[str]:
    """One never-written replica id per shard."""
    per = pick_per_shard(redis_cluster, [f"ghost{i}" for i in range(64)], 1)
    return [rids[0] for rids in per.values()]


def interleaved(shards: dict[int, list[str]]) -> list[str]:
    """Every picked replica, shards interleaved (request order is not shard order)."""
    return [rid for row in zip(*shards.values(), strict=True) for rid in row]


@pytest.fixture
async def cluster_index(cluster_url: str) -> AsyncIterator[RedisIndex]:
    idx = RedisIndex.from_url(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    assert idx.is_cluster
    yield idx
    await idx.close()


async def commandstats(admins: dict[int, aioredis.Redis]) -> dict[int, dict[str, int]]:
    """Per node, calls per command (the admins' own INFO aside: connect them beforehand)."""
    out: dict[int, dict[str, int]] = {}
    for port, client in admins.items():
        info = await client.info("commandstats")
        out[port] = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}
    return out


async def flush_scripts(cluster: RedisClusterServers) -> None:
    cluster.on_every_node("SCRIPT", "FLUSH")


async def both(indexes: Sequence[Any], name: str, *args: Any) -> Any:
    """Call ``name`` on every backend; they must answer alike."""
    got = [await getattr(i, name)(*args) for i in indexes]
    for g in got[1:]:
        assert g == got[0], (name, args, got)
    return got[0]


def write_of(keys: Sequence[bytes], bits: Sequence[int], seq: int | None = None) -> IndexWrite:
    """What the agent's mirror writes for a chain holding ``bits`` from the root."""
    values = chain_values(bits)
    mirror: dict[int, bytes | None] = {i: b"rec-%d" % i for i, v in enumerate(values) if v}
    return IndexWrite({k: v for k, v in zip(keys, values, strict=False) if v}, mirror, seq)


def tiers(m: Any) -> tuple[int, int, int, int]:
    t = m.tier_blocks
    return (t[Tier.GPU], t[Tier.CPU], t[Tier.DISK], t[Tier.REMOTE])


# --------------------------------------------------------------------------------- tests


async def test_lookups_on_cluster_equal_memory_index(
    cluster_index: RedisIndex, shards: dict[int, list[str]], ghosts: list[str]
) -> None:
    red, mem = cluster_index, MemoryIndex()
    idx: list[PrefixIndex] = [red, mem]
    rs = interleaved(shards)
    t = 10
    for r in rs[:4]:
        await both(idx, "set_state", r, ReplicaState.LIVE, t)
    # rs[0]: GPU+CPU, a gap at block 6; pending over the first 10 keys until 510
    await both(idx, "apply", rs[0], 0, write_of(A, [G | C] * 3 + [G] * 2 + [C] + [0, G], 3), t)
    await both(idx, "add_pending", rs[0], A[:10], 500, t)
    # rs[1]: all of B on GPU (A's first 6 keys), pending over A until 2010
    await both(idx, "apply", rs[1], 0, write_of(B, [G] * 12), t)
    await both(idx, "add_pending", rs[1], A, 2000, t)
    # rs[2]: DISK+REMOTE, then REMOTE, then GPU
    await both(idx, "apply", rs[2], 0, write_of(A, [D | R] * 4 + [R] * 4 + [G] * 4, 8), t)
    # rs[3]: all of A and pending, then cleared (epoch 1: both dropped), then a bit of B
    await both(idx, "apply", rs[3], 0, write_of(A, [G] * 12, 1), t)
    await both(idx, "add_pending", rs[3], A[:12], 5000, t)
    assert await both(idx, "clear_replica", rs[3], ReplicaState.LIVE, t, 77.5) == 1
    for stale in (0, 2):
        for i in idx:
            with pytest.raises(StaleEpochError):
                await i.apply(rs[3], stale, write_of(A, [G]), t)
    await both(idx, "apply", rs[3], 1, write_of(B, [G] * 3), t)
    await both(idx, "add_pending", rs[3], B[:5], 1000, t)
    # rs[4]: cold (routable); rs[5]: unavailable (entries kept, answers zeros)
    await both(idx, "apply", rs[4], 0, write_of(A, [G] * 12), t)
    await both(idx, "set_state", rs[4], ReplicaState.COLD, t)
    await both(idx, "apply", rs[5], 0, write_of(A, [C] * 12), t)
    await both(idx, "set_state", rs[5], ReplicaState.UNAVAILABLE, t)

    everyone = [*rs, *ghosts]
    prompts = [A, B, A[:3], A[:7], OTHER, B[:6] + OTHER[:2], []]
    for now in (20, 600, 2500):
        for prompt in prompts:
            for replicas in (everyone, everyone[::-1], [rs[0]], [ghosts[0], rs[5], rs[1]]):
                await both(idx, "lookup", prompt, replicas, now)

    got = await red.lookup(A, everyone, 20)
    assert tiers(got[rs[0]]) == (5, 3, 0, 0)
    assert (got[rs[0]].stored_blocks, got[rs[0]].pending_blocks) == (6, 10)
    assert (got[rs[1]].stored_blocks, got[rs[1]].pending_blocks) == (6, 12)
    assert tiers(got[rs[2]]) == (0, 0, 4, 8) and got[rs[2]].stored_blocks == 12
    # cleared: epoch 0's 12 stored and 12 pending keys gone, epoch 1's B[:3] (= A[:3]) and
    # pending B[:5] (= A[:5]) left
    assert (got[rs[3]].stored_blocks, got[rs[3]].pending_blocks) == (3, 5)
    assert tiers(got[rs[4]])[0] == 12 and got[rs[4]].state == ReplicaState.COLD
    assert got[rs[5]].stored_blocks == 0 and got[rs[5]].state == ReplicaState.UNAVAILABLE
    assert all(got[g].state == ReplicaState.UNKNOWN for g in ghosts)
    later = await red.lookup(B, [rs[3]], 600)
    assert (later[rs[3]].stored_blocks, later[rs[3]].pending_blocks) == (3, 5)
    assert (await red.lookup(A, [rs[0]], 600))[rs[0]].pending_blocks == 6  # expired at 510

    for r in everyone:
        await both(idx, "meta", r)
        await both(idx, "replica_blocks", r)
        await both(idx, "load_mirror", r)
    assert (await red.meta(rs[3])).engine_start == 77.5
    assert await red.replicas() == sorted(rs)  # SCAN over every node
    st_red, st_mem = await red.stats(), await mem.stats()
    assert (st_red.replicas, st_red.stored_entries, st_red.pending_entries) == (
        st_mem.replicas,
        st_mem.stored_entries,
        st_mem.pending_entries,
    )
    assert st_red.extra["used_memory"] > 0
    await mem.close()


@pytest.mark.parametrize("k", [1, 2, 3])
async def test_a_lookup_is_one_call_per_shard(
    cluster_index: RedisIndex, shards: dict[int, list[str]], k: int
) -> None:
    red = cluster_index
    ports = list(shards)
    for port in ports:
        for j, r in enumerate(shards[port]):
            await red.set_state(r, ReplicaState.LIVE, 0)
            await red.apply(r, 0, write_of(A, [G] * (4 + j)), 0)
            await red.add_pending(r, A[: 6 + j], 1000, 0)
    used = ports[:k]
    replicas = interleaved({p: shards[p] for p in used})
    await red.lookup(A, replicas, 1)  # the script is loaded on every node already
    n = 5
    admins = {p: aioredis.Redis(host="127.0.0.1", port=p) for p in ports}
    try:
        await commandstats(admins)  # connected: their handshakes are not counted below
        before = await commandstats(admins)
        trips = red.round_trips
        for _ in range(n):
            res = await red.lookup(A, replicas, 1)
        after = await commandstats(admins)
    finally:
        for admin in admins.values():
            await admin.aclose()
    assert red.round_trips - trips == n * k
    calls = {p: after[p].get("evalsha_ro", 0) - before[p].get("evalsha_ro", 0) for p in ports}
    assert calls == {p: (n if p in used else 0) for p in ports}  # one call per shard, each
    assert sum(calls.values()) == n * k
    for p in ports:
        delta = {c: v - before[p].get(c, 0) for c, v in after[p].items()}
        delta = {c: v for c, v in delta.items() if v and c != "info"}
        # nothing else at top level: the rest ran inside the scripts
        assert set(delta) <= {"evalsha_ro", "hmget", "hget", "zscore"}, (p, delta)
    for p in used:
        for j, r in enumerate(shards[p]):
            assert (res[r].stored_blocks, res[r].pending_blocks) == (4 + j, 6 + j)


async def test_writes_keep_each_replica_in_its_slot(
    cluster_url: str, redis_cluster: RedisClusterServers, shards: dict[int, list[str]]
) -> None:
    """Agent writes (split in parts, pipelined in one round trip), gateway pending writes and
    clears: each call's keys in one slot (APPLY_LUA and the others lack allow-cross-slot-keys,
    so Redis itself refuses any other key), and every key on the node owning its slot."""
    red = RedisIndex.from_url(
        cluster_url,
        cluster=True,
        max_write_fields=7,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    try:
        rs = interleaved(shards)
        blocks = dict.fromkeys(A, G)
        mirror: dict[int, bytes | None] = {i: b"m" * 20 for i in range(30)}
        for r in rs:
            await red.set_state(r, ReplicaState.LIVE, 0)
            # a node that has not run the script yet answers NOSCRIPT: loaded, then resent
            # (one more trip); counted on a warm node so the test holds in any order
            await red.apply(r, 0, IndexWrite(dict(blocks), dict(mirror), seq=8), 0)
            trips = red.round_trips
            await red.apply(r, 0, IndexWrite(blocks, mirror, seq=9), 0)  # 42 fields: 6 parts
            assert red.round_trips - trips == 1
            await red.add_pending(r, B, 1000, 0)
            # evicted and stored again within one write: the removal log (rm:0) has it
            await red.apply(r, 0, IndexWrite({A[-1]: G}, removed={A[-1]}), 5)
            assert await red.removed_since(r, [A[0], A[-1]], 5) == [False, True]
            assert await red.replica_blocks(r) == blocks
            assert len(await red.load_mirror(r)) == 30
            assert (await red.meta(r)).last_seq == 9
        owners = slot_owners(redis_cluster)
        for port in redis_cluster.ports:
            client = aioredis.Redis(host="127.0.0.1", port=port)
            try:
                keys = [k.decode() async for k in client.scan_iter(count=1000)]
            finally:
                await client.aclose()
            mine = {r for r in rs if owner(owners, L.slot(r)) == port}
            assert len(mine) == 2
            want = {
                name
                for r in mine
                for name in (
                    L.meta(r),
                    L.blocks(r, 0),
                    L.mirror(r, 0),
                    L.removals(r, 0),
                    L.pending(r, 0),
                )
            }
            assert set(keys) == want, port

        # scripts lost on every node (a restart or failover): every call reloads its own
        await flush_scripts(redis_cluster)
        res = await red.lookup(A, rs, 1)
        assert all(m.stored_blocks == 12 for m in res.values())
        await flush_scripts(redis_cluster)
        await red.apply(rs[0], 0, IndexWrite({OTHER[0]: G}, mirror, seq=10), 1)  # pipelined
        await flush_scripts(redis_cluster)
        await red.apply(rs[1], 0, IndexWrite({OTHER[0]: G}), 1)
        await flush_scripts(redis_cluster)
        await red.add_pending(rs[2], OTHER, 1000, 1)
        await flush_scripts(redis_cluster)
        assert await red.clear_replica(rs[0], ReplicaState.LIVE, 2) == 1
        assert (await red.lookup(OTHER, [rs[2]], 3))[rs[2]].pending_blocks == len(OTHER)
        with pytest.raises(StaleEpochError):  # the pipelined path maps STALE too
            await red.apply(rs[0], 0, IndexWrite(blocks, mirror, seq=11), 3)
        assert await red.replica_blocks(rs[0]) == {}
    finally:
        await red.close()


async def test_clear_unlinks_old_epochs_and_sweeper_scans_every_node(
    cluster_index: RedisIndex, cluster_url: str, shards: dict[int, list[str]]
) -> None:
    red = cluster_index
    admin = RedisCluster.from_url(cluster_url)
    rs = [rids[0] for rids in shards.values()]  # one per shard
    try:
        for r in rs:
            await red.apply(r, 0, IndexWrite({A[0]: G}, {1: b"x" * 20}), 0)
            await red.add_pending(r, A[:1], 1000, 0)
            assert await admin.exists(L.blocks(r, 0)) + await admin.exists(L.mirror(r, 0)) == 2
            assert await red.clear_replica(r, ReplicaState.LIVE, 0) == 1
            assert await admin.exists(L.blocks(r, 0)) + await admin.exists(L.mirror(r, 0)) == 0
            assert 0 < await admin.pttl(L.pending(r, 0)) <= 1000 + 60_000
            # an orphan: the meta hash is lost (epoch back to 0) while b:1 remains
            await red.apply(r, 1, IndexWrite({A[1]: G}), 0)
            await admin.delete(L.meta(r))
            await red.apply(r, 0, IndexWrite({A[2]: G}), 0)
        assert await red.sweep_orphans() == len(rs)  # one b:1 on each node
        for r in rs:
            assert await admin.exists(L.blocks(r, 1)) == 0
            assert await red.replica_blocks(r) == {A[2]: G}
        assert await red.sweep_orphans() == 0
        assert await red.replicas() == sorted(rs)
        run_ids = await red.instance_id()
        infos = await admin.info("server", target_nodes=RedisCluster.PRIMARIES)
        assert run_ids == ",".join(sorted(v["run_id"] for v in infos.values()))
        assert len(run_ids.split(",")) == 3 and await red.instance_id() == run_ids
    finally:
        await admin.aclose()


async def test_load_records_round_trip_on_cluster(
    cluster_url: str,
    redis_cluster: RedisClusterServers,
    shards: dict[int, list[str]],
    ghosts: list[str],
) -> None:
    # simulated time, as the memory store keeps it (Redis's own clock: test_h25_load_clock)
    red = RedisLoadStore(RedisCluster.from_url(cluster_url), gateway_ttl_ms=1000, clock="caller")
    mem = MemoryLoadStore(gateway_ttl_ms=1000)
    stores = [red, mem]
    rs = interleaved(shards)
    try:
        for i, r in enumerate(rs):
            await both(stores, "publish_engine", r, EngineLoad(i, 2 * i, i / 8, 5), 10_000, 5)
            await both(stores, "add_inflight", "gw-1", r, 1 + i, 100 * i, 5)
            await both(stores, "add_inflight", "gw-2", r, 2, 10, 5)
        await both(stores, "add_inflight", "gw-1", rs[0], -1, -50, 6)
        await both(stores, "heartbeat", "gw-1", rs, 500)  # one pipeline, split per node
        trips = red.round_trips
        snap = await both(stores, "snapshot", [*rs, *ghosts], 900)
        assert red.round_trips - trips == 3  # one call per shard
        r1 = snap[rs[1]]
        assert (r1.num_running, r1.num_waiting, r1.kv_usage) == (1, 2, 1 / 8)
        assert (r1.inflight_requests, r1.inflight_prefill_tokens, r1.gateways) == (4, 110, 2)
        assert snap[rs[0]].inflight_requests == 2 and snap[rs[0]].gateways == 2
        # gw-2 stopped heartbeating: its counts lapse; then it drops itself everywhere
        snap = await both(stores, "snapshot", rs, 1200)
        assert snap[rs[1]].inflight_requests == 2 and snap[rs[1]].gateways == 1
        await flush_scripts(redis_cluster)
        await both(stores, "heartbeat", "gw-1", rs, 1300)  # reloads the script per node
        await both(stores, "drop_gateway", "gw-2", rs)
        await flush_scripts(redis_cluster)
        snap = await both(stores, "snapshot", [*ghosts, *rs], 1400)
        # gw-1's counts only: 1 + i each, less the one that finished on rs[0]
        assert [snap[r].inflight_requests for r in rs] == [0, *range(2, len(rs) + 1)]
    finally:
        await red.close()
        await mem.close()


async def test_a_fresh_clients_first_call_is_a_lookup(cluster_url: str, ghosts: list[str]) -> None:
    """A gateway's first command may be a lookup or a load snapshot: the per-shard grouping
    must load the slot map itself (it raised a bare KeyError before any other command)."""
    red = RedisIndex.from_url(
        cluster_url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    load = RedisLoadStore(RedisCluster.from_url(cluster_url))
    try:
        res = await red.lookup(A, ghosts, 0)
        assert [res[g].state for g in ghosts] == [ReplicaState.UNKNOWN] * len(ghosts)
        assert red.round_trips == len(ghosts)  # one ghost per shard
        snap = await load.snapshot(ghosts, 0)
        assert all(snap[g].inflight_requests == 0 for g in ghosts)
    finally:
        await red.close()
        await load.close()


async def test_acl_users_on_cluster(
    cluster_url: str, redis_cluster: RedisClusterServers, shards: dict[int, list[str]]
) -> None:
    """The documented agent and gateway ACLs work on a cluster (users are per node: create
    them on every node): the cluster client may load its slot map, the agent writes its own
    replica only, the gateway looks up every shard (undeclared keys, checked per command)."""
    rs = interleaved(shards)
    own = rs[0]
    users = {
        "agent-c": ("pw-agent-c-1", agent_acl_rules(own)),
        "gw-c": ("pw-gateway-c-1", gateway_acl_rules()),
    }
    admins = [aioredis.Redis(host="127.0.0.1", port=p) for p in redis_cluster.ports]
    try:
        for admin in admins:
            for user, (password, rules) in users.items():
                await admin.execute_command(*acl_setuser_args(user, password, rules))  # type: ignore[no-untyped-call]
        url = cluster_url.replace("redis://", "redis://{}:{}@")
        agent = RedisIndex.from_url(
            url.format("agent-c", users["agent-c"][0]),
            cluster=True,
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
        gateway = RedisIndex.from_url(
            url.format("gw-c", users["gw-c"][0]),
            cluster=True,
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
        try:
            epoch = await agent.clear_replica(own, ReplicaState.LIVE, 1)
            await agent.apply(own, epoch, write_of(A, [G] * 4, 2), 2)
            assert (await agent.meta(own)).last_seq == 2
            assert len((await agent.instance_id()).split(",")) == 3
            for other in rs[1:]:
                with pytest.raises(IndexError_, match=r"NOPERM|permission"):
                    await agent.apply(other, 0, write_of(A, [G]), 2)
            with pytest.raises(IndexError_):
                await agent.add_pending(own, A, 1000, 2)  # gateway-owned
            with pytest.raises(IndexError_):
                await agent.lookup(A, [rs[1]], 3)  # reads another replica's keys

            await gateway.add_pending(own, A[:6], 1000, 3)
            res = await gateway.lookup(A, rs, 4)  # every shard
            assert (res[own].stored_blocks, res[own].pending_blocks) == (4, 6)
            assert all(res[r].state == ReplicaState.UNKNOWN for r in rs[1:])
            with pytest.raises(IndexError_):
                await gateway.apply(own, epoch, write_of(A, [G]), 5)
        finally:
            await agent.close()
            await gateway.close()
    finally:
        for admin in admins:
            for user in users:
                await admin.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
            await admin.aclose()


# ---------------------------------------------- the property test's driver, on the cluster


async def _drive(cluster: RedisClusterServers, ops: list[tuple[Any, ...]]) -> Driver:
    cluster.on_every_node("FLUSHALL")
    red = RedisIndex.from_url(
        cluster.url,
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    mem = MemoryIndex()
    try:
        d = Driver([mem, red])
        for o in [("state", i, 0) for i in range(len(PROPERTY_REPLICAS))] + ops:
            await d.step(o)
        await d.finish()
        mem.check_invariants()
        return d
    finally:
        await red.close()


def test_property_replicas_span_every_shard(redis_cluster: RedisClusterServers) -> None:
    owners = slot_owners(redis_cluster)
    ports = {owner(owners, L.slot(r)) for r in PROPERTY_REPLICAS}
    assert ports == set(redis_cluster.ports)


def test_fixed_program_agrees_on_cluster(redis_cluster: RedisClusterServers) -> None:
    """test_index_property's fixed program (mirror-driven writes from engine events, pending,
    removals, lookups over all three replicas, one per shard) on the cluster."""
    d = asyncio.run(_drive(redis_cluster, fixed_program(30, clears=True)))
    assert d.lookups == 30 and d.hits >= 5, (d.lookups, d.hits)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(ops=st.lists(op, min_size=1, max_size=30))
def test_memory_and_cluster_agree(redis_cluster: RedisClusterServers, ops: list[Any]) -> None:
    asyncio.run(_drive(redis_cluster, ops))
