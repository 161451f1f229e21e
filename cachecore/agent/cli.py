"""``kvgate agent``: one engine's cache agent as its own process, writing to Redis.

    kvgate agent --replica-id r0 --engine-url http://10.0.0.5:8000 \\
        --events tcp://10.0.0.5:5557 --replay tcp://10.0.0.5:5558 \\
        --redis redis://agent-r0:PASSWORD@redis:6379/0

A standalone agent needs ``--redis`` (without it there is no index another process could
read; the embedded in-memory index lives inside ``kvgate serve``); on a Redis Cluster, give
one node's URL (database 0) and ``--redis-cluster``. SIGTERM and SIGINT stop it
cleanly: while its engine still answers ``/health`` it leaves the replica's registration for
the next agent (``--handover-window``, 10 s: a restart or upgrade keeps the engine in every
discovering gateway), else it deregisters the replica (``--deregister-on-stop``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cachecore.agent.agent import STOP_STEP_S, Agent
from cachecore.agent.http import HTTP_STOP_S, AgentHTTPServer
from cachecore.agent.settings import (
    AgentSettings,
    StopRegistration,
    handover_window_warning,
    index_timeouts,
)
from cachecore.argtypes import (
    log_level,
    name_variables,
    nonnegative_float,
    settings_variables,
    unknown_settings,
)
from cachecore.argtypes import settings_error as shared_settings_error
from cachecore.index.layout import DEFAULT_PREFIX, KeyLayout
from cachecore.listen import ListenError, listen_advice
from cachecore.logs import configure_logging
from cachecore.tasks import Step, cancel_and_wait, enclosing_limit_s, run_steps, run_to_end
from cachecore.urls import url_host

if TYPE_CHECKING:  # imported when run: `kvgate agent --help` stays fast
    from cachecore.index.redis import RedisIndex
    from cachecore.loadstate import RedisLoadStore
    from cachecore.registry import RedisRegistry

log = logging.getLogger(__name__)

DEFAULT_HTTP_PORT = 9400
GC_FREEZE_INTERVAL_S = 2.0

# CLI flag -> settings field, for flags that map one to one
_FIELDS = {
    "replica_id": "replica_id",
    "engine_url": "engine_url",
    "events": "events",
    "replay": "replay",
    "redis": "redis",
    "redis_cluster": "redis_cluster",
    "redis_timeout": "redis_timeout_s",
    "topic": "topic",
    "model": "model",
    "block_size": "block_size",
    "data_parallel_rank": "data_parallel_rank",
    "attention_group": "attention_group",
    "scrape_interval": "scrape_interval_s",
    "unavailable_after": "unavailable_after_s",
    "heartbeat_interval": "heartbeat_interval_s",
    "registration_ttl": "registration_ttl_s",
    "deregister_on_stop": "deregister_on_stop",
    "handover_window": "handover_window_s",
    "replay_timeout": "replay_timeout_s",
    "max_coalesce_batches": "max_coalesce_batches",
    "http_host": "http_host",
    "http_port": "http_port",
    "trace_out": "trace_out",
    "key_prefix": "key_prefix",
}


def configure(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--replica-id", help="index replica id (env KVGATE_AGENT_REPLICA_ID)")
    p.add_argument("--engine-url", help="engine HTTP base URL, e.g. http://10.0.0.5:8000")
    p.add_argument("--events", help="engine KV-event PUB endpoint, e.g. tcp://10.0.0.5:5557")
    p.add_argument("--replay", help="engine replay ROUTER endpoint, e.g. tcp://10.0.0.5:5558")
    p.add_argument("--redis", help="redis://[user:password@]host:port/db (required)")
    p.add_argument(
        "--redis-cluster", action="store_true", default=None,  # None: the environment's
        help="--redis is a seed node of a Redis Cluster (env KVGATE_AGENT_REDIS_CLUSTER)",
    )  # fmt: skip
    p.add_argument(
        "--redis-timeout", type=float,
        help="connect and read timeout of the agent's Redis clients, s (unset: index "
        "writes 2 s, connect 1 s; load records 0.5 s; registration 1 s)",
    )  # fmt: skip
    p.add_argument(
        "--key-prefix",
        help=f"Redis key namespace (env KVGATE_AGENT_KEY_PREFIX; {DEFAULT_PREFIX!r})",
    )
    p.add_argument("--topic", help='ZMQ topic the engine publishes under (vLLM default "")')
    p.add_argument("--model", help="model name override (default: the engine's /v1/models)")
    p.add_argument("--block-size", type=int, help="override vllm:cache_config_info block_size")
    p.add_argument("--data-parallel-rank", type=int, help="the engine's DP rank (index id R@dpN)")
    p.add_argument(
        "--attention-group", type=int, help="hybrid models: group_idx of the full-attention group"
    )
    p.add_argument("--scrape-interval", type=float, help="engine /metrics interval, s (1.0)")
    p.add_argument(
        "--unavailable-after", type=float, help="scrape failing this long: unavailable, s (5)"
    )
    p.add_argument("--heartbeat-interval", type=float, help="registration heartbeat, s (2)")
    p.add_argument("--registration-ttl", type=float, help="registration TTL, s (10)")
    p.add_argument(
        "--deregister-on-stop", choices=[m.value for m in StopRegistration],
        help="a clean stop: auto (default) deregisters only if the engine does not answer "
        "/health, else leaves the registration for the next agent; always; never",
    )  # fmt: skip
    p.add_argument(
        "--handover-window", type=float,
        help="how long a registration left at a clean stop stays for the next agent, s (10)",
    )  # fmt: skip
    p.add_argument("--replay-timeout", type=float, help="replay reply timeout, s (2)")
    p.add_argument("--max-coalesce-batches", type=int, help="batches per index write (512)")
    p.add_argument("--http-host", help="bind address of /metrics and /health (127.0.0.1)")
    p.add_argument(
        "--http-port", type=int, help=f"port of /metrics and /health ({DEFAULT_HTTP_PORT}; 0 any)"
    )
    # a str, made a Path by the settings: Path("") is ".", and an empty one is refused there
    p.add_argument("--trace-out", help="JSON lines of applied changes (trace analysis)")
    p.add_argument("--no-register", action="store_true", help="do not register the replica")
    p.add_argument(
        "--gc-freeze-interval", type=nonnegative_float, default=GC_FREEZE_INTERVAL_S,
        help="seconds between gc.freeze() calls, which keep the long-lived index mirror "
        "out of Python's full collections (their pauses were the event-to-index p99); "
        "%(default)s, 0: off",
    )  # fmt: skip
    p.add_argument("--log-level", type=log_level, default="INFO")
    p.add_argument("--log-text", action="store_true", help="plain text logs instead of JSON")
    # each flag above that sets a setting names its variable (KVGATE_AGENT_*)
    name_variables(p, AgentSettings, _FIELDS)


def settings_error(exc: ValidationError) -> str:
    """A settings refusal in one line, each field with its flag and environment variable."""
    flags = {name: f"--{flag.replace('_', '-')}" for flag, name in _FIELDS.items()}
    return shared_settings_error(exc, env_prefix="KVGATE_AGENT_", flags=flags)


def settings_from_args(args: argparse.Namespace) -> AgentSettings:
    """Flags override ``KVGATE_AGENT_*`` environment variables."""
    given: dict[str, Any] = {}
    for flag, name in _FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None:
            given[name] = value
    settings = AgentSettings(**given)
    if settings.http_port is None:  # neither --http-port nor KVGATE_AGENT_HTTP_PORT
        settings = settings.model_copy(update={"http_port": DEFAULT_HTTP_PORT})
    return settings


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, json_format=not args.log_text)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine scrape
    known = settings_variables(AgentSettings)
    for warning in unknown_settings(os.environ, known, "KVGATE_AGENT_", "kvgate agent"):
        log.warning(warning)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvgate agent: {settings_error(exc)}", file=sys.stderr)
        return 2
    except ValueError as exc:  # pydantic-settings' SettingsError: an environment value unparsed
        print(f"kvgate agent: {exc}", file=sys.stderr)
        return 2
    if not settings.redis:
        print(
            "kvgate agent: --redis is required for a standalone agent (the embedded index "
            "lives in `kvgate serve --replica URL=EVENTS,REPLAY`)",
            file=sys.stderr,
        )
        return 2
    window_warning = handover_window_warning(settings)
    if window_warning is not None and not args.no_register:  # only a registration is kept
        log.warning(window_warning, extra={"replica": settings.replica_id})
    try:
        return asyncio.run(
            _main(
                settings,
                settings.key_prefix,
                register=not args.no_register,
                gc_freeze_interval_s=args.gc_freeze_interval,
            )
        )
    except KeyboardInterrupt:
        return 130


def redis_stores(
    settings: AgentSettings, key_prefix: str = DEFAULT_PREFIX, register: bool = True
) -> tuple[RedisIndex, RedisLoadStore, RedisRegistry | None]:
    """The standalone agent's index, load store and (with ``register``) registry on
    ``settings.redis``, a Redis Cluster's seed node with ``settings.redis_cluster``."""
    from cachecore.index.redis import RedisIndex, redis_timeouts
    from cachecore.loadstate import RedisLoadStore
    from cachecore.registry import RedisRegistry

    if not settings.redis:
        raise ValueError("the agent's redis URL is not set")
    url, cluster, layout = settings.redis, settings.redis_cluster, KeyLayout(key_prefix)
    if settings.removal_log == 0:
        # the gateways cannot tell an eviction stored again from a lie any more: their
        # checks of such a miss are unverifiable, and quarantine.max_unverifiable of them
        # among unverifiable_window checked requests quarantine this replica (D22)
        log.warning(
            "KVGATE_AGENT_REMOVAL_LOG=0: the gateways' claim checks of this replica become "
            "unverifiable where a claimed block was evicted and stored again, and enough "
            "of them quarantine it; keep a removal log, or set the gateways' "
            "quarantine.max_unverifiable: 0 (that track off)",
            extra={"replica": settings.replica_id},
        )
    index = RedisIndex.from_url(
        url, layout, cluster=cluster, removal_log=settings.removal_log, **index_timeouts(settings)
    )
    timeouts = redis_timeouts(settings.redis_timeout_s)  # the operator's, or each store's own
    load_store = RedisLoadStore.from_url(url, layout, cluster=cluster, **timeouts)
    registry = (
        RedisRegistry.from_url(url, layout, cluster=cluster, **timeouts) if register else None
    )
    return index, load_store, registry


