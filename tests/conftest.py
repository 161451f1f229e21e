"""Shared fixtures: real redis-server processes on free loopback ports; and a watchdog
that prints every asyncio task's stack shortly before a test's timeout."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

import pytest
import redis

from cachecore.testing import ClusterUnsupportedError, RedisClusterServers, RedisServer


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    """One real redis-server for the whole session (tests flush it via ``redis_url``)."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_url(redis_session: RedisServer) -> Iterator[str]:
    """URL of a flushed database on the session's redis-server."""
    if not redis_session.running:
        redis_session.start()
    client = redis.Redis.from_url(redis_session.url)
    client.flushall()
    client.close()
    yield redis_session.url


@pytest.fixture
def redis_own() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that stop or restart it."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A real 3-primary Redis Cluster for the session (tests flush it via ``cluster_url``).
    Skipped only when redis-server cannot run a cluster; any other failure to start errors."""
    try:
        cluster = RedisClusterServers(primaries=3).start()
    except ClusterUnsupportedError as exc:
        pytest.skip(f"redis-server lacks Redis Cluster support: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster_url(redis_cluster: RedisClusterServers) -> str:
    """A seed node's URL of the session's cluster, every node flushed."""
    redis_cluster.on_every_node("FLUSHALL")
    return redis_cluster.url


def dump_asyncio_tasks(out: TextIO) -> int:
    """Print the stack of every task of every running event loop (from any thread: for
    diagnosing a hang, when the loop sits idle in select). Returns the number of tasks."""
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    count = 0
    for loop in loops:
        if not loop.is_running():
            continue
        for _ in range(5):  # the loop's thread may change the task set meanwhile
            try:
                tasks = list(asyncio.all_tasks(loop))
                break
            except RuntimeError:
                continue
        else:
            tasks = []
        for task in tasks:
            print(f"--- {task!r}", file=out)
            task.print_stack(file=out)
            count += 1
    out.flush()
    return count


@pytest.fixture(autouse=True)
def _task_stacks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that hangs fails on pytest-timeout with only the main thread's stack, which
    for an async test is the event loop waiting in select. Shortly before that, print where
    every asyncio task is waiting (it shows in the test's captured stderr)."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker is not None and marker.args else 0.0
    if not limit:
        limit = float(request.config.getini("timeout") or 0)
    if limit < 10:
        yield
        return
    timer = threading.Timer(max(limit - 15.0, limit * 0.8), dump_asyncio_tasks, (sys.stderr,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(autouse=True)
def _drop_configured_log_handlers() -> Iterator[None]:
    """A test that runs a CLI's main for real calls ``configure_logging``, which puts a
    StreamHandler on the root logger bound to the stderr pytest captured for that test and
    closes after it: every later log record then wrote '--- Logging error ---' and a
    traceback into whatever stderr a later test was reading. Such handlers (the exact
    StreamHandler type: pytest's own capture handlers are subclasses) and the root level
    they set go when the test ends."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    added = [h for h in root.handlers if type(h) is logging.StreamHandler and h not in before]
    for handler in added:
        root.removeHandler(handler)
    if added:
        root.setLevel(level)


_UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture(autouse=True)
def _restore_uvicorn_loggers() -> Iterator[None]:
    """Each test starts with the process-wide uvicorn loggers as a fresh process has them
    (level NOTSET, propagating, no handlers of their own, enabled) and gets back what it
    found when it ends. A ``uvicorn.Config`` with a ``log_level`` (the agent's HTTP server,
    the agent tests' EngineStub: ``"warning"``) sets ``uvicorn.error`` to that level for the
    whole process, and one made with uvicorn's own log config also gives ``uvicorn`` a
    handler and ``propagate = False``; a later test then missed uvicorn's records in caplog
    ('Waiting for connections to close', 'Application shutdown complete.'):
    test_h30_forced_stop_drain and test_h30_single_drain failed in the full suite. Restoring
    what a test found was not enough: test_agent_fuzz's module-scoped rig makes its
    EngineStub before the first test's snapshot, so its WARNING level outlived the module
    (reproduced: test_agent_fuzz, then either file, fails without the reset)."""
    saved = []
    for name in _UVICORN_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level, lg.propagate, list(lg.handlers), lg.disabled))
        lg.setLevel(logging.NOTSET)
        lg.propagate = True
        lg.handlers.clear()
        lg.disabled = False
    yield
    for lg, level, propagate, handlers, disabled in saved:
        lg.setLevel(level)
        lg.propagate = propagate
        lg.handlers[:] = handlers
        lg.disabled = disabled
