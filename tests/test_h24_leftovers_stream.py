"""EventStream.subscribe closes what it made when it fails.

Before, a ZMQ error in ``get_monitor_socket`` or ``connect`` left the SUB socket (made
first, recorded only at the end) open, and nothing closed it: the agent's start-up is
retried (21a8b0f), so each failed attempt left a socket open in the agent's context for as
long as anything held the error's traceback (a log handler keeping records, an error
reporter), and pyzmq's finalizer closed it later with "Unclosed socket" ResourceWarnings.

The refused endpoint is a real one: an ``ipc://`` path longer than the kernel's socket path
limit passes the agent's endpoint check and ZMQ refuses it at connect ("File name too
long"). The monitor's failure is a fault injected with a fake named as such.
"""

from __future__ import annotations

import errno
import gc
import logging
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
import zmq.asyncio

from cachecore.agent import Agent
from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.stream import EventStream
from cachecore.index.memory import MemoryIndex
from tests.test_agent_helpers import Rig, counter_total, until

# over sun_path's 108 bytes: ZMQ's connect refuses it with ENAMETOOLONG
REFUSED_IPC = "ipc:///tmp/kvgate-h24-" + "x" * 200


def _open(ctx: zmq.Context[Any]) -> int:
    """Sockets of ``ctx`` still open (pyzmq drops a socket from the set on close)."""
    return sum(1 for s in list(ctx._sockets) if not s.closed)


@contextmanager
def _no_unclosed_socket_warnings() -> Iterator[None]:
    """Fail if pyzmq's finalizer closed a socket someone forgot (it warns as it does)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    unclosed = [str(w.message) for w in seen if "Unclosed socket" in str(w.message)]
    assert not unclosed, unclosed


def _stream(ctx: zmq.asyncio.Context, endpoint: str) -> EventStream:
    async def never(*_: object) -> Any:
        raise AssertionError("subscribe calls none of the stream's callbacks")

    return EventStream(
        name="r0",
        ctx=ctx,
        events_endpoint=endpoint,
        replay=None,
        topic="",
        metrics=AgentMetrics(),
        sync_for=never,
        all_syncs=list,
        clear_command=never,
        start_time_changed=never,
    )


class MonitorFaultSocket(zmq.asyncio.Socket):
    """A fake for fault injection: a socket whose ``get_monitor_socket`` raises the ZMQ
    error a context out of file descriptors would (EMFILE)."""

    def get_monitor_socket(self, *args: Any, **kwargs: Any) -> Any:
        raise zmq.ZMQError(errno.EMFILE)


class MonitorFaultContext(zmq.asyncio.Context):
    _socket_class = MonitorFaultSocket


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def test_a_refused_connect_leaves_no_socket_open(ctx: zmq.asyncio.Context) -> None:
    stream = _stream(ctx, REFUSED_IPC)
    with _no_unclosed_socket_warnings():
        for _ in range(3):  # as a retried start-up would
            with pytest.raises(zmq.ZMQError) as failed:
                stream.subscribe()
            assert failed.value.errno == errno.ENAMETOOLONG
            # the error (and its traceback) still held, as a log record holds it
            assert _open(ctx) == 0
            stream.close()  # what Agent._undo_start does; nothing left for it
            assert _open(ctx) == 0
        del failed


def test_a_failed_monitor_leaves_no_socket_open() -> None:
    ctx = MonitorFaultContext()
    try:
        stream = _stream(ctx, "tcp://127.0.0.1:1")
        with _no_unclosed_socket_warnings():
            with pytest.raises(zmq.ZMQError) as failed:
                stream.subscribe()
            assert failed.value.errno == errno.EMFILE
            assert _open(ctx) == 0
            stream.close()
            assert _open(ctx) == 0
            del failed
    finally:
        ctx.destroy(linger=0)


def test_a_subscription_is_closed_by_close_and_made_again(ctx: zmq.asyncio.Context) -> None:
    """The public close: both sockets closed, idempotent, and a later subscribe works."""
    stream = _stream(ctx, "tcp://127.0.0.1:1")  # connect is asynchronous: nothing listens
    stream.subscribe()
    stream.subscribe()  # already subscribed: nothing more made
    assert _open(ctx) == 2  # the SUB socket and its monitor
    stream.close()
    stream.close()
    assert _open(ctx) == 0
    stream.subscribe()
    assert _open(ctx) == 2
    stream.close()
    assert _open(ctx) == 0


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex())
    await r.stub.start()
    yield r
    await r.close()


async def test_an_agent_retrying_a_refused_subscribe_keeps_no_socket(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """A real agent whose event endpoint ZMQ refuses: its start-up fails at the subscribe
    and is retried; the agent's context holds no socket between attempts (before: one more
    open SUB socket per attempt while the logged errors were kept)."""
    caplog.set_level(logging.INFO, logger="cachecore.agent.agent")
    rig.events_ep = REFUSED_IPC
    agent = rig.agent = Agent(rig.settings(), rig.index)
    with _no_unclosed_socket_warnings():
        await agent.start()
        await until(
            lambda: counter_total(agent.metrics.loop_restarts, replica="r0", loop="start") >= 3,
            timeout_s=15.0,
        )
        assert _open(agent.ctx) == 0
        assert "File name too long" in (agent.health()["loops"]["start"]["last_error"] or "")
        await rig.stop_agent()
