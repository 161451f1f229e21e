"""The ``kvgate`` entry point as a script meets it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.cli import main


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate` with no command printed the help and exited 0, so a script's `kvgate
    $CMD` with CMD unset "succeeded" having done nothing. It is exit 2, as an unknown
    command is, with the help on stderr; `kvgate --help` still exits 0."""
    assert main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "usage: kvgate" in out.err and "serve" in out.err
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "usage: kvgate" in proc.stderr
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
