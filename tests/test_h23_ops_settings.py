"""`kvgate serve` settings an operator gets wrong: one clear line, exit 2, nothing started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from cachecore.argtypes import settings_error
from gateway.cli import main
from gateway.settings import GatewaySettings


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_not_every_interface(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVGATE_HOST=` (a template's unset variable) or `--host ''` listened on 0.0.0.0 and
    [::]: the gateway, loopback-only by default, was open on every interface without
    anyone asking for it. Refused, naming the explicit way."""
    with pytest.raises(ValidationError) as info:
        GatewaySettings(host=host)
    assert "host (KVGATE_HOST): empty" in settings_error(info.value)
    monkeypatch.setenv("KVGATE_HOST", host)
    with pytest.raises(ValidationError):
        GatewaySettings()
    assert main(["serve", "--open", "--port", "0", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvgate serve: host (--host, KVGATE_HOST): empty: give 0.0.0.0 (or ::) to listen on"
        " every interface"
    ]


@pytest.mark.parametrize("name", ["KVGATE_DRAIN_GRACE_S", "KVGATE_POLICY_POLL_S"])
@pytest.mark.parametrize("value", ["inf", "Infinity", "1e400"])
def test_an_infinite_grace_or_poll_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_DRAIN_GRACE_S=inf` was accepted and a SIGTERM then never stopped the gateway
    (it answered 503 `draining` until killed); `KVGATE_POLICY_POLL_S=inf` started a policy
    watcher that slept forever, so file edits were silently never applied."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert f"({name}): Input should be a finite number" in settings_error(info.value)


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("bad", "URL scheme must be http or https: 'bad'"),
        ("r 0=http://127.0.0.1:9100", "invalid replica id 'r 0'"),
        ("http://", "URL has no host"),
    ],
)
def test_a_bad_allowlist_entry_is_one_line_and_exit_2(
    entry: str, problem: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvgate serve --discover --allow bad` (or KVGATE_REPLICA_ALLOWLIST=bad) passed the
    settings and failed inside the app's start-up, where discovery builds its allowlist:
    a traceback in the log (InvalidURLError) and uvicorn's exit 3."""
    monkeypatch.setenv("KVGATE_REPLICA_ALLOWLIST", entry)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert problem in settings_error(info.value)
    monkeypatch.delenv("KVGATE_REPLICA_ALLOWLIST")
    args = ["serve", "--open", "--port", "0", "--redis", "redis://127.0.0.1:1/0"]
    assert main([*args, "--discover", "--allow", entry]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and problem in lines[0] and "KVGATE_REPLICA_ALLOWLIST" in lines[0]
    assert "--allow" in lines[0]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://127.0.0.1:abc/0", "Port could not be cast to integer value as 'abc'"),
        ("redis://127.0.0.1:6379/x", "database must be a number"),
        ("http://127.0.0.1:6379", "Redis URL must specify one of the following schemes"),
    ],
)
def test_a_bad_redis_url_names_its_setting(
    url: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvgate serve --redis redis://host:abc/0` said only "Port could not be cast to
    integer value as 'abc'" (redis-py's words), which reads as a problem with --port; the
    agent's --redis too. Refused by the settings now, naming the setting."""
    assert main(["serve", "--open", "--port", "0", "--redis", url]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("kvgate serve: redis_url (--redis, KVGATE_REDIS_URL): ")
    assert problem in last
    args = ["agent", "--replica-id", "r0", "--engine-url", "http://127.0.0.1:9"]
    assert main([*args, "--events", "tcp://127.0.0.1:9", "--redis", url]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "redis (--redis, KVGATE_AGENT_REDIS): " in last and problem in last


def test_a_misspelled_setting_is_warned_about_with_the_name_meant() -> None:
    """`KVGATE_POLICY_FILE=isolation-strict.yaml` (for KVGATE_POLICY) was ignored without a
    word by pydantic-settings: the gateway served the default policy, none of the strict
    one's isolation or limits. Each KVGATE_* variable no kvgate settings read is now a
    start-up warning naming the nearest setting; the agents' and replicas' are known."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVGATE_")}
    env.update(
        KVGATE_POLICY_FILE="policies/isolation-strict.yaml",
        kvgate_admin_keyy="x",  # names are read case-insensitively
        KVGATE_AGENT_REMOVAL_LOG="1000",  # the embedded agents' setting
        KVGATE_REPLICA_PROFILE="8b-h100",  # kvgate replica's
        KVGATE_TRACE_DIR="/tmp",  # the load tools'
    )
    with socket.socket() as held:  # a port in use: serve stops right after its start-up lines
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--open", "--plain-logs",
             "--port", str(port)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "no kvgate setting" in line]
    assert len(warnings) == 2, proc.stderr
    assert warnings[0].endswith(
        "KVGATE_POLICY_FILE is no kvgate setting: ignored; did you mean KVGATE_POLICY?"
    )
    assert warnings[1].endswith("did you mean KVGATE_ADMIN_KEY?")


@pytest.mark.parametrize("value", ["", "\n", "  \n"])
def test_an_empty_upstream_api_key_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVGATE_UPSTREAM_API_KEY from a secret mounted empty (or holding only its newline)
    was accepted and sent to every replica as `authorization: Bearer `: an engine run with
    --api-key answered every request 401. Refused at start-up, naming the variable."""
    monkeypatch.setenv("KVGATE_UPSTREAM_API_KEY", value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert "upstream_api_key (KVGATE_UPSTREAM_API_KEY): empty" in settings_error(info.value)
    monkeypatch.setenv("KVGATE_UPSTREAM_API_KEY", "sk-engine\n")  # a key file's newline
    secret = GatewaySettings().upstream_api_key
    assert secret is not None and secret.get_secret_value() == "sk-engine"


@pytest.mark.parametrize(
    ("variable", "flag"),
    [
        ("KVGATE_POLICY", "--policy"),
        ("KVGATE_API_KEYS_FILE", "--api-keys"),
        ("KVGATE_TRACE_OUT", "--trace-out"),
    ],
)
def test_an_empty_path_is_refused_as_empty(
    variable: str,
    flag: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An empty path (`KVGATE_POLICY=` from a template's unset variable, or `--policy ''`)
    was the path '.': "invalid policy .: Is a directory", "cannot write --trace-out .", and
    with --open an empty KVGATE_API_KEYS_FILE read as a key file: "open access and API
    keys exclude each other". Each now says the value is empty."""
    field = variable.removeprefix("KVGATE_").lower()
    expected = [
        f"kvgate serve: {field} ({flag}, {variable}): empty: give a file, or unset the variable"
    ]
    monkeypatch.setenv(variable, "")
    assert main(["serve", "--open", "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == expected
    monkeypatch.delenv(variable)
    assert main(["serve", "--open", "--port", "0", flag, ""]) == 2
    assert capsys.readouterr().err.splitlines() == expected


def test_an_empty_redis_url_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVGATE_REDIS_URL=` (or `--redis ''`) ran the gateway on its embedded index without
    a word: a production gateway meant to share Redis routed from its own decisions
    alone, its in-flight counts and load invisible to the others."""
    monkeypatch.setenv("KVGATE_REDIS_URL", "")
    with pytest.raises(ValidationError):  # checked first: unrefused, main() would serve
        GatewaySettings()
    assert main(["serve", "--open", "--port", "0"]) == 2
    expected = (
        "kvgate serve: redis_url (--redis, KVGATE_REDIS_URL): empty: give a redis:// URL, or unset"
        " it for the embedded index"
    )
    assert capsys.readouterr().err.splitlines() == [expected]
    monkeypatch.delenv("KVGATE_REDIS_URL")
    assert main(["serve", "--open", "--port", "0", "--redis", " "]) == 2
    assert capsys.readouterr().err.splitlines() == [expected]


@pytest.mark.parametrize("gateway_id", ["gw 1", "gw:1", "gw{1}"])
def test_a_gateway_id_the_load_store_refuses_is_refused_at_start(
    gateway_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--gateway-id 'gw 1'` (KVGATE_GATEWAY_ID) was accepted; the load store then refused
    it at every write ("load store refresh failed ... invalid gateway id" every refresh):
    the gateway served, and its in-flight records never reached Redis, so the other
    gateways routed blind to its load."""
    with pytest.raises(ValidationError) as info:
        GatewaySettings(gateway_id=gateway_id)
    assert "gateway_id (KVGATE_GATEWAY_ID): invalid gateway id" in settings_error(info.value)
    assert main(["serve", "--open", "--port", "0", "--gateway-id", gateway_id]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    assert GatewaySettings(gateway_id="gw-eu.1_a").gateway_id == "gw-eu.1_a"


@pytest.mark.parametrize("endpoint", ["notaurl", "http://", "grpc://collector:4317"])
def test_an_otel_endpoint_that_is_no_http_url_is_refused(
    endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_OTEL_ENDPOINT=notaurl` (or a gRPC endpoint: the exporter is OTLP/HTTP) was
    accepted, and every span batch then failed to export, an ERROR line each batch."""
    monkeypatch.setenv("KVGATE_OTEL_ENDPOINT", endpoint)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert "otel_endpoint (KVGATE_OTEL_ENDPOINT): not an http(s) URL" in settings_error(info.value)
    monkeypatch.setenv("KVGATE_OTEL_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    assert GatewaySettings().otel_endpoint == "http://127.0.0.1:4318/v1/traces"


def test_a_negative_offload_threshold_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVGATE_TOKENIZE_OFFLOAD_CHARS=-5 was accepted (a character count below zero: every
    prompt went to the worker thread), where every other count setting is range-checked."""
    monkeypatch.setenv("KVGATE_TOKENIZE_OFFLOAD_CHARS", "-5")
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert "tokenize_offload_chars (KVGATE_TOKENIZE_OFFLOAD_CHARS): Input should be greater" in (
        settings_error(info.value)
    )
    monkeypatch.setenv("KVGATE_TOKENIZE_OFFLOAD_CHARS", "0")  # 0: every uncached text
    assert GatewaySettings().tokenize_offload_chars == 0


def test_the_gateway_loads_no_engine_model_or_numpy() -> None:
    """The unknown-setting check (e8693a4) imported the replicas' settings, and with them
    the engine model and numpy: an OpenBLAS thread and ~13 MiB more in every gateway."""
    code = (
        "import sys, gateway.serve as s\n"
        "s.unknown_settings({'KVGATE_POLICY_FILE': 'x', 'KVGATE_REPLICA_ALLOWLIST': 'y'})\n"
        "print(sorted(m for m in ('numpy', 'cachecore.engine') if m in sys.modules))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
