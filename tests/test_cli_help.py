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
