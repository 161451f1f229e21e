"""``GatewayServer``: the gateway on its own thread and event loop (the Python API's
synchronous form, ``gateway/serve.py``'s module docstring).

Its ``stop()`` waited a fixed 30 s for the server's thread and returned in silence with the
thread still stopping (a stop at the defaults may take longer: drain 30 s, up to 2 s for
cut requests, then its steps), so the caller went on beside a gateway still draining and
holding its port. Now ``stop()`` waits for the thread to end, or raises ``TimeoutError``
after an explicit ``timeout_s`` with the thread still running, and a later ``stop()`` waits
again.

Real pieces: the gateway's own server on a free loopback port in its own thread, real HTTP
requests, the app's lifespan. Fault injected by a fake named as such: ``SlowStop`` over
``Gateway.stop`` (a stop step that takes a while)."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.core import Gateway
from gateway.serve import GatewayServer
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET

pytestmark = pytest.mark.timeout(60)

SLOW_STOP_S = 2.0


def settings() -> GatewaySettings:
    return GatewaySettings(
        open_access=True,
        salt_secrets=[SecretStr(SECRET)],
        host="127.0.0.1",
        port=free_port(),
        drain_timeout_s=1.0,
        drain_grace_s=0.0,
    )


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


class SlowStop:
    """A fake for fault injection over ``Gateway.stop``: the real stop after ``delay_s``."""

    def __init__(self, gw: Gateway, delay_s: float) -> None:
        self.real = gw.stop
        self.delay_s = delay_s
        self.ran = False

    async def __call__(self) -> None:
        await asyncio.sleep(self.delay_s)
        await self.real()
        self.ran = True


def test_serves_and_stops_with_its_thread() -> None:
    s = settings()
    with GatewayServer(s) as srv:
        assert srv.url == f"http://127.0.0.1:{s.port}"
        r = httpx.get(f"{srv.url}/health", timeout=5.0)
        assert r.status_code == 200, r.text
        thread = srv._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
    assert port_closed(s.port)


def test_stop_waits_for_a_slow_stop() -> None:
    s = settings()
    srv = GatewayServer(s).start()
    slow = SlowStop(srv.gateway, SLOW_STOP_S)
    srv.gateway.stop = slow  # type: ignore[method-assign]
    thread = srv._thread
    assert thread is not None
    t0 = time.monotonic()
    srv.stop()
    took = time.monotonic() - t0
    assert slow.ran, "stop() returned before the gateway's stop ran"
    assert not thread.is_alive()
    assert took >= SLOW_STOP_S * 0.9, took
    assert port_closed(s.port)


def test_stop_with_a_timeout_raises_while_the_thread_runs_then_waits_again() -> None:
    s = settings()
    srv = GatewayServer(s).start()
    slow = SlowStop(srv.gateway, SLOW_STOP_S)
    srv.gateway.stop = slow  # type: ignore[method-assign]
    thread = srv._thread
    assert thread is not None
    with pytest.raises(TimeoutError, match="still stopping"):
        srv.stop(timeout_s=0.2)
    assert thread.is_alive() and not slow.ran
    srv.stop(timeout_s=30.0)  # the same thread, waited for again
    assert slow.ran and not thread.is_alive()
    srv.stop()  # stopped: nothing to wait for
