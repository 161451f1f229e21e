"""A stop that must not wait does not drain again (review of 86b2e38 and 3fa3515).

A force-quit of ``kvgate serve`` (Ctrl-C once the stop is under way) cuts the requests in
flight, gives them ``serve.FORCE_CUT_S`` to end, then runs the gateway's stop, which
drained again: a cut request that had not ended by then (a handler whose clean-up awaits,
or that ignores its cancellation) held the forced stop up to ``KVGATE_DRAIN_TIMEOUT_S``
(30 s) more. Likewise the lifespan's ``stop_all`` held a cancellation that came while the
API key poller stopped, or the lifespan cancelled while serving, and the gateway's stop
then drained for its full time, where a cancelled drain ends at once. Now both cut the
drain (``Gateway.cut_drain``): the stop goes on to its steps at once, logging
``drain cut: closing with requests in flight``.

Real pieces: the gateway's own server in the test's loop (``_InLoopServer``, free loopback
port, the hot path) and a real HTTP request; the lifespan through the app's own
``lifespan_context``. Faults injected by fakes named as such: ``SlowToEndPrepare`` over
``Gateway.prepare`` (the request is in flight and ignores its cut until released, at most
30 s; shared with test_h30_single_drain, as are ``gateway`` and ``until``),
``SlowKeyStop`` over the key store's ``stop`` (the moment a cancellation arrives)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from gateway import serve
from gateway.app import create_app
from tests.test_h30_single_drain import SlowToEndPrepare, gateway, until

pytestmark = pytest.mark.timeout(90)

DRAIN_S = 6.0  # the drain a stop must not wait out again (30 s by default)
CUT_S = 0.2  # serve.FORCE_CUT_S, patched down (2 s)
WAITING = "Waiting for connections to close. (CTRL+C to force quit)"
DRAIN_CUT = "drain cut: closing with requests in flight"


async def test_a_forced_stop_does_not_wait_again_for_a_request_that_ignores_its_cut(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM, then the force-quit while the server waits for a request whose handler
    ignores its cut: the stop follows FORCE_CUT_S later, not the drain timeout later."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(serve, "FORCE_CUT_S", CUT_S)
    gw = gateway(DRAIN_S, grace_s=0.0)
    stubborn = SlowToEndPrepare(end_s=30)
    gw.prepare = stubborn  # type: ignore[method-assign]
    server = serve._InLoopServer(serve.uvicorn_config(gw, loop="none"), gw)
    serving = asyncio.ensure_future(server.serve())
    request: asyncio.Future[httpx.Response] | None = None
    try:
        await until(lambda: server.started or serving.done(), "the server did not start", 20)
        assert server.started, serving.result()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.settings.port}") as h:
            body = {"model": "m", "prompt": "hello", "max_tokens": 1}
            request = asyncio.ensure_future(h.post("/v1/completions", json=body, timeout=40))
            async with asyncio.timeout(10):
                await stubborn.entered.wait()
            assert gw.in_flight == 1
            server.handle_exit(signal.SIGTERM, None)  # the stop: uvicorn waits for it
            await until(lambda: WAITING in caplog.messages, "uvicorn did not wait")
            t_forced = time.monotonic()
            server.handle_exit(signal.SIGINT, None)  # the force-quit
            done, _ = await asyncio.wait({serving}, timeout=3 * DRAIN_S)
            took_s = time.monotonic() - t_forced
            assert serving in done, "the forced stop did not end"
            serving.result()
            observed = {
                "cut": stubborn.cut,
                "in flight at the stop's end": gw.in_flight,  # it ignored its cut
                "stopped": gw.client is not None and gw.client.is_closed,
                "drain cut logged": [
                    getattr(r, "n", None) for r in caplog.records if r.getMessage() == DRAIN_CUT
                ],
                "drain timeout logged": any("drain timeout" in m for m in caplog.messages),
                "lifespan shutdown ran": "Application shutdown complete." in caplog.messages,
                # CUT_S and the steps (milliseconds), not DRAIN_S more
                "stopped within DRAIN_S / 2": took_s < DRAIN_S / 2,
            }
            assert observed == {
                "cut": True,
                "in flight at the stop's end": 1,
                "stopped": True,
                "drain cut logged": [1],
                "drain timeout logged": False,
                "lifespan shutdown ran": True,
                "stopped within DRAIN_S / 2": True,
            }, f"the forced stop took {took_s:.2f} s"
    finally:
        stubborn.release.set()
        if not serving.done():
            server.force_exit = True
            gw.cut_drain()
            await asyncio.wait({serving}, timeout=30)
        if request is not None:
            await asyncio.wait({request}, timeout=10)
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
        async with asyncio.timeout(30):
            await gw.stop()


class SlowKeyStop:
    """A fake for fault injection over the key store's ``stop``: it sets ``entered``, takes
    a while (a poller slow to end: the moment a cancellation arrives), then runs the real
    stop."""

    def __init__(self, real: Callable[[], Awaitable[None]], delay_s: float = 0.5) -> None:
        self.real = real
        self.delay_s = delay_s
        self.entered = asyncio.Event()

    async def __call__(self) -> None:
        self.entered.set()
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            await self.real()


@pytest.mark.parametrize("where", ["in the key poller's stop", "while serving"])
async def test_a_cancelled_lifespan_shutdown_does_not_drain(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A request in flight that never ends; the lifespan cancelled while its stop_all stops
    the key poller (the cancellation held until the gateway's stop has run), or while
    serving (stop_all runs after it): the gateway's stop must not drain for DRAIN_S."""
    caplog.set_level(logging.WARNING)
    gw = gateway(DRAIN_S, grace_s=0.0)
    slow = SlowKeyStop(gw.key_store.stop)
    gw.key_store.stop = slow  # type: ignore[method-assign]
    app = create_app(gw)
    entered, leave = asyncio.Event(), asyncio.Event()

    async def life() -> None:
        async with app.router.lifespan_context(app):
            entered.set()
            await leave.wait()

    task = asyncio.ensure_future(life())
    began = False
    try:
        async with asyncio.timeout(20):
            await entered.wait()
        gw.begin()  # a request in flight, ended only by the test
        began = True
        if where == "in the key poller's stop":
            leave.set()  # the lifespan's shutdown: stop_all
            async with asyncio.timeout(10):
                await slow.entered.wait()
        t_cancelled = time.monotonic()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=3 * DRAIN_S)
        took_s = time.monotonic() - t_cancelled
        assert task in done, "the stop did not end"
        assert task.cancelled()
        # the key poller's stop (0.5 s) and the steps, not DRAIN_S
        assert took_s < DRAIN_S / 2, f"the cancelled stop took {took_s:.2f} s"
        assert gw.client is not None and gw.client.is_closed  # the stop's steps ran
        assert DRAIN_CUT in caplog.messages
    finally:
        if began:
            gw.end()
        leave.set()
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=30)
        async with asyncio.timeout(30):
            await gw.stop()
