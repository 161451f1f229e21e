"""``kvgate bench keys`` and ``kvgate bench index``: block-key cost and prefix-index cost.

``keys``: time to compute the chained block keys of 8k- and 32k-token prompts, on the gateway
path (``BlockKeyer.keys``) and the agent path (``BlockKeyer.chain``).

``index``: for each backend (embedded MemoryIndex, RedisIndex on a private redis-server this
benchmark starts on a free port), prompt size and replica count:

* lookup latency p50/p99 over realistic data: every replica holds many unrelated chains, and
  each queried prefix is held fully by one or two replicas, partially by about a quarter of
  the others (random prefix lengths, some of them extended by gateway pending entries) and not
  at all by the rest; Redis PING p50/p99 measured in the same run, interleaved with lookups;
* proof of the single round trip: ``INFO commandstats`` deltas over the measured lookups
  (top-level ``EVALSHA_RO`` calls per lookup, and the commands that ran inside the script:
  the binary search's probes, against the keys a linear scan would have read);
* write throughput in blocks/s (``apply`` of IndexWrite batches with their mirror records);
* Redis memory per indexed block (``INFO memory`` used_memory delta, and ``MEMORY USAGE`` of
  one replica's block and mirror hashes).

Results and the exact commands are recorded in docs/benchmarks.md ("Keys", "Index").
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from cachecore.argtypes import int_at_least, nonnegative_int, positive_float
from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.index.layout import KeyLayout
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKey, BlockKeyer
from cachecore.lifecycle import ALL_TIERS, IndexWrite, Tier, chain_values
from cachecore.testing import RedisServer
from gateway.cli import comma_list, one_of, positive_int
from loadtest import keyflood

GPU = int(Tier.GPU)
GPU_CPU = int(Tier.GPU | Tier.CPU)
TOKENIZER_VOCAB = 151_000


def _pct(values: Sequence[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


# list flags are parsed by argparse: a typo is a usage error, not a traceback mid-run
_sizes = comma_list(positive_int)


# --------------------------------------------------------------------------------- keys


def configure_keys(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=_sizes, default="8192,32768", help="prompt sizes (tokens)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--iterations", type=positive_int, default=300)
    parser.add_argument(
        "--target-ms",
        type=positive_float,
        default=2.0,
        help="p99 target of every size, printed met or MISSED (exit 0 either way: a figure)",
    )
    parser.add_argument(
        "--api-key-flood",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="instead: made-up API keys against a gateway with --api-keys-redis, SECONDS per"
        " arm (loadtest/keyflood.py): HGETs per second with the per-address budget off and on",
    )
    keyflood.configure(parser)


def run_keys(args: argparse.Namespace) -> int:
    if args.api_key_flood is not None:
        return keyflood.run(args)
    rng = random.Random(7)
    keyer = BlockKeyer(args.block_size)
    salt = "kvg1:" + "ab" * 32
    rows = []
    worst_p99 = 0.0
    for n in args.tokens:
        tokens = [rng.randrange(TOKENIZER_VOCAB) for _ in range(n)]
        gw: list[float] = []
        agent: list[float] = []
        full = n - n % args.block_size
        for _ in range(5):  # warm-up
            keyer.keys(tokens, salt, "model", None)
        gc.disable()
        try:
            for _ in range(args.iterations):
                t0 = time.perf_counter_ns()
                out = keyer.keys(tokens, salt, "model", None)
                t1 = time.perf_counter_ns()
                keyer.chain(None, tokens[:full], salt, "model", None)
                t2 = time.perf_counter_ns()
                gw.append((t1 - t0) / 1e6)
                agent.append((t2 - t1) / 1e6)
        finally:
            gc.enable()
        assert len(out) == n // args.block_size
        worst_p99 = max(worst_p99, _pct(gw, 99))
        rows.append(
            f"| {n} | {len(out)} | {_pct(gw, 50):.3f} | {_pct(gw, 99):.3f} | "
            f"{_pct(agent, 50):.3f} | {_pct(agent, 99):.3f} |"
        )
    print(f"### Keys (block_size {args.block_size}, {args.iterations} iterations, xxh3-128)\n")
    print(
        "| prompt tokens | blocks | gateway keys() p50 ms | p99 ms "
        "| agent chain() p50 ms | p99 ms |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    ok = worst_p99 <= args.target_ms
    print(f"\ntarget: keys p99 <= {args.target_ms} ms for every size: {'met' if ok else 'MISSED'}")
    return 0


# -------------------------------------------------------------------------------- index


def configure_index(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backends", type=comma_list(one_of("memory", "redis")), default="memory,redis"
    )
    parser.add_argument("--tokens", type=_sizes, default="8192,32768", help="prompt sizes (tokens)")
    parser.add_argument("--replicas", type=_sizes, default="4,16,64")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument(
        "--lookups", type=positive_int, default=600, help="measured lookups per cell"
    )
    parser.add_argument("--queries", type=positive_int, default=8, help="distinct queried prefixes")
    parser.add_argument(
        "--chains", type=nonnegative_int, default=24, help="background chains per replica"
    )
    # a chain is 16 to --chain-blocks blocks long
    parser.add_argument(
        "--chain-blocks", type=int_at_least(16), default=1024, help="max background length"
    )
    parser.add_argument(
        "--write-batches", type=_sizes, default="64,1024", help="apply() batch sizes"
    )
    parser.add_argument(
        "--write-blocks", type=positive_int, default=200_000, help="blocks per write run"
    )
    parser.add_argument(
        "--partial",
        type=comma_list(one_of("shared", "uniform")),
        default="shared,uniform",
        help="partial-holder scenarios: shared (shared heads) and/or uniform (stress)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")


@dataclass
class Cell:
    backend: str
    scenario: str
    tokens: int
    replicas: int
    probes: list[int] = field(default_factory=list)
    lookup_ms: list[float] = field(default_factory=list)
    ping_ms: list[float] = field(default_factory=list)
    calls_per_lookup: float | None = None
    inner_per_lookup: float | None = None
    redis_us_per_lookup: float | None = None  # the script's time in Redis (its own CPU)
    held_blocks: int = 0


@dataclass
class Dataset:
    queries: list[list[BlockKey]]
    writes: dict[str, list[IndexWrite]]  # replica -> batches
    pending: list[tuple[str, list[BlockKey]]]
    blocks: int


def _rand_key(rng: random.Random) -> BlockKey:
    return rng.randbytes(16)


def build_dataset(n_replicas: int, n_blocks: int, args: argparse.Namespace, seed: int) -> Dataset:
    """Background chains on every replica plus the queried prefixes: 1-2 full holders and a
    quarter of the others as partial holders, some of them extended by pending entries.
    Partial lengths: ``uniform`` (stress: each uniform over the prompt) or ``shared`` (one
    partial holder uniform, the others a shared head of 2-20% of the prompt)."""
    rng = random.Random(seed)
    replicas = [f"bench-{i}" for i in range(n_replicas)]
    per: dict[str, dict[BlockKey, int]] = {r: {} for r in replicas}
    for r in replicas:
        for _ in range(args.chains):
            length = rng.randint(16, args.chain_blocks)
            tiers = [GPU if rng.random() < 0.8 else GPU_CPU for _ in range(length)]
            # entry values as the agent's mirror writes them for such a chain
            chain = [_rand_key(rng) for _ in range(length)]
            per[r].update(zip(chain, chain_values(tiers), strict=True))
    queries: list[list[BlockKey]] = []
    pending: list[tuple[str, list[BlockKey]]] = []
    for _ in range(args.queries):
        q = [_rand_key(rng) for _ in range(n_blocks)]
        queries.append(q)
        holders = rng.sample(replicas, k=min(len(replicas), rng.choice((1, 2))))
        for r in holders:
            per[r].update(dict.fromkeys(q, GPU))
        others = [r for r in replicas if r not in holders]
        partial = rng.sample(others, k=max(1, len(others) // 4))
        for pos, r in enumerate(partial):
            if args.partial_mode == "uniform" or pos == 0:
                # stress (every partial holder), or the one replica a conversation moved from
                cut = rng.randint(1, n_blocks - 1)
            else:
                # shared head: a tenant's system prompt / few-shot examples (2-20%)
                cut = rng.randint(max(1, n_blocks // 50), max(2, n_blocks // 5))
            per[r].update(dict.fromkeys(q[:cut], GPU))
            if rng.random() < 0.3:
                # the gateway routed a longer request there: its keys from the root
                pending.append((r, q[: cut + rng.randint(1, n_blocks - cut)]))
    writes: dict[str, list[IndexWrite]] = {}
    total = 0
    h = 1
    for r, blocks in per.items():
        items = list(blocks.items())
        batches = []
        for i in range(0, len(items), 1024):
            chunk = dict(items[i : i + 1024])
            mirror: dict[int, bytes | None] = {}
            for k, t in chunk.items():
                mirror[h] = k + bytes((1 if t & GPU else 0, 1 if t & 2 else 0, 0, 0))
                h += 1
            batches.append(IndexWrite(chunk, mirror))
        writes[r] = batches
        total += len(items)
    return Dataset(queries, writes, pending, total)


async def _populate(idx: PrefixIndex, data: Dataset, now: int) -> None:
    for r, batches in data.writes.items():
        await idx.set_state(r, ReplicaState.LIVE, now)
        for w in batches:
            await idx.apply(r, 0, w, now)
    for r, keys in data.pending:
        await idx.add_pending(r, keys, 3_600_000, now)


_IN_SCRIPT = ("hmget", "hget", "zscore")
"""The commands the lookup script issues: HMGET of each replica's meta, HGET and ZSCORE
probes of its block hash and pending zset."""


async def _commandstats(client: aioredis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and microseconds per command: the microseconds are Redis's own time running
    it, free of the client's and the loopback's noise."""
    info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for k, v in info.items()}


