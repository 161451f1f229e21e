"""Two edges of the shutdown machinery (review of dda7f69..3a99a11, fc67274, cedce9f).

1. ``cachecore.tasks.run_to_end`` raised a clean-up that ended cancelled by a third task
   (``wait_to_end``'s task cancelled elsewhere) to its caller as a CancelledError, though
   nobody had cancelled the caller (``cancelling() == 0``): a stray cancellation. A caller
   then stopped as if cancelled: ``AgentHTTPServer.stop``, documented to log a server that
   did not stop cleanly, raised it, and ``run_steps`` (the agent CLI's shutdown) skipped
   every step after it (the Redis clients' close). Now that is a RuntimeError, a failure.
2. ``kvgate agent``'s HTTP server (/health, /metrics) was plain ``uvicorn.Server``, which
   installs its own SIGTERM/SIGINT handlers while it serves: a SIGTERM stopped it at once,
   beside the agent's stop, where docs/agent.md says the shutdown stops it after the agent
   (and cedce9f's "no metric" reasoning counts on that). Now the owner's handlers alone act.

Real pieces: uvicorn servers on loopback, the CLI's ``_main`` in this loop with its own
redis-server and the agent rig's engine stub (tests/test_h30_agent_stop's helpers), a real
SIGTERM. The slow agent stop is a fake named as such (tests/test_h30_agent_stop)."""

from __future__ import annotations

import asyncio
import logging
import signal

import httpx
import pytest

from cachecore.agent import Agent
from cachecore.agent.http import AgentHTTPServer
from cachecore.tasks import run_steps, run_to_end, wait_to_end
from cachecore.testing import RedisServer
from tests.test_agent_helpers import Rig
from tests.test_h30_agent_stop import recording_agent, running_cli
from tests.test_h30_agent_stop import rig as rig  # a fixture

pytestmark = pytest.mark.timeout(60)


async def cancelled_elsewhere() -> asyncio.Task[None]:
    """A task that another party cancelled (it has ended so)."""
    task = asyncio.ensure_future(asyncio.sleep(30))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task], timeout=5.0)
    assert task.cancelled()
    return task


async def test_a_task_cancelled_elsewhere_is_a_failure_not_the_callers_cancellation() -> None:
    task = await cancelled_elsewhere()
    me = asyncio.current_task()
    assert me is not None
    try:
        await wait_to_end(task, 5.0, "a server's stop")
    except asyncio.CancelledError:
        pytest.fail(f"a stray cancellation reached a caller nobody cancelled ({me.cancelling()})")
    except RuntimeError as exc:
        assert "a server's stop" in str(exc)
    else:
        pytest.fail("a task cancelled elsewhere passed for a clean end")
    assert me.cancelling() == 0


async def test_a_shutdown_step_whose_task_was_cancelled_elsewhere_skips_no_later_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent CLI's shape: steps run by run_steps under run_to_end."""
    caplog.set_level(logging.ERROR, logger="cachecore.tasks")
    task = await cancelled_elsewhere()
    ran: list[str] = []

    async def server_stop() -> None:
        await wait_to_end(task, 5.0, "http server stop")

    async def close_clients() -> None:
        ran.append("clients closed")

    steps = run_steps([("http server", server_stop, 5.0), ("redis", close_clients, 5.0)], "sd")
    with pytest.raises(RuntimeError):
        await run_to_end(steps, 10.0, "shutdown")
    assert ran == ["clients closed"]
    assert [getattr(r, "step", None) for r in caplog.records] == ["http server"]


async def test_an_agent_http_server_whose_task_was_cancelled_stops_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="cachecore.agent.http")
    server = AgentHTTPServer([], "127.0.0.1", 0)
    await server.start()
    assert server._task is not None
    server._task.cancel()  # by another party: a teardown, an owner's bug
    await asyncio.wait([server._task], timeout=5.0)
    async with asyncio.timeout(10.0):
        await server.stop()  # returns: a server that did not stop cleanly is logged
    assert all(s.fileno() == -1 for s in server._socks)
    assert [r.getMessage() for r in caplog.records] == [
        "the agent's HTTP server did not stop cleanly"
    ]


@pytest.mark.redis
async def test_the_agent_cli_stops_its_http_server_after_its_agent_on_sigterm(
    rig: Rig, redis_own: RedisServer
) -> None:
    """A real SIGTERM with the agent's stop slowed: /health still answers while the agent
    stops (the HTTP server is the shutdown's next step), then the server is gone."""
    entered = asyncio.Event()
    answered: list[int | str] = []
    port_box: list[int] = []

    async def slow_stop(agent: Agent, deregister: bool | None) -> None:
        entered.set()
        await asyncio.sleep(0.5)  # the probe below runs meanwhile
        async with httpx.AsyncClient(timeout=2.0) as h:
            try:
                answered.append((await h.get(f"http://127.0.0.1:{port_box[0]}/health")).status_code)
            except httpx.TransportError as exc:
                answered.append(type(exc).__name__)
        await Agent.stop(agent, deregister)

    made: list[Agent] = []
    async with running_cli(rig, redis_own, recording_agent(made, slow_stop), made) as (main, port):
        port_box.append(port)
        signal.raise_signal(signal.SIGTERM)
        async with asyncio.timeout(30.0):
            await entered.wait()
            rc = await main
    assert rc == 0
    assert answered == [200], "the agent's HTTP server stopped before its agent"


async def test_a_cancelled_caller_still_hears_of_a_task_cancelled_elsewhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The caller is cancelled while it waits and the task it waits for is then cancelled
    by a third party: the caller gets its own cancellation, and the clean-up's failure is
    logged, as any failure is under a cancellation (cdd82a3 said so, but only a caller
    that was not cancelled heard of it: this end was silent)."""
    server = asyncio.ensure_future(asyncio.sleep(30))  # a server told to stop, still going
    waiter = asyncio.ensure_future(wait_to_end(server, 5.0, "a server's stop"))
    await asyncio.sleep(0.05)
    waiter.cancel()  # the caller's cancellation: held until the server's task has ended
    await asyncio.sleep(0.05)
    assert not waiter.done()
    with caplog.at_level(logging.ERROR, logger="cachecore.tasks"):
        server.cancel()  # by someone else
        done, _ = await asyncio.wait([waiter], timeout=5.0)
    assert waiter in done and waiter.cancelled()
    failures = [r for r in caplog.records if r.getMessage() == "a clean-up failed"]
    assert len(failures) == 1, caplog.messages
    assert failures[0].exc_info is not None
    assert "ended cancelled by another task" in str(failures[0].exc_info[1])
