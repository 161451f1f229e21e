"""Every ``kvgate`` subcommand's --help speaks to its user: no internal names."""

from __future__ import annotations

import re

import pytest

from gateway.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_names_no_private_function(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate agent --help` pointed at ``_gc_freezer``, a function of its source."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "usage: kvgate" in text
    assert not re.findall(r"(?<![\w-])_[a-z]\w*", text), text


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_names_only_variables_that_exist(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``KVGATE_*`` variable a --help names is read by a settings class of kvgate."""
    from cachecore.agent.settings import AgentSettings
    from cachecore.replica.settings import ReplicaSettings
    from gateway.settings import GatewaySettings

    known = {
        (str(cls.model_config.get("env_prefix", "")) + field).upper()
        for cls in (GatewaySettings, AgentSettings, ReplicaSettings)
        for field in cls.model_fields
    }
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    named = set(re.findall(r"KVGATE_[A-Z0-9_]*[A-Z0-9]", text))
    assert named <= known, sorted(named - known)
