"""``bind_listeners`` (the agent's, the gateway's and the replica's listening sockets) skips
an address the host does not have when another one binds: Docker's /etc/hosts lists
``::1 localhost`` even where IPv6 is disabled (bind(::1) is EADDRNOTAVAIL), and
``kvgate agent --http-host localhost`` exited 2 "Cannot assign requested address" there.

The resolver is a fake (``_fake_resolver``, a fault injection) naming a documentation
address no host has beside 127.0.0.1; the sockets and connections are real, on loopback."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from cachecore.agent import Agent
from cachecore.agent.http import AgentHTTPServer
from cachecore.index.memory import MemoryIndex
from cachecore.listen import ListenError, bind_listeners
from tests.test_agent_helpers import Rig

NOT_HERE_V6 = "2001:db8::1"  # RFC 3849 documentation: assigned to no host
NOT_HERE_V4 = "192.0.2.1"  # RFC 5737 TEST-NET-1


def _fake_resolver(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
    """Fault injection: ``localhost`` resolves to ``addresses``, in that order (each through
    the real getaddrinfo, so the entries are what the C library gives for them)."""
    real: Callable[..., list[Any]] = socket.getaddrinfo

    def resolve(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if host != "localhost":
            return real(host, port, *args, **kwargs)
        return [info for a in addresses for info in real(a, port, *args, **kwargs)]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def _unassignable(address: str) -> bool:
    """Whether binding ``address`` here fails as the fix expects (EADDRNOTAVAIL)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
    except OSError as exc:
        return exc.errno == 99 or exc.strerror == "Cannot assign requested address"
    return False


@pytest.fixture
def listening() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def _reachable(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0):
        pass


@pytest.mark.parametrize("first", [True, False], ids=["missing-first", "missing-last"])
@pytest.mark.parametrize("missing", [NOT_HERE_V6, NOT_HERE_V4])
def test_an_address_the_host_lacks_is_skipped_and_logged(
    missing: str,
    first: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    listening: list[socket.socket],
) -> None:
    if not _unassignable(missing):
        pytest.skip(f"{missing} is not EADDRNOTAVAIL on this host")
    order = (missing, "127.0.0.1") if first else ("127.0.0.1", missing)
    _fake_resolver(monkeypatch, *order)
    with caplog.at_level(logging.WARNING, logger="cachecore.listen"):
        listening.extend(bind_listeners("localhost", 0))
    assert [s.getsockname()[0] for s in listening] == ["127.0.0.1"]
    _reachable(listening[0].getsockname()[1])
    assert [r.getMessage() for r in caplog.records] == [
        f"not listening on {missing}: Cannot assign requested address "
        "(listening on the host's other addresses)"
    ]


def test_a_fixed_port_is_kept_and_other_failures_still_refuse(
    monkeypatch: pytest.MonkeyPatch, listening: list[socket.socket]
) -> None:
    if not _unassignable(NOT_HERE_V4):
        pytest.skip(f"{NOT_HERE_V4} is not EADDRNOTAVAIL on this host")
    _fake_resolver(monkeypatch, NOT_HERE_V4, "127.0.0.1")
    listening.extend(bind_listeners("127.0.0.1", 0))
    port = listening[0].getsockname()[1]
    # the port in use on the address the host has: refused, not skipped
    with pytest.raises(ListenError, match="Address already in use"):
        bind_listeners("localhost", port)
    listening.pop().close()
    listening.extend(bind_listeners("localhost", port))
    assert [s.getsockname() for s in listening] == [("127.0.0.1", port)]
    # no address of it on this host: refused with the reason
    _fake_resolver(monkeypatch, NOT_HERE_V4)
    with pytest.raises(ListenError, match="Cannot assign requested address"):
        bind_listeners("localhost", 0)


async def test_the_agent_listens_on_localhost_where_one_address_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kvgate agent --http-host localhost``'s server: refused to start; now serves."""
    missing = NOT_HERE_V6 if _unassignable(NOT_HERE_V6) else NOT_HERE_V4
    if not _unassignable(missing):
        pytest.skip("no unassignable address on this host")
    _fake_resolver(monkeypatch, missing, "127.0.0.1")
    rig = Rig(MemoryIndex())
    agent: Agent = await rig.start()
    server = AgentHTTPServer([agent], "localhost", 0)
    try:
        await server.start()
        async with httpx.AsyncClient(timeout=5.0) as client:
            resp = await client.get(f"http://127.0.0.1:{server.port}/health")
        assert resp.status_code == 200 and resp.json()["replica"] == "r0"
    finally:
        await server.stop()
        await rig.close()
