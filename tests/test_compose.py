"""docker-compose.yml cannot be run here (no Docker engine), so check what can be checked:
it is valid YAML and every kvgate service's command parses with the real CLI parsers."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

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
