"""`kvgate agent` and `kvgate tokenizer` refusals: one line on stderr, exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cachecore.testing import free_ports


def test_an_agent_that_cannot_listen_deregisters_nothing() -> None:
    """With its --http-port taken, `kvgate agent` printed its one line and exit 2, then
    logged "deregistration failed" (a Redis call, here to a port nothing listens on) for a
    registration it never made: stderr is that one line only."""
    http, redis = free_ports(2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", http))
        holder.listen()
        proc = subprocess.run(
            [
                sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r0",
                "--engine-url", "http://127.0.0.1:9", "--events", "tcp://127.0.0.1:9",
                "--redis", f"redis://127.0.0.1:{redis}/0", "--http-port", str(http),
            ],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        f"kvgate agent: cannot listen on 127.0.0.1:{http} (Address already in use); "
        "give each agent on a host its own --http-port"
    ]


def test_an_export_the_write_refuses_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvgate tokenizer --export /proc/x` run as root passed the up-front check (root may
    write anywhere, says access()) and was a mkdir traceback, exit 1; so is any directory
    the write itself refuses, here one holding a directory named tokenizer.json."""
    from gateway.cli import main

    (tmp_path / "tokenizer.json").mkdir()
    assert main(["tokenizer", "--export", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        f"kvgate tokenizer: error: cannot write --export {tmp_path}: Is a directory"
    ]


def test_an_agent_http_host_it_cannot_bind_is_not_blamed_on_the_port() -> None:
    """An --http-host the agent cannot listen on (here a name that does not resolve; it was
    `::1` too while the socket was IPv4 only) said "...; give each agent on a host its own
    --http-port": the advice for a port in use, sending the operator after the wrong flag."""
    (redis,) = free_ports(1)
    proc = subprocess.run(
        [
            sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r0",
            "--engine-url", "http://127.0.0.1:9", "--events", "tcp://127.0.0.1:9",
            "--redis", f"redis://127.0.0.1:{redis}/0", "--http-host", "no-such-host.invalid",
            "--http-port", "0",
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    # the resolver's reason varies ("Name or service not known", "... name resolution")
    assert line.startswith("kvgate agent: cannot listen on no-such-host.invalid:0 ("), line
    assert line.endswith("); --http-host (KVGATE_AGENT_HTTP_HOST) takes an address or a name"), line
