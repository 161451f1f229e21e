"""logging's level aliases (warn, fatal): KVGATE_LOG_LEVEL=warn started the gateway before
the variable was checked (02de96b), so it must still start one, and --log-level takes the
same names."""

from __future__ import annotations

import logging

import pytest

from cachecore.argtypes import log_level
from cachecore.logs import check_log_level, configure_logging
from cachecore.testing import free_port
from gateway.serve import start_gateway_process

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("text", "name"), [("warn", "WARNING"), ("WARN", "WARNING"), ("fatal", "CRITICAL")]
)
def test_loggings_aliases_are_the_levels_they_stand_for(text: str, name: str) -> None:
    assert check_log_level(text) == name
    assert log_level(text) == name  # the flag's type
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging(text)
        assert root.level == logging.getLevelName(name)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_kvgate_serve_starts_with_kvgate_log_level_warn() -> None:
    """It exited 2 ("unknown log level 'warn'") where it had started before."""
    proc = start_gateway_process(["--open"], free_port(), env={"KVGATE_LOG_LEVEL": "warn"})
    try:
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=20)
