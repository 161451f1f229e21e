"""A health probe that timed out while the gateway's own event loop was starved is not held
against the replica. A CPU-starved gateway (a throttled container, a blocking call, a noisy
neighbour) fires its probes' timers late, in the same loop turn as the answers they wait for,
and marked every healthy replica unhealthy at once: at start-up the first requests got 503
``no_replica`` (the clean-clone CI flake of the twenty-third session, reproduced under four
CPU hogs: ``replica unhealthy`` at the gateway's start). A replica that is slow while the
gateway's loop runs on time is still marked unhealthy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.looplag import LoopLagMonitor
from cachecore.replica.fleet import run_fleet
from cachecore.testing import free_port, serve_asgi
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import HealthPolicy
from tests.test_gateway_support import FAST, SECRET, words
from tests.test_upstream import server

pytestmark = pytest.mark.timeout(90)

_HOP = {b"host", b"content-length", b"transfer-encoding", b"connection"}


@asynccontextmanager
async def health_proxy(
    upstream: str, block_s: float = 0.0, sleep_s: float = 0.0, blocked_probes: int = 1
) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A real HTTP proxy to ``upstream`` whose first ``blocked_probes`` /health answers
    block this process's event loop ``block_s`` (``time.sleep``: the gateway's loop, which
    this proxy shares, is starved) and whose every /health answer waits ``sleep_s`` without
    blocking (a slow replica). Yields its URL and counts of the /health requests seen."""
    seen = {"health": 0}
    client = httpx.AsyncClient(base_url=upstream, timeout=30.0)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if scope["path"] == "/health":
            seen["health"] += 1
            if seen["health"] <= blocked_probes and block_s:
                time.sleep(block_s)  # noqa: ASYNC251 -- the point: the whole loop stalls
            if sleep_s:
                await asyncio.sleep(sleep_s)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        r = await client.request(scope["method"], scope["path"], content=body, headers=headers)
        out = [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP]
        await send({"type": "http.response.start", "status": r.status_code, "headers": out})
        await send({"type": "http.response.body", "body": r.content})

    try:
        async with serve_asgi(app) as url:
            yield url, seen
    finally:
        await client.aclose()


# ---------------------------------------------------------------------- the monitor


async def test_a_blocked_loop_is_counted_even_before_the_monitor_wakes() -> None:
    lag = LoopLagMonitor(interval_s=0.02)
    lag.start()
    try:
        await asyncio.sleep(0.05)
        t0 = lag.now()
        time.sleep(0.3)  # noqa: ASYNC251 -- a stall of this process's loop
        # the monitor has not run since: the stall in progress counts
        assert lag.longest_stall_since(t0) >= 0.25
        await asyncio.sleep(0.05)
        assert lag.longest_stall_since(t0) >= 0.25  # and once recorded, still (counted once)
        assert lag.longest_stall_since(t0) < 0.3 + 0.25
    finally:
        await lag.stop()


async def test_a_stall_before_the_window_is_not_counted() -> None:
    lag = LoopLagMonitor(interval_s=0.02)
    lag.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251
        ended = lag.now()
        for _ in range(100):  # until a tick after the stall is recorded (bounded)
            if lag._ticks and lag._ticks[-1][0] >= ended:
                break
            await asyncio.sleep(0.01)
        t0 = lag.now()
        await asyncio.sleep(0.1)
        assert lag.longest_stall_since(t0) < 0.25
        # a window opening 0.2 s before the stall ended holds that part of it
        assert 0.15 <= lag.longest_stall_since(ended - 0.2) < 0.3
    finally:
        await lag.stop()


async def test_a_busy_loops_short_slices_are_no_stall() -> None:
    """Back-to-back 30 ms slices of work add up to most of the window, but no single stall
    spans a timer's due time long enough to fake a timeout: the longest is what counts."""
    lag = LoopLagMonitor(interval_s=0.02)
    lag.start()
    try:
        await asyncio.sleep(0.05)
        t0 = lag.now()
        for _ in range(20):
            time.sleep(0.03)  # noqa: ASYNC251 -- a slice of synchronous work
            await asyncio.sleep(0)
        assert lag.longest_stall_since(t0) < 0.2  # the slices sum to 0.6 s
    finally:
        await lag.stop()