async def measure_cell(
    idx: PrefixIndex,
    backend: str,
    data: Dataset,
    n_replicas: int,
    n_tokens: int,
    lookups: int,
    admin: aioredis.Redis | None,
    now: int,
    scenario: str,
) -> Cell:
    replicas = [f"bench-{i}" for i in range(n_replicas)]
    cell = Cell(backend, scenario, n_tokens, n_replicas)
    for q in data.queries:  # warm-up (script load, connection)
        await idx.lookup(q, replicas, now)
    before = await _commandstats(admin) if admin is not None else {}
    ping_client = idx.client if isinstance(idx, RedisIndex) else None
    held = 0
    gc.collect()
    gc.disable()
    try:
        for i in range(lookups):
            q = data.queries[i % len(data.queries)]
            if ping_client is not None:
                t0 = time.perf_counter_ns()
                await ping_client.ping()
                cell.ping_ms.append((time.perf_counter_ns() - t0) / 1e6)
            t0 = time.perf_counter_ns()
            res = await idx.lookup(q, replicas, now)
            cell.lookup_ms.append((time.perf_counter_ns() - t0) / 1e6)
            held = max(held, max(m.stored_blocks for m in res.values()))
            # what a linear scan would read: every replica up to the first key neither
            # stored nor pending (the script before run certificates; docs/index.md)
            cell.probes.append(sum(min(len(q), m.pending_blocks + 1) for m in res.values()))
    finally:
        gc.enable()
    cell.held_blocks = held
    if admin is not None:
        after = await _commandstats(admin)
        delta = {k: after[k][0] - before.get(k, (0, 0))[0] for k in after}
        cell.calls_per_lookup = delta.get("evalsha_ro", 0) / lookups
        usec = after.get("evalsha_ro", (0, 0))[1] - before.get("evalsha_ro", (0, 0))[1]
        cell.redis_us_per_lookup = usec / lookups
        inner = sum(v for k, v in delta.items() if k in _IN_SCRIPT)
        cell.inner_per_lookup = inner / lookups
        others = {
            k: v
            for k, v in delta.items()
            if v and k not in ("evalsha_ro", "ping", "info", *_IN_SCRIPT)
        }
        assert not others, f"unexpected top-level commands during lookups: {others}"
    return cell


