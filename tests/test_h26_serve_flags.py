"""`kvgate serve` refusals name the flag beside the environment variable (review R2, O6).

They named only the variable (`port (KVGATE_PORT): ...`), also when the bad value came from
a flag: an operator who never set the variable was sent looking for it. The agent's
refusals already said `field (--flag, KVGATE_AGENT_FIELD)`; serve's now do too."""

from __future__ import annotations

import argparse

import pytest

from gateway.cli import main
from gateway.serve import configure, serve_flags
from gateway.settings import GatewaySettings


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--port", "70000"],
            "port (--port, KVGATE_PORT): Input should be less than or equal to 65535",
        ),
        (
            ["--gateway-id", "a:b"],
            "gateway_id (--gateway-id, KVGATE_GATEWAY_ID): invalid gateway id",
        ),
        (
            ["--key-prefix", "a b"],
            "key_prefix (--key-prefix, KVGATE_KEY_PREFIX): invalid key prefix",
        ),
        (["--allow", "x"], "replica_allowlist (--allow, KVGATE_REPLICA_ALLOWLIST): URL scheme"),
        (["--otel-endpoint", "foo"], "otel_endpoint (--otel-endpoint, KVGATE_OTEL_ENDPOINT): not"),
    ],
)
def test_a_refused_flag_is_named_with_its_variable(
    args: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--open", *args]) == 2
    said = [s for s in capsys.readouterr().err.splitlines() if s.startswith("kvgate serve")]
    assert len(said) == 1 and said[0].startswith(f"kvgate serve: {line}"), said


def test_a_refused_variable_is_named_with_its_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_PORT", "70000")
    assert main(["serve", "--open"]) == 2
    said = [s for s in capsys.readouterr().err.splitlines() if s.startswith("kvgate serve")]
    assert said == [
        "kvgate serve: port (--port, KVGATE_PORT): Input should be less than or equal to 65535"
    ]


def test_every_setting_flag_of_serve_is_in_the_map() -> None:
    """The map and the parser cannot drift: each flag whose dest is a setting, or that sets
    one under another name, maps to it; each entry names a flag the parser has (the map is
    read off the parser and the settings model, no longer kept by hand)."""
    flags = serve_flags()
    parser = argparse.ArgumentParser()
    configure(parser)
    options = {opt: a.dest for a in parser._actions for opt in a.option_strings}
    fields = set(GatewaySettings.model_fields)
    assert set(flags) <= fields
    assert set(flags.values()) <= set(options)
    for opt, dest in options.items():
        if dest in fields and opt.startswith("--"):
            assert flags[dest] == opt, (opt, dest)
    # the flags whose dest differs from their setting's name
    assert (flags["replicas"], flags["replica_allowlist"]) == ("--replica", "--allow")
    assert flags["log_json"] == "--plain-logs"
    assert len(flags) == 20  # with --strategy (KVGATE_STRATEGY), a setting since it has one