async def test_a_stopped_or_failing_monitor_reads_no_stall() -> None:
    def broken(_: float) -> None:
        raise RuntimeError("a metrics error")

    lag = LoopLagMonitor(interval_s=0.02, on_lag=broken)
    lag.start()
    await asyncio.sleep(0.1)
    assert lag.running and len(lag._ticks) >= 2  # the callback's errors did not end it
    await lag.stop()
    t0 = lag.now()
    time.sleep(0.3)  # noqa: ASYNC251 -- a stopped monitor's due time is no stall
    assert not lag.running and lag.longest_stall_since(t0) == 0.0


def test_the_monitor_refuses_a_nonsensical_interval() -> None:
    with pytest.raises(ValueError):
        LoopLagMonitor(interval_s=0)
    with pytest.raises(ValueError):
        LoopLagMonitor(max_ticks=0)


# ---------------------------------------------------------------------- the pool


async def _one_round(
    url: str, monitor: LoopLagMonitor | None, inconclusive: list[str]
) -> ReplicaPool:
    async with httpx.AsyncClient() as client:
        pool = ReplicaPool(
            client, HealthPolicy(), loop_lag=monitor, on_inconclusive=inconclusive.append
        )
        pool.add(ReplicaSpec("r0", url))
        await pool.check_once(refresh_models=True)
        return pool


async def test_a_starved_gateway_keeps_its_replica_and_a_slow_replica_is_still_caught() -> None:
    async with run_fleet(FAST, count=1) as fleet:
        monitor = LoopLagMonitor()
        monitor.start()
        try:
            # the loop blocked 0.8 s while the probe (timeout 0.5 s) was out
            async with health_proxy(fleet.urls[0], block_s=0.8, blocked_probes=2) as (url, _):
                seen: list[str] = []
                pool = await _one_round(url, monitor, seen)
                rep = pool.get("r0")
                assert rep is not None and rep.healthy and rep.health_fails == 0
                assert seen == ["r0"]
                # the same stall without the monitor: held against the replica (as before)
                pool = await _one_round(url, None, seen)
                rep = pool.get("r0")
                assert rep is not None and not rep.healthy
            # a replica slow to answer while the loop runs on time: unhealthy, as before
            async with health_proxy(fleet.urls[0], sleep_s=0.8) as (url, _):
                seen = []
                pool = await _one_round(url, monitor, seen)
                rep = pool.get("r0")
                assert rep is not None and not rep.healthy and seen == []
        finally:
            await monitor.stop()


