"""`kvgate serve`'s start-up messages: a port in use, a fleet that discovery will fill."""

from __future__ import annotations

import argparse
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cachecore.listen import ListenError, bind_listeners
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


def test_bind_listeners_holds_the_port_until_closed() -> None:
    port = free_port()
    socks = bind_listeners("127.0.0.1", port)
    try:
        assert [s.getsockname()[1] for s in socks] == [port]
        with pytest.raises(ListenError, match="Address already in use"):
            bind_listeners("127.0.0.1", port)
    finally:
        for s in socks:
            s.close()
    for s in bind_listeners("127.0.0.1", port):  # free again once closed
        s.close()
    with pytest.raises(ListenError):
        bind_listeners("no-such-host.invalid", port)


def test_bind_listeners_tolerates_a_host_that_resolves_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name on two /etc/hosts lines resolves to one address twice (common in containers):
    one socket for it, not a second bind that fails against the first."""
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: real(*a, **k) * 2)
    socks = bind_listeners("127.0.0.1", free_port())
    try:
        assert len(socks) == 1
    finally:
        for s in socks:
            s.close()


def test_serve_holds_its_port_from_the_check_to_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is taken before the gateway is built (its start-up can take seconds: Redis,
    replica checks) and the same sockets are what uvicorn serves on: no other process can
    take the port in between (the check used to close its probe socket again)."""
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    port = free_port()
    args = parser.parse_args(["--open", "--port", str(port)])
    monkeypatch.setattr(serve, "configure_logging", lambda *a, **k: None)
    seen: dict[str, object] = {}
    build = serve.build_gateway

    def build_while_held(*a: object, **k: object) -> object:
        with pytest.raises(ListenError, match="Address already in use"):
            bind_listeners("127.0.0.1", port)
        seen["built"] = True
        return build(*a, **k)  # type: ignore[arg-type]

    def run(self: object, sockets: list[socket.socket] | None = None) -> None:
        assert sockets is not None
        seen["served"] = [s.getsockname()[1] for s in sockets]

    monkeypatch.setattr(serve, "build_gateway", build_while_held)
    monkeypatch.setattr(serve._DrainingServer, "run", run)
    assert serve.run(args) == 0
    assert seen == {"built": True, "served": [port]}
    for s in bind_listeners("127.0.0.1", port):  # closed again after serving
        s.close()


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
        ([], "no --replica and no --discover given: no request can be served"),
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


