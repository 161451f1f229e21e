"""Review R4: a client that keeps its connection and reads nothing of a long stream held the
request for as long as it kept the connection: the gateway's write waited on the socket with
no bound, so the request stayed in flight, kept its tenant's concurrency slot and upstream
connection, and the engine kept generating for no one. A write that cannot drain within
``KVGATE_CLIENT_WRITE_TIMEOUT_S`` now ends the exchange as a client failure: outcome 499,
``kvgate_client_write_timeouts`` counted, one WARNING, the upstream request cancelled and
the client's connection closed. On the gateway's own protocol (hot path) and on the ASGI path
(plain uvicorn). Small socket buffers on both sides make the stall come after a few KB."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cachecore.testing import serve_asgi
from gateway.app import create_app
from gateway.core import Dispatch, Gateway, Outcome
from gateway.settings import GatewaySettings
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(90)

TIMEOUT_S = 0.5


@pytest.fixture(autouse=True)
def small_server_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small send buffers on the server's side (both protocols derive from uvicorn's), so
    that a client reading nothing makes the gateway wait after a few KB, not ~4 MB."""
    made = HttpToolsProtocol.connection_made

    def small(self: HttpToolsProtocol, transport: Any) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        made(self, transport)

    monkeypatch.setattr(HttpToolsProtocol, "connection_made", small)


def _recording(gw: Gateway) -> list[Outcome]:
    seen: list[Outcome] = []
    finish = gw.finish

    def record(d: Dispatch, out: Outcome) -> None:
        seen.append(out)
        finish(d, out)

    gw.finish = record  # type: ignore[method-assign]
    return seen


def _long_stream(st: Stack) -> bytes:
    body = orjson.dumps(
        {"model": st.model, "prompt": words(20, 3), "max_tokens": 20_000, "stream": True,
         "ignore_eos": True}
    )  # fmt: skip
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % len(body) + body
    )


def _stalled_client(url: str, raw: bytes) -> socket.socket:
    """A client that sends its request and reads nothing (a small receive window)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(raw)
    return s


async def _until(cond: Any, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:  # bounded
        if await cond():
            return True
        await asyncio.sleep(0.05)
    return bool(await cond())


async def _engine_running(h: httpx.AsyncClient, st: Stack) -> int:
    return int((await h.get(st.fleet.urls[0] + "/get_load")).json()[0]["num_reqs"])


async def _read_to_end(s: socket.socket, limit_s: float = 10.0) -> tuple[bytes, bool]:
    """What the client can still read, and whether the gateway closed the connection (EOF
    or a reset) within ``limit_s``."""
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    got = bytearray()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:  # bounded
        try:
            data = await asyncio.wait_for(loop.sock_recv(s, 65536), 1.0)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return bytes(got), True
        if not data:
            return bytes(got), True
        got += data
    return bytes(got), False


async def _check_cut_off(
    st: Stack, gw: Gateway, url: str, seen: list[Outcome], caplog: pytest.LogCaptureFixture
) -> None:
    async with httpx.AsyncClient(timeout=10) as h:
        s = _stalled_client(url, _long_stream(st))
        try:
            assert await _until(lambda: _engine_running(h, st), 10.0)  # it started
            # before the fix: in flight for as long as the client keeps the connection
            assert await _until(lambda: _true(gw.in_flight == 0), 15.0), gw.in_flight
            assert [o.status for o in seen] == [499] and seen[0].error is None
            assert gw.metrics.client_write_timeouts._value.get() == 1
            # the engine was told to stop, not left generating 20,000 tokens for no one
            assert await _until(lambda: _true_not(_engine_running(h, st)), 5.0)
            got, closed = await _read_to_end(s)
            assert closed  # the gateway closed the connection
            assert b"[DONE]" not in got and not got.endswith(b"0\r\n\r\n")  # cut, not whole
        finally:
            s.close()
        warnings = [r for r in caplog.records if "KVGATE_CLIENT_WRITE_TIMEOUT_S" in r.message]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        # the gateway serves on
        ok = await h.post(url + "/v1/completions", json={"model": st.model, "prompt": "hi"})
        assert ok.status_code == 200


async def _true(v: bool) -> bool:
    return v


async def _true_not(v: Any) -> bool:
    return not await v


async def test_hot_path_cuts_off_a_client_that_reads_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.proxy")
    async with stack(count=1, client_write_timeout_s=TIMEOUT_S) as st:
        await _check_cut_off(st, st.gw, st.url, _recording(st.gw), caplog)


@contextlib.asynccontextmanager
async def _plain_uvicorn(gw: Gateway) -> AsyncIterator[str]:
    """The same gateway behind uvicorn's own httptools protocol: completions go through
    FastAPI and ASGI (``UpstreamExchange.__call__``), as under any other ASGI server."""
    async with serve_asgi(create_app(gw), http="httptools") as url:
        yield url


async def test_asgi_path_cuts_off_a_client_that_reads_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.proxy")
    async with (
        stack(count=1, client_write_timeout_s=TIMEOUT_S) as st,
        _plain_uvicorn(st.gw) as url,
    ):
        await _check_cut_off(st, st.gw, url, _recording(st.gw), caplog)


async def test_a_client_that_reads_gets_its_whole_stream() -> None:
    # the bound is on a write that cannot drain, not on the stream's length: a reader
    # slower than the engine (it waits, each wait under the bound) is never cut off
    async with stack(count=1, client_write_timeout_s=TIMEOUT_S) as st, st.http() as h:
        seen = _recording(st.gw)
        body = {"model": st.model, "prompt": words(20, 4), "max_tokens": 3000, "stream": True,
                "ignore_eos": True}  # fmt: skip
        n = 0
        async with h.stream("POST", "/v1/completions", json=body) as r:
            async for chunk in r.aiter_bytes():
                n += chunk.count(b"data: ")
                await asyncio.sleep(0.001)
        assert n == 3000 + 1  # every token, then [DONE]
        assert [o.status for o in seen] == [200]
        assert st.gw.metrics.client_write_timeouts._value.get() == 0


def test_the_setting_is_finite_and_positive() -> None:
    assert GatewaySettings().client_write_timeout_s == 60.0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            GatewaySettings(client_write_timeout_s=bad)