async def _gc_freezer(interval_s: float) -> None:
    """The mirror is millions of small long-lived objects. CPython's full (gen 2) collection
    walks all of them: 70-130 ms pauses at ~100k blocks, growing with the mirror, which were
    the whole event-to-index p99 tail. Freezing moves survivors out of the collector's view
    (refcounting still frees them; the mirror holds no reference cycles), so collections only
    scan young objects. A process-wide policy, hence set by the entry point only."""
    while True:
        gc.freeze()
        await asyncio.sleep(interval_s)


async def _main(
    settings: AgentSettings, key_prefix: str, register: bool, gc_freeze_interval_s: float = 0.0
) -> int:
    try:
        index, load_store, registry = redis_stores(settings, key_prefix, register)
    except ValueError as exc:  # a URL the client refuses, e.g. a database on a cluster
        print(f"kvgate agent: {exc}", file=sys.stderr)
        return 2
    problem = await _cluster_mode_problem(settings)
    if problem is not None:
        print(f"kvgate agent: {problem}", file=sys.stderr)
        await _close(index, load_store, registry)
        return 2
    try:
        agent = Agent(settings, index, load_store, registry)
    except OSError as exc:  # the constructor opens --trace-out
        print(
            f"kvgate agent: cannot open --trace-out {settings.trace_out} ({exc.strerror})",
            file=sys.stderr,
        )
        await _close(index, load_store, registry)
        return 2
    server: AgentHTTPServer | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    freezer = (
        asyncio.create_task(_gc_freezer(gc_freeze_interval_s), name="gc-freezer")
        if gc_freeze_interval_s > 0
        else None
    )
    # release the registration only after a start: one that failed to listen never
    # registered, and its deregistration (a Redis call) was a "deregistration failed"
    # warning for nothing
    started = False
    host = url_host(settings.http_host)  # "::1:9400" reads as an address

    async def serve() -> int:
        nonlocal server, started
        if settings.http_port is not None:
            try:  # the constructor listens: a port in use fails there
                server = AgentHTTPServer([agent], settings.http_host, settings.http_port)
            except ListenError as exc:
                advice = listen_advice(
                    exc,
                    port="; give each agent on a host its own --http-port",
                    host="; --http-host (KVGATE_AGENT_HTTP_HOST) takes an address or a name",
                )
                print(
                    f"kvgate agent: cannot listen on {host}:{settings.http_port} "
                    f"({exc.reason}){advice}",
                    file=sys.stderr,
                )
                return 2
            await server.start()
            log.info(
                "agent http listening", extra={"host": settings.http_host, "port": server.port}
            )
            print(f"agent {settings.replica_id}: http://{host}:{server.port}", flush=True)
        started = True
        await agent.start()
        await stop.wait()
        log.info("agent stopping", extra={"replica": settings.replica_id})
        return 0

    async def shutdown() -> None:
        """Every step runs, in a task of its own (run_to_end): awaited in a finally one
        after another, agent.stop failing or cancelled skipped the HTTP server's stop and
        the Redis clients' close."""
        steps = _shutdown_steps(freezer, agent, started, server, (index, load_store, registry))
        # the steps' bounds are the real ones; this one keeps a step that ignores its
        # cancellation from holding the process for ever
        limit_s = sum(b or 0.0 for _, _, b in steps) + STOP_STEP_S
        work = run_steps(steps, "agent shutdown", replica=settings.replica_id)
        await run_to_end(work, limit_s, "agent shutdown")

    try:
        rc = await serve()
    except BaseException:
        # what ended the run (an error, a cancellation) is what is raised; the shutdown's
        # failures were logged by their steps
        try:
            await shutdown()
        except asyncio.CancelledError:
            log.warning("the agent's shutdown was cancelled; it ran to its end")
        except Exception as exc:
            log.warning(
                "the agent's shutdown failed too",
                extra={"replica": settings.replica_id, "error": repr(exc)},
            )
        raise
    await shutdown()
    return rc


