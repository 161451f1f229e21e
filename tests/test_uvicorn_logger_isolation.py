"""A test that makes a uvicorn.Config with uvicorn's own log config (the agent's HTTP
server, the agent tests' EngineStub) reconfigured the process-wide uvicorn loggers
(``uvicorn`` propagate False with its own handler, ``uvicorn.error`` at WARNING), and every
later test that read uvicorn's records through caplog ('Waiting for connections to close',
'Cancel 1 running task(s)', 'Application shutdown complete.') missed them:
test_h30_forced_stop_drain and test_h30_single_drain failed after any agent test, as in the
full suite's order. conftest's autouse ``_restore_uvicorn_loggers`` starts each test with
them as a fresh process has them. Two tests in file order: the second fails without the
fixture, as it does after test_agent_fuzz (whose module-scoped rig sets the level before
any test's snapshot) with a fixture that only restores what a test found."""

from __future__ import annotations

import logging

import pytest
import uvicorn
from fastapi import FastAPI


def test_a_uvicorn_config_with_its_own_log_config_reconfigures_its_loggers() -> None:
    uvicorn.Config(FastAPI(), log_level="warning", access_log=False, lifespan="off")
    assert logging.getLogger("uvicorn").propagate is False  # what it does, process-wide
    assert logging.getLogger("uvicorn.error").level == logging.WARNING


def test_a_later_test_still_reads_uvicorns_info_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    logging.getLogger("uvicorn.error").info("Waiting for connections to close.")
    assert "Waiting for connections to close." in caplog.messages
