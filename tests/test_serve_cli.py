"""`kvgate serve`'s start-up messages: a port in use, a fleet that discovery will fill."""

from __future__ import annotations

import argparse
import logging
import socket
import subprocess
import sys

import pytest

from cachecore.testing import free_port
from gateway import serve


def test_serve_on_a_port_in_use_says_so_in_one_line_and_exits_2() -> None:
    """Like `kvgate agent`: one line naming the address, exit 2 (it was uvicorn's
    "[Errno 98] ..." log line and exit 3)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--open", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"kvgate serve: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "pick another --port (KVGATE_PORT) or stop what holds it"
    ]


def test_listen_problem_is_none_for_a_free_port() -> None:
    assert serve.listen_problem("127.0.0.1", free_port()) is None
    assert serve.listen_problem("127.0.0.1", 0) is None


def _start_up_records(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> list[logging.LogRecord]:
    """The records `kvgate serve ARGV` logs up to the point it would start serving."""
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args([*argv, "--open", "--port", str(free_port())])
    monkeypatch.setattr(serve, "configure_logging", lambda *a, **k: None)  # keep caplog's
    monkeypatch.setattr(serve._DrainingServer, "run", lambda self, sockets=None: None)
    caplog.set_level(logging.INFO, logger="gateway.serve")
    assert serve.run(args) == 0
    return [r for r in caplog.records if r.name == "gateway.serve"]


def test_discovery_with_an_allowlist_is_not_told_every_request_gets_503(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    records = _start_up_records(
        ["--redis", "redis://127.0.0.1:1", "--discover", "--allow", "r2=http://10.0.0.2:8000"],
        monkeypatch,
        caplog,
    )
    assert not [r for r in records if r.levelno >= logging.WARNING]
    assert any("replicas come from discovery" in r.getMessage() for r in records)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "no --replica and no --discover given: every request will get 503"),
        (
            ["--redis", "redis://127.0.0.1:1", "--discover"],
            "discovery rejects every registration",
        ),
    ],
)
def test_a_gateway_that_can_get_no_replica_warns(
    argv: list[str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    records = _start_up_records(argv, monkeypatch, caplog)
    assert [r.getMessage() for r in records if r.levelno == logging.WARNING and says in r.msg]
