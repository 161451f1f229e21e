"""`kvgate policy check FILE...` validates policy files offline, by the gateway's start-up
rules (review R2, N5: there was no way to validate a policy in CI short of starting a
gateway, and a docstring cited a command that did not exist)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from policies.schema import builtin_policy_path


def test_valid_files_pass_with_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    paths = [str(builtin_policy_path(n)) for n in ("default", "isolation-strict", "latency-first")]
    assert main(["policy", "check", *paths]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert [line.split(": valid (")[0] for line in lines] == paths, lines
    assert out.err == ""


def test_an_invalid_file_is_exit_2_naming_its_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    burst = tmp_path / "burst.yaml"
    burst.write_text("default_tenant:\n  limits: {requests_burst: 1}\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing rendered\n")
    missing = tmp_path / "missing.yaml"
    good = builtin_policy_path("default")
    argv = ["policy", "check", str(burst), str(good), str(empty), str(missing)]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 1 and out.out.startswith(f"{good}: valid (")
    assert out.err.splitlines() == [
        f"kvgate policy: invalid policy {burst}: default_tenant.limits.requests_burst: needs "
        "requests_per_s (alone it limits nothing)",
        f"kvgate policy: invalid policy {empty}: the policy is empty (no YAML mapping); "
        "write {} for the built-in defaults",
        f"kvgate policy: invalid policy {missing}: cannot read: [Errno 2] No such file or "
        f"directory: '{missing}'",
    ]


def test_no_action_or_no_file_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["policy"], ["policy", "check"], ["policy", "lint", "x.yaml"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
