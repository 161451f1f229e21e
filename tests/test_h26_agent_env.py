"""Review R2's O4: a misspelled ``KVGATE_*`` variable beside ``kvgate agent`` or ``kvgate
replica`` was ignored without a word (only ``kvgate serve`` warned), so a standalone agent
or a replica fleet ran on defaults where the operator set a value. All three commands now
call the one check (:func:`cachecore.argtypes.unknown_settings`), each over its own
prefix.

Review R3's V4: the gateway's KVGATE_REPLICA_ALLOWLIST lies under kvgate replica's prefix,
so in a shared environment the replica warned of it ("did you mean KVGATE_REPLICA_HOST?").
Now it passes, as every gateway variable under the agent's or the replica's prefix must."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cachecore.agent.settings import AgentSettings
from cachecore.argtypes import settings_variables, unknown_settings


def _kvgate(argv: list[str], extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    try:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli", *argv],
            env={**env, **extra_env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvgate {argv[0]} did not stop")


def test_kvgate_agent_warns_of_a_misspelled_variable() -> None:
    """The reviewer's KVGATE_AGENT_SCRAPE_INTERVAL (the field is scrape_interval_s). The
    agent then stops on the missing --redis (exit 2), after its warning."""
    done = _kvgate(
        ["agent", "--log-text", "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9",
         "--events", "tcp://127.0.0.1:9"],
        {"KVGATE_AGENT_SCRAPE_INTERVAL": "5", "KVGATE_PORT": "8000", "KVGATE_REPLICA_BLOCKS": "1"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    warned = [line for line in done.stderr.splitlines() if "setting: ignored" in line]
    assert len(warned) == 1, done.stderr  # another command's variables pass
    assert warned[0].endswith(
        "KVGATE_AGENT_SCRAPE_INTERVAL is no kvgate agent setting: ignored; "
        "did you mean KVGATE_AGENT_SCRAPE_INTERVAL_S?"
    ), warned


def test_kvgate_replica_warns_of_a_misspelled_variable() -> None:
    """The reviewer's KVGATE_REPLICA_BLOCKS (the field is num_blocks) ran 4,096-block
    replicas without a word. The replica then stops on a port in use (exit 2)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = _kvgate(
            ["replica", "--plain-logs", "--base-port", str(port)],
            {
                "KVGATE_REPLICA_BLOCKS": "100",
                "KVGATE_AGENT_TOPIC": "kv-events",
                "KVGATE_REPLICA_ALLOWLIST": "http://10.0.0.0/8",  # the gateway's
            },
        )
    assert done.returncode == 2, done.stderr[-2000:]
    warned = [line for line in done.stderr.splitlines() if "setting: ignored" in line]
    assert len(warned) == 1, done.stderr[-2000:]
    assert warned[0].endswith(
        "KVGATE_REPLICA_BLOCKS is no kvgate replica setting: ignored; "
        "did you mean KVGATE_REPLICA_NUM_BLOCKS?"
    ), warned


def test_the_check_is_scoped_and_case_blind() -> None:
    known = settings_variables(AgentSettings)
    env = {
        "KVGATE_AGENT_TOPIC": "x",  # a setting
        "kvgate_agent_topik": "x",  # pydantic-settings reads names case-insensitively
        "KVGATE_LOCUST_KEYS": "x",  # a load tool's
        "KVGATE_HOST": "x",  # the gateway's: outside the agent's prefix
    }
    got = unknown_settings(env, known, "KVGATE_AGENT_", "kvgate agent")
    assert got == [
        "kvgate_agent_topik is no kvgate agent setting: ignored; did you mean KVGATE_AGENT_TOPIC?"
    ]


def test_the_gateways_variables_under_another_commands_prefix_pass() -> None:
    """kvgate agent and kvgate replica run beside a gateway in one environment: none of the
    gateway's variables under their prefixes is warned of (cachecore cannot import the
    gateway's settings, so the shared check lists them; this keeps the list whole)."""
    from cachecore.replica.settings import ReplicaSettings
    from gateway.settings import GatewaySettings

    gateway = settings_variables(GatewaySettings)
    assert "KVGATE_REPLICA_ALLOWLIST" in gateway  # the case the review found
    for cls, scope, reader in (
        (AgentSettings, "KVGATE_AGENT_", "kvgate agent"),
        (ReplicaSettings, "KVGATE_REPLICA_", "kvgate replica"),
    ):
        env = dict.fromkeys(gateway, "x")
        assert unknown_settings(env, settings_variables(cls), scope, reader) == [], reader
        # while a variable of neither still warns
        env[f"{scope}NO_SUCH"] = "x"
        assert unknown_settings(env, settings_variables(cls), scope, reader) != [], reader


def test_engine_md_names_the_replica_variables_that_differ_from_their_flag() -> None:
    """docs/engine.md says the variable is KVGATE_REPLICA_ + the field, the flag's name but
    for --blocks and --no-events; hold the fleet's parser to that."""
    import argparse
    from pathlib import Path

    from cachecore.replica import cli as replica_cli
    from cachecore.replica.settings import ReplicaSettings

    parser = argparse.ArgumentParser()
    replica_cli.configure(parser)
    flags = {a.dest: a for a in parser._actions}
    differ = {"num_blocks": "blocks", "publish_events": "no_events"}
    for field in ReplicaSettings.model_fields:
        assert differ.get(field, field) in flags, field
    for field, dest in differ.items():
        assert field not in flags and dest in flags, field
    text = " ".join((Path(__file__).parents[1] / "docs" / "engine.md").read_text().split())
    assert "`--blocks` (`KVGATE_REPLICA_NUM_BLOCKS`)" in text
    assert "`--no-events` (`KVGATE_REPLICA_PUBLISH_EVENTS=false`)" in text
