"""A plain SIGTERM stop of ``kvgate serve`` drains once: grace + drain timeout, not grace +
twice the drain timeout.

uvicorn's shutdown waits for the requests in flight up to ``timeout_graceful_shutdown``
(``KVGATE_DRAIN_TIMEOUT_S``), cuts those still running, then runs the lifespan shutdown,
whose ``Gateway.stop`` drained again for up to ``KVGATE_DRAIN_TIMEOUT_S``: a request slow to
end after its cut (a handler whose clean-up awaits, or that ignores its cancellation) made
the stop last grace + 2 x timeout, past the worst case docs/gateway.md gives (and the
``terminationGracePeriodSeconds`` advice built on it). Now the server sets one drain
deadline as its wait begins (``Gateway.drain_until``): the stop's drain gets what is left of
it plus ``serve.CUT_END_S`` for the cut requests to end. Pins beside it: a cut request that
ends within ``CUT_END_S`` is still waited for (its 503), and an embedded ``Gateway.stop()``
with no server still drains for its full timeout.

Real pieces: the gateway's own server in the test's loop (``_InLoopServer``, free loopback
port, the hot path, uvicorn's shutdown and the app's lifespan), a real HTTP request, the
SIGTERM through ``_DrainingServer.handle_exit`` (what the signal handler calls). Fault
injected by a fake named as such: ``SlowToEndPrepare`` over ``Gateway.prepare``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway import serve
from gateway.core import Gateway
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET

pytestmark = pytest.mark.timeout(90)

GRACE_S = 0.3  # KVGATE_DRAIN_GRACE_S (1 s by default)
DRAIN_S = 6.0  # KVGATE_DRAIN_TIMEOUT_S, patched down (30 s); the margin is DRAIN_S / 2
CUT_END_S = 0.3  # serve.CUT_END_S, patched down (2 s)
DRAIN_TIMEOUT = "drain timeout: closing with requests in flight"
CUT_BY_UVICORN = "Cancel 1 running task(s), timeout graceful shutdown exceeded"


def gateway(drain_s: float = DRAIN_S, grace_s: float = GRACE_S) -> Gateway:
    settings = GatewaySettings(
        open_access=True,
        salt_secrets=[SecretStr(SECRET)],
        host="127.0.0.1",
        port=free_port(),
        drain_timeout_s=drain_s,
        drain_grace_s=grace_s,
    )
    return serve.build_gateway(settings)


class SlowToEndPrepare:
    """A fake for fault injection over ``Gateway.prepare``: the request counts as in flight
    (``prepare`` runs after ``Gateway.begin``) and waits; cut, it takes ``end_s`` more to
    end (at most), or until ``release``, then ends as cut."""

    def __init__(self, end_s: float) -> None:
        self.end_s = end_s
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.cut = False

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        self.entered.set()
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            self.cut = True
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.end_s):
                    await self.release.wait()
            raise
        raise AssertionError("the request was never cut")


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def sigterm_stop(
    gw: Gateway, slow: SlowToEndPrepare
) -> tuple[float, int, httpx.Response | BaseException]:
    """Serve ``gw`` in this loop, a request in flight through ``slow``, then SIGTERM: the
    seconds from the SIGTERM to the server's end, the requests still in flight then, and the
    request's answer (or its error). Everything started is stopped in the end."""
    gw.prepare = slow  # type: ignore[method-assign]
    server = serve._InLoopServer(
        serve.uvicorn_config(gw, loop="none"), gw, drain_grace_s=gw.settings.drain_grace_s
    )
    serving = asyncio.ensure_future(server.serve())
    request: asyncio.Future[httpx.Response] | None = None
    try:
        await until(lambda: server.started or serving.done(), "the server did not start", 20)
        assert server.started, serving.result()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.settings.port}") as h:
            body = {"model": "m", "prompt": "hello", "max_tokens": 1}
            request = asyncio.ensure_future(h.post("/v1/completions", json=body, timeout=60))
            async with asyncio.timeout(10):
                await slow.entered.wait()
            assert gw.in_flight == 1
            t_signal = time.monotonic()
            server.handle_exit(signal.SIGTERM, None)  # a plain stop: grace, then the drain
            done, _ = await asyncio.wait({serving}, timeout=4 * DRAIN_S)
            took_s = time.monotonic() - t_signal
            assert serving in done, "the stop did not end"
            serving.result()
            in_flight = gw.in_flight
            slow.release.set()
            await asyncio.wait({request}, timeout=10)
            answer: httpx.Response | BaseException
            try:
                answer = request.result()
            except Exception as exc:  # the server gone before the cut request answered
                answer = exc
            return took_s, in_flight, answer
    finally:
        slow.release.set()
        if not serving.done():
            server.force_exit = True
            gw.cut_drain()
            await asyncio.wait({serving}, timeout=30)
        if request is not None and not request.done():
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
        async with asyncio.timeout(30):
            await gw.stop()


