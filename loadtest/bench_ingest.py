"""``kvgate bench ingest``: agent event ingest rate and event-to-index latency, through the
real path: ZMQ PUB of vLLM-encoded batches -> ``kvgate agent`` (its own process) -> RedisIndex
on a private ``redis-server``.

Each phase offers block events (BlockStored blocks + BlockRemoved blocks, as an engine in
steady state stores and evicts) at a fixed rate, or as fast as possible (``max``), to a fresh
agent process on a fresh replica id. Reported per phase: achieved rate, CPU of the agent,
of redis-server and of the publisher (this process) in % of one core, event-to-index latency
p50/p99 (engine batch ``ts`` stamped at publish time -> the agent's index write completed,
measured by the agent over every batch), and the agent's gap/replay/clear counters (all
zero unless the agent fell behind its socket buffer).

Payloads are encoded before a phase starts and only their ``ts`` is patched at send time, so
the publisher's own CPU stays small; on a 2-core machine the three processes still share two
cores, so read the CPU columns side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import redis
import zmq
import zmq.asyncio

from cachecore.agent.testing import EngineStub, EventSource
from cachecore.kvevents import (
    BlockRemoved,
    BlockStored,
    Encoding,
    EventBatch,
    KVEvent,
    encode_batch,
)
from cachecore.testing import RedisServer, free_port, free_ports
from gateway.cli import comma_list, nonnegative_int, positive_float, positive_int

_TS_ZERO = b"\xcb" + b"\x00" * 8  # msgpack float64 0.0: the placeholder patched at send time


@dataclass(frozen=True, slots=True)
class Workload:
    block_size: int = 16
    blocks_per_event: int = 16
    events_per_batch: int = 4
    chain_events: int = 4  # a prompt of chain_events * blocks_per_event blocks
    window_blocks: int = 50_000  # blocks held before evictions start (engine capacity)
    encoding: Encoding = Encoding.MAP


@dataclass(slots=True)
class Payload:
    data: bytearray
    ts_at: int
    block_events: int
    stored: int


def build_payloads(w: Workload, total_block_events: int, tag: int) -> list[Payload]:
    """Batches of BlockStored chains (kvgate-salted roots, chained children) and, once
    ``window_blocks`` are held, BlockRemoved of the oldest events' blocks."""
    out: list[Payload] = []
    held: list[list[int]] = []  # engine hashes per stored event, oldest first
    held_blocks = 0
    next_hash = (tag << 40) + 1
    chain_pos = 0
    parent: int | None = None
    salt = ""
    done = 0
    tokens = [(i * 7919) % 50_000 for i in range(w.blocks_per_event * w.block_size)]
    while done < total_block_events:
        events: list[KVEvent] = []
        stored = removed = 0
        for _ in range(w.events_per_batch):
            if chain_pos == 0:
                salt = f"kvg1:{next_hash:064x}"
                parent = None
            hashes = list(range(next_hash, next_hash + w.blocks_per_event))
            next_hash += w.blocks_per_event
            extra: list[tuple[Any, ...] | None] | None = None
            if parent is None:
                extra = [(salt,)] + [None] * (w.blocks_per_event - 1)
            events.append(
                BlockStored(hashes, parent, tokens, w.block_size, medium="GPU", extra_keys=extra)
            )
            parent = hashes[-1]
            chain_pos = (chain_pos + 1) % w.chain_events
            held.append(hashes)
            held_blocks += len(hashes)
            stored += len(hashes)
            while held_blocks > w.window_blocks:
                old = held.pop(0)
                held_blocks -= len(old)
                events.append(BlockRemoved(old, "GPU"))
                removed += len(old)
        raw = encode_batch(EventBatch(0.0, events), w.encoding)
        at = raw.find(_TS_ZERO)
        assert 0 <= at < 16, "ts placeholder not found"
        out.append(Payload(bytearray(raw), at + 1, stored + removed, stored))
        done += stored + removed
    return out


