"""A uvicorn server's stop keeps its caller's cancellation (the defect 1cf0255 fixed in
run_fleet).

``AgentHTTPServer.stop`` (the agent's /metrics and /health) and the agent tests'
``EngineStub.close`` waited for the server's task with ``asyncio.wait_for`` under
``suppress(CancelledError, Exception)``: a caller cancelled during that wait had the
cancellation handed to the server's task (uvicorn's shutdown cut short) and then swallowed,
and went on as if it had never been cancelled. Now the stop runs to its end
(``cachecore.tasks.wait_to_end``), closes the listening socket, and ends cancelled.

Real pieces: the servers on loopback. The slow shutdown is a fake named as such:
``SlowShutdown`` replaces the uvicorn server's ``shutdown`` with one that takes a while,
then runs the real one."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import pytest
import uvicorn

from cachecore.agent import http as http_module
from cachecore.agent.http import AgentHTTPServer
from cachecore.agent.testing import EngineStub

pytestmark = pytest.mark.timeout(30)


class SlowShutdown:
    """A fake for fault injection, installed as a uvicorn server's ``shutdown``: sets
    ``entered``, takes ``delay_s`` (a connection finishing its answer), then runs the real
    shutdown and sets ``finished``."""

    def __init__(
        self, real: Callable[..., Awaitable[None]], delay_s: float = 0.3, hang: bool = False
    ) -> None:
        self.real = real
        self.delay_s = delay_s
        self.hang = hang
        self.entered = asyncio.Event()
        self.finished = False

    async def __call__(self, sockets: list[socket.socket] | None = None) -> None:
        self.entered.set()
        await (asyncio.Event().wait() if self.hang else asyncio.sleep(self.delay_s))
        await self.real(sockets=sockets)
        self.finished = True


def listening(port: int) -> bool:
    """Something accepts a TCP connection on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def cancel_during_shutdown(
    server: uvicorn.Server, stop: Callable[[], Awaitable[None]], monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Future[None], SlowShutdown]:
    """Call ``stop`` and cancel it while uvicorn's shutdown runs; wait (bounded) for the
    outcome, which the caller checks."""
    slow = SlowShutdown(server.shutdown)
    monkeypatch.setattr(server, "shutdown", slow)
    stopping = asyncio.ensure_future(stop())
    async with asyncio.timeout(5.0):
        await slow.entered.wait()
    stopping.cancel()
    await asyncio.wait([stopping], timeout=5.0)
    return stopping, slow


async def test_an_agent_http_server_stop_cancelled_runs_to_its_end_and_ends_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = AgentHTTPServer([], "127.0.0.1", 0)
    await server.start()
    task = server._task
    assert task is not None and listening(server.port)
    stopping, slow = await cancel_during_shutdown(server._server, server.stop, monkeypatch)
    problems = []
    if not stopping.done():
        problems.append("the stop did not end")
    elif not stopping.cancelled():
        problems.append(f"the caller's cancellation was swallowed: {stopping.exception()!r}")
    if not slow.finished:
        problems.append("uvicorn's shutdown was cut short")
    if not task.done() or task.cancelled():
        problems.append("the server's task was cancelled or is running")
    if listening(server.port):
        problems.append("the port still accepts connections")
    assert problems == [], "\n".join(problems)


async def test_an_engine_stub_close_cancelled_runs_to_its_end_and_ends_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stub = await EngineStub().start()
    task = stub._task
    port = stub._sock.getsockname()[1]
    assert task is not None and listening(port)
    stopping, slow = await cancel_during_shutdown(stub._server, stub.close, monkeypatch)
    assert stopping.done() and stopping.cancelled(), "the caller's cancellation was swallowed"
    assert slow.finished, "uvicorn's shutdown was cut short"
    assert task.done() and not task.cancelled()
    assert not listening(port)


async def test_a_server_that_does_not_stop_in_time_is_cancelled_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Its shutdown hangs: past HTTP_STOP_S its task is cancelled, the sockets close, a
    WARNING says so, and the stop returns (a stop is no place to raise it)."""
    monkeypatch.setattr(http_module, "HTTP_STOP_S", 0.2)
    caplog.set_level(logging.WARNING)
    server = AgentHTTPServer([], "127.0.0.1", 0)
    await server.start()
    task = server._task
    assert task is not None
    hang = SlowShutdown(server._server.shutdown, hang=True)
    monkeypatch.setattr(server._server, "shutdown", hang)
    t0 = time.monotonic()
    async with asyncio.timeout(5.0):
        await server.stop()
    assert time.monotonic() - t0 < 2.0
    assert task.cancelled()
    assert not listening(server.port)
    assert any(
        r.getMessage() == "the agent's HTTP server did not stop cleanly" for r in caplog.records
    )
