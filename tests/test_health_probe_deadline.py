"""The gateway's health probe and model read have a deadline for the whole answer (four
per-read timeouts, 2 s at the default 0.5 s; the 60-byte answer here dribbles 12 s): httpx's
timeout is per read, so a replica that sends its answer a byte at a time under it held
``ReplicaPool.check_once``, which gathers every replica, for as long as it dribbled, and
froze the health state (recoveries, unhealthy marks, model refreshes) of the whole pool."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx

from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy


@contextlib.asynccontextmanager
async def _dribbling_server(path_dribbles: str) -> AsyncIterator[int]:
    """A loopback HTTP server: ``path_dribbles`` answers 200 with a 60-byte body sent one
    byte per 0.2 s (12 s in all); every other path a prompt 200 with a models list."""
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                if path == path_dribbles:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 60\r\n\r\n")
                    for _ in range(60):
                        await writer.drain()
                        await asyncio.sleep(0.2)
                        writer.write(b" ")
                    await writer.drain()
                else:
                    body = b'{"data": [{"id": "m"}]}'
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(serve(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def test_a_dribbling_health_answer_fails_within_the_timeout() -> None:
    policy = HealthPolicy(timeout_s=0.5, unhealthy_after=1)
    async with (
        _dribbling_server("/health") as slow,
        _dribbling_server("/nothing") as fine,
        httpx.AsyncClient() as client,
    ):
        pool = ReplicaPool(client, policy)
        bad = pool.add(ReplicaSpec("slow", f"http://127.0.0.1:{slow}"))
        good = pool.add(ReplicaSpec("fine", f"http://127.0.0.1:{fine}"))
        t0 = time.monotonic()
        await asyncio.wait_for(pool.check_once(refresh_models=True), 10)
        took = time.monotonic() - t0
    assert not bad.healthy and good.healthy and good.models == {"m"}
    assert took < 5.0, f"one round took {took:.1f} s with a 0.5 s probe timeout (2 s whole)"


async def test_a_dribbling_models_answer_is_given_up_within_the_timeout() -> None:
    policy = HealthPolicy(timeout_s=0.5)
    async with _dribbling_server("/v1/models") as slow, httpx.AsyncClient() as client:
        pool = ReplicaPool(client, policy)
        rep = pool.add(ReplicaSpec("slow", f"http://127.0.0.1:{slow}"))
        t0 = time.monotonic()
        await asyncio.wait_for(pool.check_once(refresh_models=True), 10)
        took = time.monotonic() - t0
    assert rep.healthy and rep.models is None  # no model list read: none made up
    assert took < 5.0, f"one round took {took:.1f} s with a 0.5 s probe timeout (2 s whole)"
