"""A gateway whose start fails leaves nothing running or open. ``Gateway.start`` makes its
resources one after another (the request trace, the HTTP client, the loop lag monitor, the
pool, the index, the load refresher, the agents, discovery, the health checks, the policy
poller) and several steps can raise; nobody called ``Gateway.stop`` then (uvicorn runs no
lifespan shutdown after a failed start-up, and the lifespan called ``gw.start()`` outside
its try/finally), so the client, the tasks, the trace file and the Redis clients stayed
open for the rest of the process. Now a start that raises (a cancellation too) stops what
it made and raises the original exception; ``stop`` is safe on a gateway started part way.

Real pieces: a redis-server of the test's own on a free loopback port (its CLIENT LIST
counts the gateway's connections, tests/test_h28_redis_clients_closed's helpers), a raw
HTTP engine on loopback, a tokenizer.json cut short (a natural policy refusal). Faults
injected: an ``agent_hook`` (the gateway's public hook) that raises; an engine whose
``/metrics`` does not answer, so start-up waits in its block-size check and is cancelled
there; a KeyStore whose poller does not start (the one step the lifespan runs after
``gw.start()``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from cachecore.index.layout import KeyLayout
from cachecore.index.redis import RedisIndex
from cachecore.loadstate import RedisLoadStore
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer, free_port
from gateway.app import create_app
from gateway.auth import KeyReload, KeyStore
from gateway.core import Gateway
from gateway.serve import build_gateway
from gateway.settings import GatewaySettings
from policies.schema import PolicyError, parse_policy_text
from tests.test_h24_tok_reload import _hf_policy, _truncated
from tests.test_h28_redis_clients_closed import wait_for_clients
from tests.test_upstream_faults import MODEL, answer, read_request

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

LONG_DRAIN_S = 30.0  # a stop that waited for it would overrun the test's bounds


class Engine:
    """A raw HTTP/1.1 engine on loopback: /health and /v1/models answer; with
    ``stall_metrics`` a GET /metrics is read and never answered (an engine slow at
    start-up), ``metrics_asked`` set when one arrives."""

    def __init__(self, stall_metrics: bool = False) -> None:
        self.stall_metrics = stall_metrics
        self.metrics_asked = asyncio.Event()
        self.tasks: set[asyncio.Task[Any]] = set()  # its connections' (not the gateway's)
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while (req := await read_request(r)) is not None:
                line = req[0].split(b"\r\n", 1)[0]
                if line.startswith(b"GET /health"):
                    w.write(answer(200, b"{}"))
                elif line.startswith(b"GET /v1/models"):
                    models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                    w.write(answer(200, json.dumps(models).encode()))
                elif line.startswith(b"GET /metrics") and self.stall_metrics:
                    self.metrics_asked.set()
                    await r.read()  # until the gateway closes its side
                    return
                else:
                    w.write(answer(404, b"{}"))
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()


@contextlib.asynccontextmanager
async def engine(stall_metrics: bool = False) -> AsyncIterator[Engine]:
    e = Engine(stall_metrics)
    await e.start()
    try:
        yield e
    finally:
        await e.stop()


def settings(redis: str, replicas: Sequence[str], tmp_path: Path, **kw: Any) -> GatewaySettings:
    """Every Redis client build_gateway makes (index, load store, registry, key store)
    and a request trace file."""
    return GatewaySettings(
        replicas=list(replicas),
        replica_allowlist=[],
        port=free_port(),
        salt_secrets=[SecretStr("s" * 32)],
        seed=7,
        redis_url=redis,
        redis_timeout_s=PATIENT_TIMEOUT_S,
        discover=True,
        api_keys_redis=True,
        api_keys_redis_timeout_s=PATIENT_TIMEOUT_S,
        open_access=False,
        trace_out=tmp_path / "trace.jsonl",
        drain_timeout_s=LONG_DRAIN_S,
        **kw,
    )


def is_open(path: Path) -> bool:
    """This process has ``path`` open (among /proc/self/fd's targets)."""
    target = str(path.resolve())
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == target:
                return True
    return False


async def assert_nothing_left(
    gw: Gateway, url: str, tasks_before: set[asyncio.Task[Any]], trace: Path, engine: Engine
) -> None:
    """No Redis connection, no task the start made still running, the HTTP client and the
    trace file closed, the loop lag monitor stopped (every one that is not, in one message)."""
    deadline = time.monotonic() + 5.0
    while True:  # a cancelled background task ends at its next loop turn
        ours = tasks_before | engine.tasks
        running = [t for t in asyncio.all_tasks() - ours if not t.done()]
        if not running or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    left = wait_for_clients(url, 0, at_least=False)
    problems = [f"task still running: {t.get_coro()}" for t in running]
    problems += [f"Redis connection still open: {c}" for c in left]
    if gw.client is None or not gw.client.is_closed:
        problems.append("the HTTP client is open")
    if gw.loop_lag is None or gw.loop_lag.running:
        problems.append("the loop lag monitor runs")
    if is_open(trace):
        problems.append("the trace file is open")
    if not gw.draining:
        problems.append("the gateway is not draining")
    assert problems == [], "left by the failed start:\n" + "\n".join(problems)


@pytest.fixture
async def stop_at_end() -> AsyncIterator[list[Gateway]]:
    """Gateways stopped (again) when the test ends: what a regression left running would
    outlive the test, and the close of its event loop waited for it for minutes."""
    gateways: list[Gateway] = []
    yield gateways
    for gw in gateways:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(10.0):
                await gw.stop()


def agent_spec(e: Engine) -> str:
    """``URL=EVENTS,REPLAY``: the gateway hands it to its agent hook."""
    return f"{e.url}=tcp://127.0.0.1:{free_port()},tcp://127.0.0.1:{free_port()}"


async def test_a_start_failing_at_its_agents_stops_what_it_started_and_raises_that_error(
    redis_own: RedisServer, stop_at_end: list[Gateway], tmp_path: Path
) -> None:
    url = redis_own.url
    boom = RuntimeError("the embedded agents did not start")
    reached: list[int] = []

    async def failing_agents(*args: Any) -> Callable[[], Awaitable[None]]:
        # the index answered its checks; the refresher's first round reaches Redis too
        reached.append(len(wait_for_clients(url, 2, at_least=True)))
        raise boom

    async with engine() as e:
        gw = build_gateway(settings(url, [agent_spec(e)], tmp_path), agent_hook=failing_agents)
        stop_at_end.append(gw)
        assert gw.key_store.configured
        await gw.key_store.tenant_for("Bearer sk-unknown")  # its client connected too
        before = asyncio.all_tasks()
        with pytest.raises(RuntimeError) as exc:
            await gw.start()
        assert exc.value is boom  # the original, not one from the clean-up
        assert reached and reached[0] >= 2, reached  # connections its stop must close
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)
        await gw.stop()  # a second stop (a caller's finally) is harmless