async def measure_writes(
    idx: PrefixIndex, batch: int, total_blocks: int, seed: int
) -> tuple[float, int]:
    """Blocks/s of apply() with IndexWrites of ``batch`` blocks (+ their mirror records),
    one write in flight, as one agent writer does."""
    rng = random.Random(seed)
    r = f"writer-{batch}"
    await idx.set_state(r, ReplicaState.LIVE, 0)
    n_batches = max(1, total_blocks // batch)
    writes = []
    h = 10**9
    for _ in range(n_batches):
        blocks = {_rand_key(rng): GPU for _ in range(batch)}
        mirror: dict[int, bytes | None] = {}
        for k in blocks:
            mirror[h] = k + b"\x01\x00\x00\x00"
            h += 1
        writes.append(IndexWrite(blocks, mirror))
    await idx.apply(r, 0, IndexWrite(), 0)  # script load
    t0 = time.perf_counter()
    for w in writes:
        await idx.apply(r, 0, w, 0)
    dt = time.perf_counter() - t0
    await idx.clear_replica(r, ReplicaState.LIVE, 0)
    return n_batches * batch / dt, n_batches * batch


async def _redis_memory(admin: aioredis.Redis) -> int:
    info = await admin.info("memory")
    return int(info["used_memory"])


async def run_index_async(args: argparse.Namespace) -> int:
    backends: list[str] = args.backends
    token_sizes: list[int] = args.tokens
    replica_counts: list[int] = args.replicas
    bs = args.block_size
    now = 1_700_000_000_000
    cells: list[Cell] = []
    write_rows: list[str] = []
    mem_rows: list[str] = []
    server: RedisServer | None = None
    admin: aioredis.Redis | None = None
    if "redis" in backends:
        server = RedisServer(extra_args=["--maxmemory-policy", "noeviction"]).start()
        admin = aioredis.Redis.from_url(server.url)
        version = (await admin.info("server"))["redis_version"]
    try:
        for scenario, n_tokens, n_rep in [
            (sc, t, r) for sc in args.partial for t in token_sizes for r in replica_counts
        ]:
            args.partial_mode = scenario
            data = build_dataset(n_rep, n_tokens // bs, args, seed=n_tokens * 1000 + n_rep)
            for backend in backends:
                idx: PrefixIndex
                if backend == "memory":
                    idx = MemoryIndex(max_entries=max(4_000_000, 2 * data.blocks))
                    admin_for_cell = None
                else:
                    assert server is not None and admin is not None
                    await admin.flushall()
                    idx = RedisIndex.from_url(server.url, KeyLayout())
                    admin_for_cell = admin
                mem0 = await _redis_memory(admin_for_cell) if admin_for_cell else 0
                await _populate(idx, data, now)
                if (
                    admin_for_cell is not None
                    and n_tokens == token_sizes[0]
                    and n_rep == replica_counts[-1]
                    and not mem_rows
                ):
                    mem_rows.extend(await _memory_rows(admin_for_cell, data, mem0, n_rep))
                cell = await measure_cell(
                    idx,
                    backend,
                    data,
                    n_rep,
                    n_tokens,
                    args.lookups,
                    admin_for_cell,
                    now,
                    scenario,
                )
                cells.append(cell)
                await idx.close()
        for backend in backends:
            for batch in args.write_batches:
                if backend == "memory":
                    widx: PrefixIndex = MemoryIndex(max_entries=4 * args.write_blocks)
                else:
                    assert server is not None and admin is not None
                    await admin.flushall()
                    widx = RedisIndex.from_url(server.url)
                rate, n = await measure_writes(widx, batch, args.write_blocks, seed=batch)
                write_rows.append(f"| {backend} | {batch} | {n} | {rate:,.0f} |")
                await widx.close()
    finally:
        if admin is not None:
            await admin.aclose()
        if server is not None:
            server.close()

    print(
        f"### Index lookup (block_size {bs}, {args.lookups} lookups per row, "
        f"{args.chains} background chains of up to {args.chain_blocks} blocks per replica)\n"
    )
    if server is not None:
        print(f"Redis {version} on loopback (own server), {os.cpu_count()} CPUs.\n")
    print(
        "| backend | scenario | prompt tokens | replicas | linear-scan keys/lookup | "
        "lookup p50 ms | lookup p99 ms | PING p50 ms | PING p99 ms | p99 - PING p99 ms | "
        "calls/lookup | in-script cmds/lookup | Redis us/lookup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    verdicts: list[str] = []
    for c in cells:
        p50, p99 = _pct(c.lookup_ms, 50), _pct(c.lookup_ms, 99)
        if c.ping_ms:
            pp50, pp99 = _pct(c.ping_ms, 50), _pct(c.ping_ms, 99)
            ping = f"{pp50:.3f} | {pp99:.3f} | {p99 - pp99:+.3f}"
            calls = (
                f"{c.calls_per_lookup:.2f} | {c.inner_per_lookup:.1f} | {c.redis_us_per_lookup:.0f}"
            )
            if c.tokens == 8192 and c.replicas == 16:
                ok1 = p99 <= pp99 + 0.5
                ok2 = p99 <= 1.0
                verdicts.append(
                    f"target at 8k tokens / 16 replicas (redis, {c.scenario}): p99 {p99:.3f} ms"
                    f" <= PING p99 + "
                    f"0.5 = {pp99 + 0.5:.3f} ms: {'met' if ok1 else 'MISSED'}; "
                    f"p99 <= 1 ms: {'met' if ok2 else 'MISSED'}"
                )
        else:
            ping, calls = "- | - | -", "- | - | -"
        probes = statistics.mean(c.probes)
        print(
            f"| {c.backend} | {c.scenario} | {c.tokens} | {c.replicas} | {probes:.0f} | "
            f"{p50:.3f} | {p99:.3f} | {ping} | {calls} |"
        )
    for v in verdicts:
        print(f"\n{v}")
    print("\n### Index writes (apply of IndexWrite batches with mirror records, one in flight)\n")
    print("| backend | blocks per batch | blocks written | blocks/s |")
    print("|---|---|---|---|")
    print("\n".join(write_rows))
    if mem_rows:
        print("\n### Redis memory per indexed block\n")
        print("| measure | bytes |")
        print("|---|---|")
        print("\n".join(mem_rows))
    return 0


async def _memory_rows(admin: aioredis.Redis, data: Dataset, mem0: int, n_rep: int) -> list[str]:
    mem1 = await _redis_memory(admin)
    lay = KeyLayout()
    rid = "bench-0"
    b_key, m_key = lay.blocks(rid, 0), lay.mirror(rid, 0)
    b_len = int(await admin.hlen(b_key))
    m_len = int(await admin.hlen(m_key))
    b_mem = int(await admin.memory_usage(b_key, samples=0) or 0)
    m_mem = int(await admin.memory_usage(m_key, samples=0) or 0)
    return [
        f"| used_memory delta / indexed block (block entry + mirror record, "
        f"{data.blocks:,} blocks on {n_rep} replicas) | {(mem1 - mem0) / data.blocks:.1f} |",
        f"| MEMORY USAGE of one b:<epoch> hash / entries ({b_len:,}) | {b_mem / b_len:.1f} |",
        f"| MEMORY USAGE of one m:<epoch> hash / entries ({m_len:,}) | {m_mem / m_len:.1f} |",
    ]


def run_index(args: argparse.Namespace) -> int:
    if args.quick:
        args.replicas, args.tokens = [4, 16], [8192]
        args.lookups, args.chains, args.write_blocks = 100, 4, 20_000
    return asyncio.run(run_index_async(args))


__all__ = ["ALL_TIERS", "configure_index", "configure_keys", "run_index", "run_keys"]