async def test_a_sigterm_stop_drains_once_for_a_request_slow_to_end_after_its_cut(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn waits DRAIN_S and cuts the request, which takes 30 s to end after it: the
    stop ends CUT_END_S after that, not DRAIN_S more: about 6.7 s from the SIGTERM; grace
    + 2 x DRAIN_S (~12.4 s) before the change."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(serve, "CUT_END_S", CUT_END_S, raising=False)
    gw = gateway()
    slow = SlowToEndPrepare(end_s=30)
    took_s, in_flight, _ = await sigterm_stop(gw, slow)
    observed = {
        "grace": "draining before stopping" in caplog.messages,
        "cut": slow.cut,
        "cut by uvicorn's drain timeout": CUT_BY_UVICORN in caplog.messages,
        "in flight at the stop's end": in_flight,  # it ignored its cut
        "drain timeout logged": [
            getattr(r, "n", None) for r in caplog.records if r.getMessage() == DRAIN_TIMEOUT
        ],
        "lifespan shutdown ran": "Application shutdown complete." in caplog.messages,
        "stopped": gw.client is not None and gw.client.is_closed,
        # the grace and uvicorn's full wait still come first
        "waited the grace and the drain": took_s >= GRACE_S + DRAIN_S - 0.1,
        # then CUT_END_S and the steps (milliseconds); it was a second DRAIN_S
        "then stopped within DRAIN_S / 2": took_s < GRACE_S + DRAIN_S + DRAIN_S / 2,
    }
    assert observed == {
        "grace": True,
        "cut": True,
        "cut by uvicorn's drain timeout": True,
        "in flight at the stop's end": 1,
        "drain timeout logged": [1],
        "lifespan shutdown ran": True,
        "stopped": True,
        "waited the grace and the drain": True,
        "then stopped within DRAIN_S / 2": True,
    }, f"SIGTERM to the stop's end: {took_s:.2f} s"


async def test_a_sigterm_stop_still_waits_for_a_cut_request_that_ends_soon(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cut request that takes 0.5 s to end, within CUT_END_S (patched 3 s): the stop
    waits for it, so it answers its 503 ``draining`` before the gateway closes (a pin: the
    behaviour before the change, which waited up to DRAIN_S more)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(serve, "CUT_END_S", 3.0, raising=False)
    gw = gateway(drain_s=1.0)
    slow = SlowToEndPrepare(end_s=0.5)
    took_s, in_flight, answer = await sigterm_stop(gw, slow)
    assert isinstance(answer, httpx.Response), answer
    observed = {
        "cut": slow.cut,
        "in flight at the stop's end": in_flight,
        "answer": (answer.status_code, answer.json()["error"]["code"]),
        "drain timeout logged": DRAIN_TIMEOUT in caplog.messages,
        "within grace + drain + its 0.5 s + 2 s": took_s < GRACE_S + 1.0 + 0.5 + 2.0,
    }
    assert observed == {
        "cut": True,
        "in flight at the stop's end": 0,
        "answer": (503, "draining"),
        "drain timeout logged": False,
        "within grace + drain + its 0.5 s + 2 s": True,
    }, f"SIGTERM to the stop's end: {took_s:.2f} s"


async def test_an_embedded_stop_with_no_server_still_drains_for_its_full_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``Gateway.stop()`` called by its embedder (no uvicorn, no drain_until): a request in
    flight that never ends holds it for the whole drain timeout (a pin)."""
    caplog.set_level(logging.WARNING)
    drain_s = 1.5
    gw = gateway(drain_s=drain_s, grace_s=0.0)
    await gw.start()
    began = False
    try:
        gw.begin()
        began = True
        t0 = time.monotonic()
        async with asyncio.timeout(20):
            await gw.stop()
        took_s = time.monotonic() - t0
        assert drain_s - 0.05 <= took_s < drain_s + 5.0, took_s
        assert DRAIN_TIMEOUT in caplog.messages
    finally:
        if began:
            gw.end()
        async with asyncio.timeout(30):
            await gw.stop()