async def test_a_start_cancelled_in_its_last_check_stops_everything_and_stays_cancelled(
    redis_own: RedisServer, stop_at_end: list[Gateway], tmp_path: Path
) -> None:
    """A shutdown during start-up: cancelled while the block-size check waits for a slow
    engine, once discovery, the health checks and the policy poller run."""
    url = redis_own.url
    policy = tmp_path / "policy.yaml"
    policy.write_text("routing: {strategy: random}\n")
    async with engine(stall_metrics=True) as e:
        gs = settings(url, [e.url], tmp_path, policy=policy, policy_poll_s=0.05)
        gw = build_gateway(gs)
        stop_at_end.append(gw)
        await gw.key_store.tenant_for("Bearer sk-unknown")
        before = asyncio.all_tasks()
        start = asyncio.ensure_future(gw.start())
        async with asyncio.timeout(10.0):
            await e.metrics_asked.wait()
        assert gw.discovery is not None and gw.pool is not None and gw.refresher is not None
        assert len(wait_for_clients(url, 4, at_least=True)) >= 4
        start.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert start.cancelled()
        assert time.monotonic() - t0 < 5.0  # no drain wait
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)


async def test_a_start_failing_before_the_index_closes_what_it_was_given_at_once(
    redis_own: RedisServer, stop_at_end: list[Gateway], tmp_path: Path
) -> None:
    """Refused in load_hf, before the index is wrapped: the index, load store, registry
    and key store it was given are closed all the same, without a drain wait."""
    url = redis_own.url
    bad = _truncated(tmp_path / "bad")
    index = RedisIndex.from_url(
        url, KeyLayout(), socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    load_store = RedisLoadStore.from_url(
        url, KeyLayout(), socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    async with engine() as e:
        gw = build_gateway(
            settings(url, [e.url], tmp_path),
            policy=parse_policy_text(_hf_policy(bad)),
            index=index,
            load_store=load_store,
        )
        stop_at_end.append(gw)
        # an embedder that checked its Redis first: every client holds a connection
        await index.eviction_policies()
        await load_store.heartbeat("gw-probe", ["r0"], int(time.time() * 1000))
        assert gw.registry is not None
        await gw.registry.discover(int(time.time() * 1000))
        await gw.key_store.tenant_for("Bearer sk-unknown")
        assert len(wait_for_clients(url, 4, at_least=True)) >= 4
        before = asyncio.all_tasks()
        t0 = time.monotonic()
        with pytest.raises(PolicyError, match="does not load"):
            await gw.start()
        assert time.monotonic() - t0 < LONG_DRAIN_S / 3
        assert gw.index is None  # it failed where meant
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)


async def test_an_app_whose_start_up_fails_leaks_nothing(
    redis_own: RedisServer, stop_at_end: list[Gateway], tmp_path: Path
) -> None:
    """The lifespan uvicorn runs: its start-up raises the gateway's refusal, and nothing
    of the gateway stays open (uvicorn runs no shutdown after a failed start-up)."""
    url = redis_own.url
    bad = _truncated(tmp_path / "bad")
    async with engine() as e:
        gw = build_gateway(
            settings(url, [e.url], tmp_path), policy=parse_policy_text(_hf_policy(bad))
        )
        stop_at_end.append(gw)
        await gw.key_store.tenant_for("Bearer sk-unknown")
        app = create_app(gw)
        before = asyncio.all_tasks()
        with pytest.raises(PolicyError, match="does not load"):
            async with app.router.lifespan_context(app):
                pytest.fail("the start-up succeeded")
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)


class _PollerFails(KeyStore):
    """A key store whose file poller does not start: the fault injected after a start
    that succeeded."""

    def start(self, interval_s: float, on_result: Callable[[KeyReload | None, str], None]) -> None:
        raise OSError("the key file poller did not start")


async def test_the_lifespan_stops_a_started_gateway_when_a_later_start_up_step_fails(
    redis_own: RedisServer, stop_at_end: list[Gateway], tmp_path: Path
) -> None:
    url = redis_own.url
    async with engine() as e:
        gs = settings(url, [e.url], tmp_path).model_copy(update={"api_keys_redis": False})
        gw = build_gateway(gs, key_store=_PollerFails(open_access=True))
        stop_at_end.append(gw)
        app = create_app(gw)
        before = asyncio.all_tasks()
        with pytest.raises(OSError, match="did not start"):
            async with app.router.lifespan_context(app):
                pytest.fail("the start-up succeeded")
        await assert_nothing_left(gw, url, before, tmp_path / "trace.jsonl", e)
