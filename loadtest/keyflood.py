"""``kvgate bench keys --api-key-flood SECONDS``: made-up API keys against ``kvgate serve
--api-keys-redis``, and the HGETs they cost the Redis that also serves the index.

A redis-server, one simulated replica and, for each arm, a fresh gateway process. Flood
connections send completion requests, each with a new made-up key, as fast as the gateway
answers (ignoring ``Retry-After``), from one source address or from several (127.0.0.x:
loopback routes all of 127/8); one client with a key in the hash sends a request every
100 ms throughout. Per arm: the answers by status, the HGETs per second from ``INFO
commandstats`` (the valid client's routing costs some too: the no-flood arm shows them),
and whether the valid client kept getting its answers (a target: ``met`` or ``MISSED``,
exit 0 either way). The arm ``budgets off`` (``KVGATE_API_KEYS_MISS_RATE=0`` and
``KVGATE_API_KEYS_MISS_RATE_GLOBAL=0``) is the gateway before the budgets: one HGET per
key; ``global budget off``
(``KVGATE_API_KEYS_MISS_RATE_GLOBAL=0``) has the per-address budgets alone, whose sum grows
with the flood's addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from cachecore.index.redis import redis_client
from cachecore.testing import RedisServer, free_port
from gateway.auth import hash_key
from gateway.cli import positive_int
from loadtest.bench_gateway import (
    ADMIN_KEY,
    SALT_SECRET,
    HttpConn,
    _env,
    _pct,
    _start_bare_replica,
    _wait_health,
    completion_request,
)

VALID_KEY = "sk-bench-valid-client"
NO_BUDGET = {"KVGATE_API_KEYS_MISS_RATE": "0"}
NO_GLOBAL = {"KVGATE_API_KEYS_MISS_RATE_GLOBAL": "0"}


@dataclass(frozen=True)
class Arm:
    name: str
    env: dict[str, str]
    addresses: int  # source addresses of the flood; 0: no flood


@dataclass
class ArmResult:
    arm: Arm
    wall_s: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    hgets: int = 0
    valid_ok: int = 0
    valid_total: int = 0
    valid_ms: list[float] = field(default_factory=list)
    refused_metric: str = ""


class BoundConn(HttpConn):
    """A keep-alive connection from a chosen source address."""

    def __init__(self, host: str, port: int, source: str) -> None:
        super().__init__(host, port)
        self.source = source

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(
            self.host, self.port, local_addr=(self.source, 0)
        )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--flood-connections",
        type=positive_int,
        default=254,
        help="flood connections (--api-key-flood)",
    )
    parser.add_argument(
        "--flood-addresses",
        type=positive_int,
        default=254,
        help="source addresses of the many-address arms (--api-key-flood; 254 at most)",
    )


async def _flood(port: int, conns: list[BoundConn], deadline: float, out: ArmResult) -> None:
    counter = 0

    async def one(conn: BoundConn) -> None:
        nonlocal counter
        while time.monotonic() < deadline:
            counter += 1
            auth = f"authorization: Bearer made-up-{id(out)}-{counter}\r\n".encode()
            status, _, _ = await conn.request(
                completion_request("127.0.0.1", port, [1, 2, 3], auth), timeout_s=30.0
            )
            out.statuses[status] += 1

    try:
        await asyncio.gather(*(one(c) for c in conns))
    finally:
        for c in conns:
            await c.close()


async def _valid_client(port: int, deadline: float, out: ArmResult) -> None:
    conn = HttpConn("127.0.0.1", port)
    raw = completion_request(
        "127.0.0.1", port, [5, 6, 7], f"authorization: Bearer {VALID_KEY}\r\n".encode()
    )
    try:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            status, _, _ = await conn.request(raw, timeout_s=30.0)
            out.valid_ms.append((time.perf_counter() - t0) * 1000)
            out.valid_total += 1
            out.valid_ok += status == 200
            await asyncio.sleep(0.1)
    finally:
        await conn.close()


async def _metric(port: int) -> str:
    conn = HttpConn("127.0.0.1", port)
    raw = f"GET /metrics HTTP/1.1\r\nhost: x\r\nx-admin-key: {ADMIN_KEY}\r\n\r\n".encode()
    try:
        _, body, _ = await conn.request(raw)
    finally:
        await conn.close()
    parts = []
    for ln in body.decode().splitlines():
        if ln.startswith("kvgate_api_key_lookups_refused_total{"):
            reason = ln.split('reason="', 1)[1].split('"', 1)[0]
            parts.append(f"{reason} {float(ln.split()[-1]):,.0f}")
    return ", ".join(parts)


def _start_gateway(arm: Arm, redis_url: str, rport: int, gport: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--api-keys-redis", "--redis", redis_url,
         "--replica", f"sim0=http://127.0.0.1:{rport}", "--port", str(gport), "--seed", "1",
         "--log-level", "ERROR"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=_env({"KVGATE_ADMIN_KEY": ADMIN_KEY, "KVGATE_SALT_SECRETS": SALT_SECRET, **arm.env}),
    )  # fmt: skip


async def _run_arm(arm: Arm, args: argparse.Namespace, redis_url: str, rport: int) -> ArmResult:
    gport = free_port()
    gw = _start_gateway(arm, redis_url, rport, gport)
    out = ArmResult(arm)
    admin = redis_client(redis_url, socket_timeout_s=5.0, connect_timeout_s=5.0)
    try:
        _wait_health(f"http://127.0.0.1:{gport}/health", gw)
        await admin.config_resetstat()
        t0 = time.monotonic()
        deadline = t0 + args.api_key_flood
        tasks = [_valid_client(gport, deadline, out)]
        if arm.addresses:
            sources = [f"127.0.0.{1 + i % arm.addresses}" for i in range(args.flood_connections)]
            conns = [BoundConn("127.0.0.1", gport, s) for s in sources]
            tasks.append(_flood(gport, conns, deadline, out))
        await asyncio.gather(*tasks)
        out.wall_s = time.monotonic() - t0
        stats = await admin.info("commandstats")
        out.hgets = int(stats.get("cmdstat_hget", {}).get("calls", 0))
        out.refused_metric = await _metric(gport)
    finally:
        await admin.aclose()
        gw.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            gw.wait(10)
        if gw.poll() is None:
            gw.kill()
            gw.wait(5)
    return out


async def _run(args: argparse.Namespace) -> int:
    # one connection at least per address; 127.0.0.1-127.0.0.254
    many = max(2, min(254, args.flood_addresses, args.flood_connections))
    arms = [
        Arm("no flood (valid client only)", {}, 0),
        Arm("budgets off, 1 address (before)", {**NO_BUDGET, **NO_GLOBAL}, 1),
        Arm("defaults, 1 address", {}, 1),
        Arm(f"global budget off, {many} addresses", NO_GLOBAL, many),
        Arm(f"defaults, {many} addresses", {}, many),
    ]
    server = RedisServer(extra_args=["--maxmemory-policy", "noeviction"]).start()
    rport = free_port()
    replica = _start_bare_replica(rport)
    results: list[ArmResult] = []
    try:
        seed = redis_client(server.url, socket_timeout_s=5.0, connect_timeout_s=5.0)
        await seed.hset("kvg:apikeys", mapping={hash_key(VALID_KEY): "acme"})
        await seed.aclose()
        _wait_health(f"http://127.0.0.1:{rport}/health", replica)
        for arm in arms:
            results.append(await _run_arm(arm, args, server.url, rport))
    finally:
        replica.terminate()
        replica.wait(10)
        server.stop()
    print(
        f"### Made-up API key flood ({args.api_key_flood:g} s per arm, "
        f"{args.flood_connections} flood connections, `--api-keys-redis`, default settings "
        "unless named)\n"
    )
    print(
        "| arm | flood requests/s | 401 | 429 | 503 | HGET/s | valid client ok | "
        "valid p50 / p99 ms | kvgate_api_key_lookups_refused_total |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        flood = sum(r.statuses.values())
        print(
            f"| {r.arm.name} | {flood / r.wall_s:,.0f} | {r.statuses[401]:,} | "
            f"{r.statuses[429]:,} | {r.statuses[503]:,} | {r.hgets / r.wall_s:,.1f} | "
            f"{r.valid_ok}/{r.valid_total} | {_pct(r.valid_ms, 50):.1f} / "
            f"{_pct(r.valid_ms, 99):.1f} | {r.refused_metric} |"
        )
    ok = all(r.valid_ok == r.valid_total for r in results)
    # a verdict to record, exit 0 either way (as every benchmark's target, benchmarks.md)
    print(f"\ntarget: the valid client answered in every arm: {'met' if ok else 'MISSED'}")
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))
