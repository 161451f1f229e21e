"""`kvgate serve` start-up nits of review R2: N3 (flags without help or default in
--help), N7 (a key file's start-up refusal did not name the setting), N10 (--allow without
--discover started without a word that it does nothing)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from gateway import serve
from tests.test_serve_cli import _serve_refusal, _start_up_records


def test_every_serve_flag_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    serve.configure(parser)
    bare = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert bare == []
    parser.print_help()
    out = " ".join(capsys.readouterr().out.split())
    for said in ("KVGATE_HOST; 127.0.0.1", "KVGATE_PORT; 8000", "KVGATE_LOG_LEVEL; INFO"):
        assert said in out, said


@pytest.mark.parametrize(
    ("content", "says"), [(None, "No such file"), ("keys: 5\n", "'keys' must be a list")]
)
def test_a_refused_key_file_at_start_up_names_its_setting(
    content: str | None,
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "keys.yaml"
    if content is not None:
        path.write_text(content)
    err = _serve_refusal(["--api-keys", str(path), "--port", "0"], monkeypatch, capsys)
    said = [s for s in err.splitlines() if s.startswith("kvgate serve")]
    assert len(said) == 1, err
    head = f"kvgate serve: invalid API key file (--api-keys, KVGATE_API_KEYS_FILE) {path}: "
    assert said[0].startswith(head) and says in said[0], said


def test_allow_without_discover_is_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    records = _start_up_records(
        ["--replica", "r0=http://127.0.0.1:1", "--allow", "r2=http://10.0.0.2:8000"],
        monkeypatch,
        caplog,
    )
    said = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("--allow (KVGATE_REPLICA_ALLOWLIST) has no effect" in m for m in said), said


def test_allow_with_discover_or_nothing_is_not_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    records = _start_up_records(["--replica", "r0=http://127.0.0.1:1"], monkeypatch, caplog)
    assert not [r for r in records if "--allow" in r.getMessage()]
