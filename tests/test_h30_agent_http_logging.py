"""The agent's HTTP server leaves the process's logging alone (review H137): made with
uvicorn's own log config, it gave the ``uvicorn`` logger a text handler and
``propagate = False``, so uvicorn's warnings in ``kvgate agent`` bypassed the agent's
structured (JSON) log lines."""

from __future__ import annotations

import logging

import pytest

from cachecore.agent.http import AgentHTTPServer


@pytest.fixture
def pristine_uvicorn_logger() -> logging.Logger:
    lg = logging.getLogger("uvicorn")
    lg.handlers.clear()
    lg.propagate = True
    return lg


async def test_the_agent_http_server_keeps_uvicorn_logs_on_the_root_handlers(
    pristine_uvicorn_logger: logging.Logger,
) -> None:
    server = AgentHTTPServer([], "127.0.0.1", 0)
    await server.start()
    try:
        lg = pristine_uvicorn_logger
        assert lg.propagate, "uvicorn's records no longer reach the process's handlers"
        assert lg.handlers == [], f"uvicorn got handlers of its own: {lg.handlers}"
    finally:
        await server.stop()