def _serve_refusal(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """`kvgate serve ARGV`'s exit status must be 2 (it must not serve); returns what it
    wrote to stderr."""
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    args = parser.parse_args(argv)
    monkeypatch.setattr(serve, "configure_logging", lambda *a, **k: None)

    def served(self: object, sockets: object = None) -> None:
        raise AssertionError(f"kvgate serve {argv} started serving")

    monkeypatch.setattr(serve._DrainingServer, "run", served)
    assert serve.run(args) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "field"),
    [(["--port", "99999"], "port"), (["--port", "-1"], "port")],
)
def test_a_port_out_of_range_is_refused_not_wrapped(
    flags: list[str],
    field: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: `--port 99999` served on port 34463 (99999 - 65536, the socket layer's
    16-bit truncation), so a typo put the gateway on a port nobody was told about."""
    err = _serve_refusal(["--open", *flags], monkeypatch, capsys)
    assert f"{field} ({flags[0]}, KVGATE_{field.upper()})" in err


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("max_connections", 0),  # every request a PoolTimeout, then a 502, replicas failed
        ("max_body_bytes", 0),
        ("retries", -1),
        ("drain_grace_s", -1.0),
        ("policy_poll_s", 0.0),
    ],
)
def test_settings_out_of_their_range_are_refused(setting: str, value: Any) -> None:
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    with pytest.raises(ValidationError, match=setting):
        GatewaySettings(**{setting: value})


@pytest.mark.parametrize(
    "replicas",
    [
        # one id, two engines: both embedded agents would write their engine's blocks
        # under that id, while requests go to one of them
        ["r1=http://127.0.0.1:9101", "r1=http://127.0.0.1:9102"],
        ["http://127.0.0.1:9101", "http://127.0.0.1:9101/"],  # the same default id twice
    ],
)
def test_a_replica_id_declared_twice_is_refused(
    replicas: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: the second declaration of an id was dropped without a word (the pool keeps
    the first), but its embedded agent still started and wrote under the same id."""
    argv = ["--open", "--port", str(free_port())]
    for spec in replicas:
        argv += ["--replica", spec]
    err = _serve_refusal(argv, monkeypatch, capsys)
    assert "declared twice" in err, err
    assert "'r1'" in err or "'127.0.0.1-9101'" in err, err


def test_a_fractional_drain_timeout_is_kept_not_truncated() -> None:
    """Review: KVGATE_DRAIN_TIMEOUT_S=0.5 reached uvicorn as int(0.5) = 0, which cancels
    every in-flight stream at once (and 2.9 s became 2 s)."""
    from pydantic import SecretStr

    from gateway.settings import GatewaySettings

    s = GatewaySettings(open_access=True, drain_timeout_s=0.5, salt_secrets=[SecretStr("s" * 32)])
    config = serve.uvicorn_config(serve.build_gateway(s))
    assert config.timeout_graceful_shutdown == 0.5


def test_a_trace_file_that_cannot_be_written_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: `--trace-out` into a missing directory failed in the lifespan start-up: a
    FileNotFoundError traceback and uvicorn's exit 3."""
    bad = tmp_path / "missing" / "trace.jsonl"
    err = _serve_refusal(
        ["--open", "--port", str(free_port()), "--trace-out", str(bad)], monkeypatch, capsys
    )
    assert err.splitlines()[-1].startswith(f"kvgate serve: cannot write --trace-out {bad}:")


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--open", "--api-keys", "KEYS"], {}),
        (["--api-keys", "KEYS"], {"KVGATE_OPEN_ACCESS": "true"}),  # left over from a test
        (["--open", "--api-keys-redis", "--redis", "redis://127.0.0.1:1"], {}),
    ],
)
def test_open_access_with_api_keys_is_refused(
    argv: list[str],
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Review: `--open` beside `--api-keys` (or KVGATE_OPEN_ACCESS=true left in the
    environment) served every request as tenant "anonymous" without a word: the key file
    was read and ignored, and any client without a key got in."""
    from gateway.auth import hash_key

    keys = tmp_path / "keys.yaml"
    keys.write_text(f"{hash_key('sk-a')}: acme\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [str(keys) if a == "KEYS" else a for a in argv]
    err = _serve_refusal([*argv, "--port", str(free_port())], monkeypatch, capsys)
    assert err.splitlines() == [
        "kvgate serve: open access (--open, KVGATE_OPEN_ACCESS) and API keys (--api-keys, "
        "--api-keys-redis) exclude each other: with open access every request is tenant "
        "anonymous and no key is checked; pass one of them"
    ], err


@pytest.mark.parametrize("field", ["admin_key", "upstream_api_key"])
def test_a_secret_read_with_its_trailing_newline_is_trimmed(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: a key taken from a secret file keeps the file's final newline (a Kubernetes
    secret made from `echo key > f`). No HTTP header carries a newline, so no client could
    ever send that admin key (every admin call was 401 "admin key required"), and the
    upstream key put a bare newline into every request's Authorization header."""
    from gateway.settings import GatewaySettings

    monkeypatch.setenv(f"KVGATE_{field.upper()}", "s3cret-key\n")
    secret = getattr(GatewaySettings(open_access=True), field)
    assert secret.get_secret_value() == "s3cret-key"


@pytest.mark.parametrize("value", ["s3cret\x00key", "s3cret\nkey", "s3cret\x7f"])
def test_a_secret_with_a_control_character_is_refused(value: str) -> None:
    """One that no header can carry, inside the key: refused at start-up, not a gateway
    whose admin API nobody can open (or whose upstream requests are malformed)."""
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    for field in ("admin_key", "upstream_api_key"):
        kwargs: dict[str, Any] = {field: value}
        with pytest.raises(ValidationError, match="control character"):
            GatewaySettings(open_access=True, **kwargs)


def test_api_keys_in_redis_without_redis_names_the_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Review: `--api-keys-redis` without `--redis` said "api_keys_redis needs redis_url",
    field names no flag or variable of `kvgate serve` spells that way."""
    err = _serve_refusal(["--api-keys-redis", "--port", str(free_port())], monkeypatch, capsys)
    assert err.splitlines()[-1] == (
        "kvgate serve: --api-keys-redis (KVGATE_API_KEYS_REDIS) needs --redis "
        "(KVGATE_REDIS_URL): the Redis that holds the key hash <prefix>:apikeys"
    )


@pytest.mark.parametrize(
    ("secrets", "why"),
    [
        ("short", "at least 16 bytes"),
        ("0123456789abcdef0,0123456789abcdef1,0123456789abcdef2", "one or two live secrets"),
    ],
)
def test_a_bad_salt_secret_names_its_variable(
    secrets: str, why: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library's refusal ("a salt secret must be at least 16 bytes") did not say which
    setting it was about; the salt secrets have no flag, only KVGATE_SALT_SECRETS."""
    monkeypatch.setenv("KVGATE_SALT_SECRETS", secrets)
    argv = ["--open", "--replica", "r0=http://127.0.0.1:1", "--port", str(free_port())]
    err = _serve_refusal(argv, monkeypatch, capsys)
    assert err.splitlines()[-1].startswith("kvgate serve: KVGATE_SALT_SECRETS: "), err
    assert why in err


@pytest.mark.parametrize(
    ("variable", "value", "field"),
    [("KVGATE_AGENT_QUEUE_SIZE", "0", "queue_size"), ("KVGATE_AGENT_MODEL", "", "model")],
)
def test_a_bad_embedded_agent_setting_is_one_line_before_serving(
    variable: str,
    value: str,
    field: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A replica with event endpoints gets an embedded agent, whose `KVGATE_AGENT_*`
    settings were read only inside the app's start-up: a refusal was a traceback in a
    log line and uvicorn's exit 3. Now checked before serving, named like `serve`'s own."""
    monkeypatch.setenv(variable, value)
    rport, eport, pport = (free_port() for _ in range(3))
    spec = f"r1=http://127.0.0.1:{rport}=tcp://127.0.0.1:{eport},tcp://127.0.0.1:{pport}"
    err = _serve_refusal(["--open", "--replica", spec], monkeypatch, capsys)
    # (only serve's own lines: an earlier test's log handler may write here too)
    said = [line for line in err.splitlines() if line.startswith("kvgate serve")]
    assert len(said) == 1, err
    assert said[0].startswith(f"kvgate serve: {field} ({variable}): "), err
    assert "Value error" not in said[0]