def _shutdown_steps(
    freezer: asyncio.Task[None] | None,
    agent: Agent,
    started: bool,
    server: AgentHTTPServer | None,
    stores: Sequence[RedisIndex | RedisLoadStore | RedisRegistry | None],
) -> list[Step]:
    """The standalone agent's shutdown, in order: the GC freezer (cancelled and waited
    for), the agent (releasing the registration only after a start; bounded by its own
    stop's limit, which bounds each of its steps), the HTTP server, then each Redis
    client."""
    steps: list[Step] = []
    if freezer is not None:
        steps.append(("gc freezer", lambda: cancel_and_wait(freezer), STOP_STEP_S))
    release = None if started else False
    agent_s = enclosing_limit_s(agent.stop_limit_s)  # never shorter than its own
    steps.append(("agent", lambda: agent.stop(deregister=release), agent_s))
    if server is not None:
        steps.append(("http server", server.stop, enclosing_limit_s(HTTP_STOP_S)))
    for name, store in zip(("index", "load store", "registry"), stores, strict=True):
        if store is not None:
            steps.append((name, store.close, STOP_STEP_S))
    return steps


async def _cluster_mode_problem(settings: AgentSettings) -> str | None:
    """--redis-cluster against a standalone Redis: that server's answer was taken for an
    outage, "index not reachable at startup; retrying" for ever, never ready."""
    from cachecore.index.redis import cluster_mode_problem

    assert settings.redis is not None
    switch = "--redis-cluster (KVGATE_AGENT_REDIS_CLUSTER)"
    try:
        async with asyncio.timeout(10.0):  # bounded: a Redis that does not answer is retried later
            return await cluster_mode_problem(settings.redis, settings.redis_cluster, switch)
    except TimeoutError:
        return None


async def _close(*closables: RedisIndex | RedisLoadStore | RedisRegistry | None) -> None:
    for closable in closables:
        if closable is not None:
            with contextlib.suppress(Exception):
                await closable.close()