@dataclass
class PhaseResult:
    name: str
    offered: float | None
    block_events: int
    stored: int
    seconds: float
    agent_cpu: float
    redis_cpu: float
    publisher_cpu: float
    p50_ms: float | None
    p99_ms: float | None
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.block_events / self.seconds if self.seconds > 0 else 0.0

    @property
    def per_agent_core(self) -> float:
        """Block events per second of agent CPU: the rate at which one fully used core
        saturates (robust to a shared, noisy machine)."""
        cpu_s = self.agent_cpu / 100.0 * self.seconds
        return self.block_events / cpu_s if cpu_s > 0 else 0.0


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _counter(text: str, name: str, contains: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and contains in line:
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _health(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        resp = await client.get(url)
    except httpx.HTTPError:
        return None
    body = resp.json()
    return body if isinstance(body, dict) else None


async def run_phase(
    name: str,
    rate: float | None,
    payloads: list[Payload],
    redis_url: str,
    rclient: redis.Redis,
    args: argparse.Namespace,
) -> PhaseResult:
    ctx = zmq.asyncio.Context()
    pub_port, replay_port = free_ports(2)
    source = EventSource(
        ctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", buffer_steps=10_000
    ).start()
    stub = await EngineStub(block_size=args.block_size).start()
    http_port = free_port()
    replica = f"bench-{name}"
    cmd = [
        sys.executable, "-m", "gateway.cli", "agent",
        "--replica-id", replica, "--engine-url", stub.url,
        "--events", f"tcp://127.0.0.1:{pub_port}", "--replay", f"tcp://127.0.0.1:{replay_port}",
        "--redis", redis_url, "--key-prefix", "kvgbench", "--http-port", str(http_port),
        "--no-register", "--log-level", "WARNING",
    ]  # fmt: skip
    env = {**os.environ, "KVGATE_AGENT_RCVHWM": "0"}  # measure the agent, not socket drops
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)  # noqa: ASYNC220
    health_url = f"http://127.0.0.1:{http_port}/health"
    try:
        async with httpx.AsyncClient(timeout=2.0) as client:
            for _ in range(300):
                h = await _health(client, health_url)
                if h is not None and h.get("status") == "ok":
                    break
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("agent did not become healthy")
            await asyncio.sleep(0.3)  # the subscription reaches the PUB
            agent_ps = psutil.Process(proc.pid)
            cpu0 = agent_ps.cpu_times()
            redis0 = _redis_cpu(rclient)
            self0 = time.process_time()
            t0 = time.perf_counter()
            pack = struct.Struct(">d").pack_into
            step = None if rate is None else 1.0 / rate
            sent_events = 0
            for p in payloads:
                if step is not None:
                    due = t0 + sent_events * step
                    delay = due - time.perf_counter()
                    if delay > 0.0005:
                        await asyncio.sleep(delay)
                pack(p.data, p.ts_at, time.time())
                await source.publish_payload(bytes(p.data))
                sent_events += p.block_events
            last_seq = source.next_seq - 1
            deadline = time.perf_counter() + args.drain_timeout
            t_end = None
            while time.perf_counter() < deadline:
                h = await _health(client, health_url)
                rep = (h or {}).get("replicas", {}).get(replica, {})
                if rep.get("last_seq") == last_seq and rep.get("queued") == 0:
                    t_end = time.perf_counter()
                    break
                await asyncio.sleep(0.005)
            if t_end is None:
                raise RuntimeError(f"agent did not reach seq {last_seq} in time")
            cpu1 = agent_ps.cpu_times()
            redis1 = _redis_cpu(rclient)
            self1 = time.process_time()
            wall = t_end - t0
            h = await _health(client, health_url) or {}
            lat = h.get("event_to_index_ms", {})
            metrics_text = (await client.get(f"http://127.0.0.1:{http_port}/metrics")).text
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        await source.close()
        await stub.close()
        ctx.destroy(linger=0)
    counters = {
        n: _counter(metrics_text, f"kvgate_agent_{n}_total")
        for n in ("gaps", "messages_dropped", "index_writes")
    }
    # the startup catch-up replay and the fresh replica's first clear are not faults
    clears = "kvgate_agent_clears_total"
    counters["cold_clears"] = _counter(metrics_text, clears) - _counter(
        metrics_text, clears, 'cause="fresh"'
    )
    agent_cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return PhaseResult(
        name,
        rate,
        sum(p.block_events for p in payloads),
        sum(p.stored for p in payloads),
        wall,
        100.0 * agent_cpu / wall,
        100.0 * (redis1 - redis0) / wall,
        100.0 * (self1 - self0) / wall,
        lat.get("p50"),
        lat.get("p99"),
        counters,
    )


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def format_table(results: list[PhaseResult], w: Workload) -> str:
    lines = [
        f"block size {w.block_size}, {w.blocks_per_event} blocks/event, "
        f"{w.events_per_batch} stored events/batch, chains of {w.chain_events} events, "
        f"evictions beyond {w.window_blocks:,} held blocks, {w.encoding.value} encoding; "
        f"host: {os.cpu_count()} cores",
        "",
        "| phase | offered block ev/s | achieved block ev/s | stored blocks/s "
        "| block ev per agent CPU-s | agent CPU % "
        "| redis CPU % | publisher CPU % | e2i p50 ms | e2i p99 ms | index writes | gaps "
        "| clears |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c = r.counters
        lines.append(
            f"| {r.name} | {_fmt(r.offered, 0)} | {r.rate:,.0f} | "
            f"{r.stored / r.seconds:,.0f} | {r.per_agent_core:,.0f} | {r.agent_cpu:.0f} | "
            f"{r.redis_cpu:.0f} | "
            f"{r.publisher_cpu:.0f} | {_fmt(r.p50_ms, 2)} | {_fmt(r.p99_ms, 2)} | "
            f"{c.get('index_writes', 0):,.0f} | {c.get('gaps', 0):.0f} | "
            f"{c.get('cold_clears', 0):.0f} |"
        )
    return "\n".join(lines)


def _rate(text: str) -> str:
    # checked up front: a rate of 0 (or a typo) failed only after the phases before it ran
    if text != "max":
        positive_float(text)
    return text  # the phase's label


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rates", type=comma_list(_rate), default="5000,20000,50000,max",
        help="comma list of offered block-event rates per second, 'max' = as fast as possible",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=positive_float, default=6.0, help="duration of a rated phase"
    )
    parser.add_argument(
        "--max-block-events", type=positive_int, default=600_000, help="size of 'max'"
    )
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--blocks-per-event", type=positive_int, default=16)
    parser.add_argument("--events-per-batch", type=positive_int, default=4)
    parser.add_argument("--window-blocks", type=nonnegative_int, default=50_000)
    parser.add_argument("--encoding", choices=[e.value for e in Encoding], default="map")
    parser.add_argument("--drain-timeout", type=positive_float, default=120.0)


def run(args: argparse.Namespace) -> int:
    w = Workload(
        block_size=args.block_size,
        blocks_per_event=args.blocks_per_event,
        events_per_batch=args.events_per_batch,
        window_blocks=args.window_blocks,
        encoding=Encoding(args.encoding),
    )
    return asyncio.run(_main(args, w))


async def _main(args: argparse.Namespace, w: Workload) -> int:
    results: list[PhaseResult] = []
    with RedisServer() as srv:
        rclient = redis.Redis.from_url(srv.url)
        for i, spec in enumerate(args.rates):
            rate = None if spec == "max" else float(spec)
            total = args.max_block_events if rate is None else int(rate * args.seconds)
            payloads = build_payloads(w, total, tag=i + 1)
            rclient.flushall()
            res = await run_phase(spec, rate, payloads, srv.url, rclient, args)
            results.append(res)
            print(
                f"phase {spec}: {res.rate:,.0f} block events/s, agent CPU {res.agent_cpu:.0f}%, "
                f"p99 {_fmt(res.p99_ms, 2)} ms",
                file=sys.stderr,
                flush=True,
            )
        rclient.close()
    print(format_table(results, w))
    return 0