async def hung(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
    """Reads, never answers (a wedged engine, SIGSTOPped): a handler for ``server``."""
    while await reader.read(65536):
        pass


async def test_a_hung_replica_behind_a_busy_but_running_loop_is_marked_unhealthy() -> None:
    """A loop doing back-to-back 30 ms slices of work is busy, not stalled: the probe of a
    replica that never answers is held against it (summing the slices' lateness made every
    such probe inconclusive, and the hung replica kept its traffic for ever)."""
    monitor = LoopLagMonitor()
    monitor.start()
    stop = asyncio.Event()

    async def busy() -> None:
        while not stop.is_set():
            time.sleep(0.03)  # noqa: ASYNC251 -- a slice of synchronous work
            await asyncio.sleep(0)

    worker = asyncio.ensure_future(busy())
    try:
        async with server(hung) as (url, _):
            seen: list[str] = []
            pool = await _one_round(url, monitor, seen)
            rep = pool.get("r0")
            assert rep is not None and not rep.healthy and seen == []
    finally:
        stop.set()
        await worker
        await monitor.stop()


async def _rounds(
    pool: ReplicaPool, n: int, ids: tuple[str, ...] = ("r0", "r1")
) -> list[list[bool]]:
    """``n`` health rounds: each replica's health after each."""
    out = []
    for _ in range(n):
        await pool.check_once()
        out.append([r.healthy for r in (pool.get(i) for i in ids) if r is not None])
    return out


async def test_a_round_where_no_replica_answered_holds_nothing_against_anyone() -> None:
    """A gateway stalled at every probe: every replica's probes are inconclusive, however
    many rounds (the streak cap counted them all at the fourth round: the whole fleet
    unhealthy at once, the first defect back every fourth round)."""
    async with run_fleet(FAST, count=2) as fleet:
        monitor = LoopLagMonitor()
        monitor.start()
        try:
            async with (
                health_proxy(fleet.urls[0], block_s=0.8, blocked_probes=10) as (a, _),
                health_proxy(fleet.urls[1], block_s=0.8, blocked_probes=10) as (b, _),
                httpx.AsyncClient() as client,
            ):
                seen: list[str] = []
                pool = ReplicaPool(
                    client, HealthPolicy(), loop_lag=monitor, on_inconclusive=seen.append
                )
                pool.add(ReplicaSpec("r0", a))
                pool.add(ReplicaSpec("r1", b))
                assert await _rounds(pool, 5) == [[True, True]] * 5
                assert len(seen) == 10
        finally:
            await monitor.stop()


async def hung_and_stalling(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Never answers; 0.3 s after each connection it blocks the loop 0.4 s (across the
    probe's 0.5 s read timeout): a hung replica probed by a stalled gateway."""
    asyncio.get_running_loop().call_later(0.3, time.sleep, 0.4)
    await hung(reader, w)


async def test_a_hung_replica_is_taken_out_in_rounds_where_its_peers_answer() -> None:
    """Three inconclusive probes in a row at most when another replica answered in the
    round: the fourth timeout counts."""
    async with run_fleet(FAST, count=1) as fleet, server(hung_and_stalling) as (stalling, _):
        monitor = LoopLagMonitor()
        monitor.start()
        try:
            async with httpx.AsyncClient() as client:
                seen: list[str] = []
                pool = ReplicaPool(
                    client, HealthPolicy(), loop_lag=monitor, on_inconclusive=seen.append
                )
                pool.add(ReplicaSpec("r0", stalling))
                pool.add(ReplicaSpec("r1", fleet.urls[0]))
                got = await _rounds(pool, 4)
                assert got == [[True, True]] * 3 + [[False, True]], got
                assert seen == ["r0"] * 3
        finally:
            await monitor.stop()


# ---------------------------------------------------------------------- end to end


async def test_a_gateway_starved_at_its_start_serves_its_first_request() -> None:
    async with (
        run_fleet(FAST, count=1) as fleet,
        # the start-up round and the health loop's first (started with the gateway)
        health_proxy(fleet.urls[0], block_s=0.8, blocked_probes=2) as (url, seen),
    ):
        gs = GatewaySettings(
            replicas=[url], port=free_port(), open_access=True, salt_secrets=[SecretStr(SECRET)]
        )
        gw = build_gateway(gs)
        async with (
            serve_in_loop(gw) as base,
            httpx.AsyncClient(base_url=base, timeout=30.0) as h,
        ):
            assert seen["health"] >= 1  # the start-up probe met the stall
            # (before: marked unhealthy at once, the first request a 503 no_replica)
            body = {"model": fleet.endpoints[0].model, "prompt": words(40, 1), "max_tokens": 1}
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            metrics = (await h.get("/metrics")).text
            rid = gw.specs[0].id
            # both blocked probes at least (a busy machine may starve a later one too)
            line = f'kvgate_health_probes_inconclusive_total{{replica="{rid}"}} '
            counted = [ln for ln in metrics.splitlines() if ln.startswith(line)]
            assert counted and float(counted[0].split()[-1]) >= 2.0, counted
            assert "kvgate_event_loop_lag_seconds_bucket" in metrics


async def dribbling(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers 200 with a body sent a byte every 0.2 s (never whole within the probe's 2 s
    deadline)."""
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n")
    for _ in range(100):
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b" ")


async def test_a_dead_replica_is_out_before_a_slow_peers_probe_ends() -> None:
    """Each probe's outcome applies as it comes (only a timeout past the inconclusive streak
    waits for the round): a refused replica was marked unhealthy only once its peer's
    dribbled answer ran out its 2 s deadline."""
    monitor = LoopLagMonitor()
    monitor.start()
    try:
        async with server(dribbling) as (slow, _), httpx.AsyncClient() as client:
            out: dict[str, float] = {}

            def changed(replica: str, routable: bool) -> None:
                if not routable:
                    out[replica] = time.monotonic()

            pool = ReplicaPool(client, HealthPolicy(), on_change=changed, loop_lag=monitor)
            pool.add(ReplicaSpec("dead", f"http://127.0.0.1:{free_port()}"))
            pool.add(ReplicaSpec("slow", slow))
            t0 = time.monotonic()
            await pool.check_once()
            assert time.monotonic() - t0 >= 1.5  # the round lasts the 2 s deadline
            assert out["dead"] - t0 < 1.0, out  # the dead replica was out long before
    finally:
        await monitor.stop()
