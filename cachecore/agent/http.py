"""The agent's own HTTP endpoints: ``/metrics`` (its per-agent registry, Prometheus text)
and ``/health`` (JSON: status, state, last seq, mirror size, latency)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cachecore.agent.agent import Agent
from cachecore.listen import bind_listeners
from cachecore.tasks import wait_to_end

log = logging.getLogger(__name__)

HTTP_STOP_S = 5.0
"""How long :meth:`AgentHTTPServer.stop` waits for uvicorn to close its connections before
it cancels the server's task."""


def agent_app(agents: Sequence[Agent]) -> FastAPI:
    app = FastAPI(title="kvgate agent", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = b"".join(a.metrics.exposition() for a in agents)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        items = [a.health() for a in agents]
        ok = all(h["status"] == "ok" for h in items)
        body = items[0] if len(items) == 1 else {"agents": items}
        return JSONResponse(body, status_code=200 if ok else 503)

    return app


class _OwnerSignalsServer(uvicorn.Server):
    """uvicorn without its signal handlers: the agent's owner (``kvgate agent``) handles
    SIGTERM and SIGINT and stops this server after the agent. uvicorn's, installed while it
    serves, stopped it at the signal itself, beside the agent's stop (``/health`` and
    ``/metrics`` gone from the start of the stop), and re-raised the signal after."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AgentHTTPServer:
    """uvicorn in a task, listening from the constructor on every address ``host`` resolves
    to, as the gateway and the replica do (``port`` 0 picks a free one, the same on each).
    One AF_INET socket refused ``::1`` and listened on IPv4 only for a name with an IPv6
    address. Raises :class:`~cachecore.listen.ListenError`."""

    def __init__(self, agents: Sequence[Agent], host: str, port: int) -> None:
        self.host = host
        self._socks = bind_listeners(host, port)
        self.port = int(self._socks[0].getsockname()[1])
        # log_config=None: uvicorn's own dictConfig would give the process-wide "uvicorn"
        # logger a text handler and propagate=False, so its warnings bypassed the agent's
        # JSON log lines (and every later uvicorn server's records in the same process)
        config = uvicorn.Config(
            agent_app(agents),
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = _OwnerSignalsServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=self._socks))
        for _ in range(200):
            if self._server.started:
                return
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Tell uvicorn to exit, wait until it has (at most :data:`HTTP_STOP_S`, then its
        task is cancelled), then close the listening sockets. A server that failed or
        outlived the wait is logged, not raised: its sockets close all the same. A
        cancellation of the caller does not cut the stop short and is raised after it:
        the wait sat under ``suppress(CancelledError)``, which cut uvicorn's shutdown short
        and swallowed the cancellation (a caller cancelled meanwhile went on as if it had
        not been)."""
        self._server.should_exit = True
        try:
            if self._task is not None:
                await wait_to_end(self._task, HTTP_STOP_S, "agent http server stop")
        except Exception:
            log.warning(
                "the agent's HTTP server did not stop cleanly",
                exc_info=True,
                extra={"port": self.port},
            )
        finally:
            for sock in self._socks:
                sock.close()
