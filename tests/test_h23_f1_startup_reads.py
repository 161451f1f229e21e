"""The gateway's start-up checks of an engine (its /metrics for the block size, its
/tokenize for the tokenizer alignment) read the whole answer within a deadline and at most
a few MiB of it. httpx's timeout is per read: a replica that sent its answer a byte at a
time held ``Gateway.start`` (which awaits these checks) for as long as it dribbled, and
an endless answer was read into memory for as long as it came."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.core import Gateway
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text

pytestmark = pytest.mark.timeout(90)

MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'


@contextlib.asynccontextmanager
async def engine(
    dribbles: str = "", floods: str = "", junk: str = ""
) -> AsyncIterator[dict[str, Any]]:
    """A loopback engine: /health and /v1/models answer at once. ``dribbles`` answers
    200 with a 300-byte body sent one byte per 0.2 s (60 s in all); ``floods`` answers
    200 with a body that does not end (64 KiB chunks, as fast as they are read, at most
    256 MiB); ``junk`` answers 200 with a page that is no JSON. Everything else is a 404.
    Yields its URL and the bytes of body it sent (``sent``)."""
    state: dict[str, Any] = {"url": "", "sent": 0}
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100):  # bounded: start-up sends a handful of requests
                head = await reader.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":", 1)[1])
                if n:
                    await reader.readexactly(n)
                path = head.split(b" ", 2)[1].decode()
                if path == dribbles:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 300\r\n\r\n")
                    for _ in range(300):
                        await writer.drain()
                        await asyncio.sleep(0.2)
                        writer.write(b" ")
                elif path == floods:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (1 << 28))
                    chunk = b"#" * 65535 + b"\n"
                    for _ in range(1 << 12):
                        writer.write(chunk)
                        await writer.drain()
                        state["sent"] += len(chunk)
                elif path == junk:
                    page = b"<html>It works!</html>"
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(page))
                    writer.write(page)
                elif path in ("/health", "/v1/models"):
                    body = MODELS if path == "/v1/models" else b"{}"
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
                    writer.write(body)
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}")
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
    state["url"] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


@contextlib.asynccontextmanager
async def started(url: str, policy: str = "") -> AsyncIterator[tuple[Gateway, float]]:
    """The gateway, started against ``url``; yields it and how long its start took."""
    gs = GatewaySettings(
        replicas=[url],
        port=free_port(),
        open_access=True,
        salt_secrets=[SecretStr("s" * 32)],
        seed=7,
    )
    gw = build_gateway(gs, policy=parse_policy_text(policy))
    t0 = time.monotonic()
    async with serve_in_loop(gw, timeout_s=30.0):
        yield gw, time.monotonic() - t0


@pytest.mark.parametrize("path", ["/metrics", "/tokenize"])
async def test_a_dribbling_answer_to_a_start_up_check_does_not_hold_the_start(path: str) -> None:
    async with (
        engine(dribbles=path) as eng,
        started(eng["url"]) as (gw, took),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.settings.port}") as h,
    ):
        assert (await h.get("/health")).status_code == 200
    # two 2 s checks at most (block size, then the tokenizer probes), not 60 s of dribble
    assert took < 12.0, f"start-up took {took:.1f} s"


@pytest.mark.parametrize("path", ["/metrics", "/tokenize"])
async def test_an_endless_answer_to_a_start_up_check_is_read_no_further_than_the_cap(
    path: str,
) -> None:
    async with engine(floods=path) as eng, started(eng["url"]) as (_gw, took):
        pass
    # the cap (4 MiB) and what the socket buffers hold; 256 MiB were on offer
    assert eng["sent"] < (4 << 20) + (16 << 20), eng["sent"]
    assert took < 12.0, f"start-up took {took:.1f} s"


async def test_a_tokenize_answer_that_is_no_json_is_an_alignment_problem() -> None:
    """It raised JSONDecodeError out of ``Gateway.start``: the gateway did not start."""
    async with engine(junk="/tokenize") as eng, started(eng["url"]) as (gw, _took):
        problems = list(gw.alignment_problems)
    assert any("/tokenize returned 200 and no token ids" in p for p in problems), problems
