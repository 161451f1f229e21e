"""The suite's own hygiene: a test that configures logging for real leaves nothing behind
that writes into a later test's stderr (tests/conftest.py's autouse fixture). The two
tests run in file order."""

from __future__ import annotations

import logging

import pytest

from cachecore.logs import configure_logging


def test_a_test_configures_logging_on_its_captured_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("INFO", json_format=False)
    logging.getLogger("kvgate.test").warning("inside the first test")
    assert "inside the first test" in capsys.readouterr().err


def test_a_later_test_logs_without_a_logging_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Before the fixture, the first test's handler still pointed at its closed capture:
    this record printed '--- Logging error ---' and a traceback here."""
    logging.getLogger("kvgate.test").error("in the second test")
    assert "Logging error" not in capsys.readouterr().err
