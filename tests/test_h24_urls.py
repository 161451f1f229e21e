"""One way to put a host into a URL (cachecore.urls.url_host), used by every component that
wrote one: the gateway's "serving" line, its upstream Host header, a replica's URL and the
agent's printed URL each bracketed IPv6 literals on their own, with differences at the edges
(one stripped brackets first, none knew of zone ids).

A zone id (``fe80::1%eth0``) is written three ways, as each reader needs it: RFC 6874's
``%25`` in URLs shown to people (curl takes it), bare in URLs kvgate fetches with httpx
(httpx 0.29 hands the host to getaddrinfo undecoded: ``%25`` fails), dropped in a Host header
(RFC 6874 section 4). The real-socket tests use ``::1`` with the loopback's numeric zone (glibc
takes an interface name as zone for link-local addresses only)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from cachecore.replica.settings import ReplicaPorts, ReplicaSettings, endpoints_for
from cachecore.testing import free_ports
from cachecore.urls import url_host
from gateway.upstream import LeanTransport
from tests.test_h24_agent_http import needs_ipv6
from tests.test_upstream import TIMEOUTS, json_answer, read_request


@pytest.mark.parametrize(
    ("host", "encoded", "bare", "dropped"),
    [
        ("10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.1"),
        ("replica-0.svc", "replica-0.svc", "replica-0.svc", "replica-0.svc"),
        ("::1", "[::1]", "[::1]", "[::1]"),
        ("::ffff:10.0.0.1", "[::ffff:10.0.0.1]", "[::ffff:10.0.0.1]", "[::ffff:10.0.0.1]"),
        ("[::1]", "[::1]", "[::1]", "[::1]"),  # already bracketed (a replica's --host)
        ("fe80::1%eth0", "[fe80::1%25eth0]", "[fe80::1%eth0]", "[fe80::1]"),
        # a URL's host: bracketed, its zone encoded or (RFC 6874's convenience) bare
        ("[fe80::1%25eth0]", "[fe80::1%25eth0]", "[fe80::1%eth0]", "[fe80::1]"),
        ("[fe80::1%eth0]", "[fe80::1%25eth0]", "[fe80::1%eth0]", "[fe80::1]"),
        # a numeric zone as a socket API writes it (%25 is scope 25, not an encoded %):
        # tests/test_h26_zone_ids.py, since its bare form is refused
    ],
)
def test_url_host(host: str, encoded: str, bare: str, dropped: str) -> None:
    assert url_host(host) == encoded
    assert url_host(host, zone="bare") == bare
    assert url_host(host, zone="dropped") == dropped
    assert url_host(encoded) == encoded  # idempotent: a URL's host stays as it is


def _loopback_zone() -> str:
    """``::1`` with the loopback's zone, as a socket API writes it."""
    return f"::1%{socket.if_nametoindex('lo')}"


needs_lo = pytest.mark.skipif(
    not hasattr(socket, "if_nametoindex") or sys.platform != "linux",
    reason="the loopback zone is looked up by the name 'lo' (Linux)",
)


@needs_ipv6
@needs_lo
async def test_the_gateway_sends_no_zone_id_in_the_host_header() -> None:
    """A replica URL with a zone id: the upstream transport connects through it and sends
    ``Host: [::1]:PORT``; it sent the zone id (``[::1%1]``), which has no meaning beyond the
    sender (RFC 6874 section 4; curl drops it too)."""
    heads: list[bytes] = []

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await read_request(reader))
        writer.write(json_answer(b"{}"))
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(on_conn, "::1", 0)
    port = srv.sockets[0].getsockname()[1]
    t = LeanTransport()
    try:
        base = f"http://{url_host(_loopback_zone(), zone='bare')}:{port}"
        resp = await t.post(base, "/x", [], b"{}", TIMEOUTS)
        assert await resp.aread() == b"{}"
        await resp.aclose()
    finally:
        await t.aclose()
        srv.close()
        await srv.wait_closed()
    assert f"\r\nhost: [::1]:{port}\r\n".encode() in heads[0].lower(), heads[0]


@needs_ipv6
@needs_lo
async def test_a_replica_url_with_a_zone_id_is_one_httpx_fetches() -> None:
    """endpoints_for's URL is fetched with httpx (the fleet's readiness wait, a gateway):
    a zone id stays bare there, whether the replica's --host was bracketed or not, and
    encoded or not (an encoded one, kept as given, failed to connect)."""
    srv = await asyncio.start_server(_answer_once, "::1", 0)
    port = srv.sockets[0].getsockname()[1]
    zone = _loopback_zone()
    ports = ReplicaPorts(http=port, events=1, replay=2)
    address, _, index = zone.partition("%")
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            for host in (zone, f"[{zone}]", f"[{address}%25{index}]"):
                ep = endpoints_for(ReplicaSettings(host=host), 0, ports)
                assert ep.url == f"http://[{zone}]:{port}", host
                assert (await client.get(f"{ep.url}/health")).status_code == 200
    finally:
        srv.close()
        await srv.wait_closed()


async def _answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(reader)
    writer.write(json_answer(b"{}"))
    await writer.drain()
    writer.close()


@needs_ipv6
@needs_lo
def test_the_agent_cli_prints_a_zone_id_as_a_url_carries_it() -> None:
    """`kvgate agent --http-host ::1%1` printed ``http://[::1%1]:PORT``; a URL carries the
    zone's ``%`` encoded (RFC 6874), as curl reads it: ``http://[::1%251]:PORT``."""
    zone = _loopback_zone()
    (redis,) = free_ports(1)  # nothing listens there: the agent waits, /health answers
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r0",
            "--engine-url", "http://127.0.0.1:9", "--events", "tcp://127.0.0.1:9",
            "--redis", f"redis://127.0.0.1:{redis}/0", "--http-host", zone,
            "--http-port", "0", "--gc-freeze-interval", "0",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        address, _, index = zone.partition("%")
        assert line.startswith(f"agent r0: http://[{address}%25{index}]:"), (line, proc.poll())
        url = line.split(": ", 1)[1]
        if shutil.which("curl") is not None:  # the printed URL works as printed
            out = subprocess.run(
                ["curl", "-gsS", "-m", "5", f"{url}/health"], capture_output=True, text=True
            )
            assert '"status":"starting"' in out.stdout, out
        # the same address and zone, as httpx takes them
        port = int(url.rsplit(":", 1)[1])
        resp = httpx.get(f"http://[{zone}]:{port}/health", timeout=5.0)
        assert resp.status_code == 503 and resp.json()["status"] == "starting"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
