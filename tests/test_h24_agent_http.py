"""The agent's HTTP listener on every address its ``--http-host`` resolves to (it was one
AF_INET socket: ``::1`` failed, a name with an IPv6 address listened on IPv4 only), and port
0 ("pick a free one") as one port on every address, for the agent, the gateway and the
replica alike (``bind_listeners``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from cachecore.agent import Agent
from cachecore.agent.http import AgentHTTPServer
from cachecore.index.memory import MemoryIndex
from cachecore.listen import ListenError, bind_listeners
from cachecore.testing import free_ports
from tests.test_agent_helpers import Rig


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="this host has no IPv6 loopback (::1 cannot be bound)"
)


def _localhost_on_both_families(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake resolver for fault-free set-up: ``localhost`` resolves to 127.0.0.1 and ::1,
    as most hosts' /etc/hosts say (this one may list only one); the sockets are real."""
    real: Callable[..., list[Any]] = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "localhost":
            return real(host, port, *args, **kwargs)
        return real("127.0.0.1", port, *args, **kwargs) + real("::1", port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    rig = Rig(MemoryIndex())
    try:
        yield await rig.start()
    finally:
        await rig.close()


async def _health(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        resp = await client.get(f"{url}/health")
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


@needs_ipv6
async def test_the_agent_serves_on_ipv6_loopback(agent: Agent) -> None:
    """`--http-host ::1` was "Address family for hostname not supported" (an AF_INET
    socket): an IPv6-only pod had no agent endpoints."""
    server = AgentHTTPServer([agent], "::1", 0)
    await server.start()
    try:
        assert (await _health(f"http://[::1]:{server.port}"))["replica"] == "r0"
    finally:
        await server.stop()


@needs_ipv6
async def test_localhost_with_port_0_is_one_port_on_every_address(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name with an IPv4 and an IPv6 address: the agent listened on IPv4 only; now on
    both, on the one port it reports."""
    _localhost_on_both_families(monkeypatch)
    server = AgentHTTPServer([agent], "localhost", 0)
    await server.start()
    try:
        for url in (f"http://127.0.0.1:{server.port}", f"http://[::1]:{server.port}"):
            assert (await _health(url))["status"] == "ok", url
    finally:
        await server.stop()


@needs_ipv6
@pytest.mark.parametrize("host", ["", "localhost"])
def test_bind_listeners_port_0_picks_one_port_for_every_address(
    host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each address picked its own free port: ``""`` (0.0.0.0 and ::) or ``localhost``
    listened on two ports, and a server reports one of them."""
    _localhost_on_both_families(monkeypatch)
    for _ in range(5):  # the kernel's pick varies: a few of them
        socks = bind_listeners(host, 0)
        try:
            assert {s.family for s in socks} == {socket.AF_INET, socket.AF_INET6}
            ports = {s.getsockname()[1] for s in socks}
            assert len(ports) == 1 and 0 not in ports, [s.getsockname() for s in socks]
        finally:
            for s in socks:
                s.close()


def test_bind_listeners_still_refuses_a_fixed_port_in_use() -> None:
    """The one-port rule for port 0 does not turn a taken fixed port into a retry."""
    socks = bind_listeners("127.0.0.1", 0)
    try:
        port = socks[0].getsockname()[1]
        with pytest.raises(ListenError, match="Address already in use"):
            bind_listeners("127.0.0.1", port)
    finally:
        for s in socks:
            s.close()


@needs_ipv6
def test_the_agent_cli_prints_a_usable_ipv6_url() -> None:
    """`kvgate agent --http-host ::1` listens there and prints its URL bracketed
    (``http://::1:9400`` is no URL)."""
    (redis,) = free_ports(1)  # nothing listens there: the agent waits, /health answers
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r0",
            "--engine-url", "http://127.0.0.1:9", "--events", "tcp://127.0.0.1:9",
            "--redis", f"redis://127.0.0.1:{redis}/0", "--http-host", "::1",
            "--http-port", "0", "--gc-freeze-interval", "0",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("agent r0: http://[::1]:"), (line, proc.poll())
        url = line.split(": ", 1)[1]
        resp = httpx.get(f"{url}/health", timeout=5.0)
        assert resp.status_code == 503 and resp.json()["status"] == "starting"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
