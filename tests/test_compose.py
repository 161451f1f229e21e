"""docker-compose.yml cannot be run here (no Docker engine), so check what can be checked:
it is valid YAML and every kvgate service's command parses with the real CLI parsers."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from gateway.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]


def test_compose_commands_parse_with_the_cli() -> None:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = data["services"]
    kvgate = {name: svc for name, svc in services.items() if svc.get("image") == "kvgate:latest"}
    assert {"gateway", "agent-0", "agent-1", "replica-0", "replica-1"} <= set(kvgate)
    for name, svc in kvgate.items():
        cmd = svc["command"]
        assert cmd[0] in SUBCOMMANDS, name
        module = importlib.import_module(SUBCOMMANDS[cmd[0]][0])
        parser = argparse.ArgumentParser(prog=f"kvgate {cmd[0]}", exit_on_error=False)
        module.configure(parser)
        parser.parse_args(cmd[1:])  # raises on an unknown or malformed option
    # every agent follows a replica the gateway routes to
    gw = " ".join(services["gateway"]["command"])
    for name, svc in kvgate.items():
        if name.startswith("agent-"):
            rid = svc["command"][svc["command"].index("--replica-id") + 1]
            assert f"{rid}=" in gw


def _compose_settings(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[str], argparse.Namespace]:
    """A service's command parsed by its subcommand's parser, under the service's environment
    (the variables it sets, none of this machine's)."""
    svc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][name]
    for var in [v for v in os.environ if v.startswith("KVGATE_")]:
        monkeypatch.delenv(var)
    for var, value in (svc.get("environment") or {}).items():
        monkeypatch.setenv(var, str(value))
    cmd = [str(c) for c in svc["command"]]
    parser = argparse.ArgumentParser(prog=f"kvgate {cmd[0]}")
    importlib.import_module(SUBCOMMANDS[cmd[0]][0]).configure(parser)
    return cmd, parser.parse_args(cmd[1:])


def test_compose_services_agree_with_each_other_as_the_cli_reads_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each agent follows the ports its replica's command opens, under the topic it
    publishes; the gateway routes to each replica's URL with settings that start (salt
    secret long enough, tenants configured); the replicas' HTTP ports are the ones named."""
    from cachecore.agent.cli import settings_from_args as agent_settings
    from cachecore.keys import SaltMinter
    from cachecore.replica.cli import build_ports, build_settings
    from gateway.replicas import parse_replica_spec
    from gateway.serve import settings_from_args as gateway_settings

    _, args = _compose_settings("gateway", monkeypatch)
    gw = gateway_settings(args)
    assert gw.open_access or gw.api_keys_file or gw.api_keys_redis
    SaltMinter([s.get_secret_value().encode() for s in gw.salt_secrets])  # raises if short
    routed = {spec.id: spec.url for spec in map(parse_replica_spec, gw.replicas)}
    assert gw.redis_url

    for i in (0, 1):
        _, args = _compose_settings(f"replica-{i}", monkeypatch)
        replica = build_settings(args)
        (ports,) = build_ports(args)
        _, args = _compose_settings(f"agent-{i}", monkeypatch)
        agent = agent_settings(args)
        host = f"replica-{i}"
        assert agent.events == f"tcp://{host}:{ports.events}"
        assert agent.replay == f"tcp://{host}:{ports.replay}"
        assert agent.engine_url == f"http://{host}:{ports.http}"
        assert agent.topic == replica.events_topic
        assert agent.redis == gw.redis_url
        assert routed[agent.replica_id] == agent.engine_url


def test_dockerfile_copies_every_package_and_runs_the_cli() -> None:
    """`pip install .` in the image needs every package pyproject includes (and the readme
    it names); the entry point is `kvgate`, and the default command parses as `serve`."""
    import tomllib

    text = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = {
        part.rstrip("/").removeprefix("./")
        for line in text.splitlines()
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
    }
    assert project["project"]["readme"] in copied and "pyproject.toml" in copied
    for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, pattern
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))  # type: ignore[union-attr]
    assert entry == ["kvgate"] and "kvgate" in project["project"]["scripts"]
    cmd = json.loads(re.search(r"^CMD (.*)$", text, re.M).group(1))  # type: ignore[union-attr]
    parser = argparse.ArgumentParser(prog=f"kvgate {cmd[0]}")
    importlib.import_module(SUBCOMMANDS[cmd[0]][0]).configure(parser)
    parser.parse_args(cmd[1:])
