"""Review R3's V6: the runbook said `kvgate policy check` exits 2 "if the gateway would
refuse" a policy, but it checks the file alone: a block size no engine serves passes it and
is refused only by the running gateway. The runbook now says what it checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main

RUNBOOK = Path(__file__).parents[1] / "docs" / "runbook.md"


def test_a_block_size_no_engine_serves_passes_the_offline_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "bs32.yaml"
    policy.write_text("models:\n  default: {block_size: 32}\n")
    assert main(["policy", "check", str(policy)]) == 0
    assert capsys.readouterr().out.startswith(f"{policy}: valid (")


def test_the_runbook_says_the_check_is_of_the_file_alone() -> None:
    row = next(line for line in RUNBOOK.read_text().splitlines() if "kvgate policy check" in line)
    assert "if the gateway would refuse it" not in row, row
    assert "if the file itself is invalid" in row, row
    assert "checked only by the gateway at the reload" in row, row
