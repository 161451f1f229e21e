"""Settings and CLI edges of `kvgate agent`, `kvgate replica` and `kvgate serve` found in
review: each is one clear line and exit 2, nothing started."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from cachecore.agent import cli as agent_cli
from cachecore.replica import cli as replica_cli

EVERY_INTERFACE = "empty: give 0.0.0.0 (or ::) to listen on every interface"
EVERY_IPV4_INTERFACE = "empty: give 0.0.0.0 to listen on every interface"  # the agent's
EVERY_ZMQ_INTERFACE = "empty: give * (or 0.0.0.0) to publish on every interface"


@pytest.mark.parametrize("host", ["", " "])
@pytest.mark.parametrize("given", ["env", "flag"])
def test_an_empty_agent_http_host_is_refused_not_every_interface(
    host: str, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_AGENT_HTTP_HOST=` (a template's unset variable) went to the bind as host '',
    every interface: the agent's /metrics and /health, loopback-only by default, were open
    to the network. Refused before anything connects (the Redis here is never reached)."""
    for var in ("REPLICA_ID", "ENGINE_URL", "EVENTS", "REDIS", "HTTP_HOST"):
        monkeypatch.delenv(f"KVGATE_AGENT_{var}", raising=False)
    argv = [
        "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9",
        "--events", "tcp://127.0.0.1:9", "--redis", "redis://127.0.0.1:9/0",
    ]  # fmt: skip
    if given == "env":
        monkeypatch.setenv("KVGATE_AGENT_HTTP_HOST", host)
    else:
        argv += ["--http-host", host]
    parser = argparse.ArgumentParser(prog="kvgate agent")
    agent_cli.configure(parser)
    # settings_from_args, not run: unfixed, run would serve on every interface until killed
    with pytest.raises(ValidationError) as info:
        agent_cli.settings_from_args(parser.parse_args(argv))
    assert agent_cli.settings_error(info.value) == (
        f"http_host (--http-host, KVGATE_AGENT_HTTP_HOST): {EVERY_IPV4_INTERFACE}"
    )


@pytest.mark.parametrize("field", ["host", "events_host"])
@pytest.mark.parametrize("given", ["env", "flag"])
def test_an_empty_replica_host_is_refused_not_every_interface(
    field: str, given: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVGATE_REPLICA_HOST=` listened on every interface (uvicorn's host ''), and an empty
    events host was ZMQ's "No such device" at the bind, exit 1."""
    monkeypatch.delenv("KVGATE_REPLICA_HOST", raising=False)
    monkeypatch.delenv("KVGATE_REPLICA_EVENTS_HOST", raising=False)
    flag = "--" + field.replace("_", "-")
    argv: list[str] = []
    if given == "env":
        monkeypatch.setenv(f"KVGATE_REPLICA_{field.upper()}", "")
    else:
        argv = [flag, ""]
    parser = argparse.ArgumentParser(prog="kvgate replica")
    replica_cli.configure(parser)
    # build_settings, not run: unfixed, run would serve on every interface until killed
    with pytest.raises(SystemExit) as exc:
        replica_cli.build_settings(parser.parse_args(argv))
    assert exc.value.code == 2
    says = EVERY_INTERFACE if field == "host" else EVERY_ZMQ_INTERFACE
    assert capsys.readouterr().err.splitlines() == [
        f"kvgate replica: error: argument {flag}: {says}"
    ]


@pytest.mark.parametrize(
    "name",
    [
        "KVGATE_DRAIN_TIMEOUT_S",
        "KVGATE_CONNECT_TIMEOUT_S",
        "KVGATE_FIRST_BYTE_TIMEOUT_S",
        "KVGATE_RESPONSE_TIMEOUT_S",
        "KVGATE_READ_TIMEOUT_S",
    ],
)
@pytest.mark.parametrize("value", ["inf", "Infinity", "1e400"])
def test_an_infinite_drain_or_upstream_timeout_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVGATE_DRAIN_TIMEOUT_S=inf` went to asyncio.timeout and uvicorn's graceful shutdown:
    with one stalled stream a SIGTERM never stopped the gateway. An infinite upstream
    timeout (the docs give none the meaning "no timeout") left a request on a wedged engine
    waiting for ever, never a 504. Refused at start, one line, exit 2."""
    from cachecore.argtypes import settings_error
    from gateway.cli import main
    from gateway.settings import GatewaySettings

    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    says = f"({name}): Input should be a finite number"
    assert says in settings_error(info.value)
    assert main(["serve", "--open", "--port", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and says in err[0], err


@pytest.mark.parametrize("given", ["env", "flag"])
def test_an_empty_agent_trace_out_is_refused_as_empty(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_AGENT_TRACE_OUT=` (or `--trace-out ''`) was the path ".": refused as "cannot
    open --trace-out . (Is a directory)", which names neither the variable nor the slip."""
    for var in ("REPLICA_ID", "ENGINE_URL", "EVENTS", "REDIS", "TRACE_OUT"):
        monkeypatch.delenv(f"KVGATE_AGENT_{var}", raising=False)
    argv = [
        "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9",
        "--events", "tcp://127.0.0.1:9", "--redis", "redis://127.0.0.1:9/0",
    ]  # fmt: skip
    if given == "env":
        monkeypatch.setenv("KVGATE_AGENT_TRACE_OUT", "")
    else:
        argv += ["--trace-out", ""]
    parser = argparse.ArgumentParser(prog="kvgate agent")
    agent_cli.configure(parser)
    with pytest.raises(ValidationError) as info:
        agent_cli.settings_from_args(parser.parse_args(argv))
    assert agent_cli.settings_error(info.value) == (
        "trace_out (--trace-out, KVGATE_AGENT_TRACE_OUT): empty: give a file, or unset the variable"
    )


@pytest.mark.parametrize("given", ["env", "flag"])
def test_an_empty_replica_tokenizer_dir_is_refused(
    given: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVGATE_REPLICA_TOKENIZER_DIR=` (or `--tokenizer-dir ''`) served the built-in
    tokenizer without a word, where a model's tokenizer was asked for."""
    monkeypatch.delenv("KVGATE_REPLICA_TOKENIZER_DIR", raising=False)
    argv: list[str] = []
    if given == "env":
        monkeypatch.setenv("KVGATE_REPLICA_TOKENIZER_DIR", "")
    else:
        argv = ["--tokenizer-dir", ""]
    parser = argparse.ArgumentParser(prog="kvgate replica")
    replica_cli.configure(parser)
    with pytest.raises(SystemExit) as exc:
        replica_cli.build_settings(parser.parse_args(argv))
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvgate replica: error: argument --tokenizer-dir: "
        "empty: give a model directory, or unset it for the built-in one"
    ]
