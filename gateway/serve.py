"""``kvgate serve``: run the gateway; plus the Python API to start one in-process or as a
subprocess (tests, ``make demo``, ``kvgate bench gateway``).

In-process::

    settings = GatewaySettings(replicas=[url1, url2], open_access=True, port=free_port())
    with GatewayServer(settings) as srv:        # own thread and event loop
        ... srv.url, srv.gateway ...

    async with serve_in_loop(build_gateway(settings)) as url:   # in the caller's loop
        ...

Subprocess: :func:`start_gateway_process` runs ``python -m gateway.cli serve ...`` and
waits until it answers ``/health``.

SIGTERM: the server stops accepting (``/health`` answers 503 and new requests get 503),
lets in-flight requests and streams finish (up to ``drain_timeout_s``, once: the gateway's
stop gives those it cut :data:`CUT_END_S` to end, or ``drain_timeout_s`` where that is
shorter, not a drain of its own), stops the gateway, then exits. A Ctrl-C while it waits
for them cuts them and still stops the gateway; one more exits at once
(:class:`_DrainingServer`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx
import uvicorn
from pydantic import ValidationError

from cachecore.agent.embedded import embedded_agent_settings
from cachecore.agent.settings import AgentSettings
from cachecore.argtypes import (
    flag_settings,
    log_level,
    long_option,
    name_variables,
    settings_error,
    settings_variables,
)
from cachecore.argtypes import unknown_settings as shared_unknown_settings
from cachecore.index.base import PrefixIndex
from cachecore.index.layout import KeyLayout
from cachecore.index.redis import (
    RedisIndex,
    cluster_mode_problem,
    redis_client,
    redis_timeouts,
)
from cachecore.listen import LISTEN_BACKLOG, ListenError, bind_listeners, listen_advice
from cachecore.loadstate import LoadStore, MemoryLoadStore, RedisLoadStore
from cachecore.logs import configure_logging
from cachecore.process import freeze_startup_heap
from cachecore.urls import url_host
from gateway.app import create_app
from gateway.auth import KeyFileError, KeyStore
from gateway.core import AgentHook, Gateway
from gateway.hotpath import GatewayHttpProtocol
from gateway.replicas import ReplicaSpec, ReplicaSpecError, parse_replica_spec
from gateway.routing import Strategy
from gateway.settings import GatewaySettings
from policies.schema import Policy, PolicyError

log = logging.getLogger(__name__)

EMBEDDED_AGENT_MODULE = "cachecore.agent.embedded"
EMBEDDED_AGENT_FUNCTION = "start_embedded_agents"


def default_agent_hook() -> AgentHook | None:
    """The embedded agent starter, if the agent package provides one: a coroutine function
    ``start_embedded_agents(specs, index, load_store, metrics_registry) -> stop()`` in
    ``cachecore.agent.embedded``."""
    try:
        mod = importlib.import_module(EMBEDDED_AGENT_MODULE)
    except ImportError:
        return None
    hook = getattr(mod, EMBEDDED_AGENT_FUNCTION, None)
    return hook if callable(hook) else None


@contextlib.contextmanager
def _naming_redis_url() -> Iterator[None]:
    """A Redis URL the client refuses names the setting it came from: redis-py's own
    message ("Port could not be cast to integer value as 'abc'") read as --port's."""
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"--redis (KVGATE_REDIS_URL): {exc}") from None


def build_gateway(
    settings: GatewaySettings,
    *,
    policy: Policy | None = None,
    index: PrefixIndex | None = None,
    load_store: LoadStore | None = None,
    agent_hook: AgentHook | None = None,
    key_store: KeyStore | None = None,
    strategy: Strategy | None = None,
    span_exporter: Any = None,
) -> Gateway:
    """Assemble a :class:`Gateway` from settings: replicas, keys, index, load store."""
    specs = [parse_replica_spec(r) for r in settings.replicas]
    declared: dict[str, str] = {}
    for spec in specs:
        # the pool keeps one replica per id: a second declaration would be dropped while
        # its embedded agent still wrote its engine's blocks under the same id
        if spec.id in declared:
            raise ReplicaSpecError(
                f"replica id {spec.id!r} is declared twice ({declared[spec.id]} and "
                f"{spec.url}): give each engine (or data-parallel rank) its own ID="
            )
        declared[spec.id] = spec.url
    url, cluster = settings.redis_url, settings.redis_cluster
    layout = KeyLayout(settings.key_prefix)
    if settings.trace_out is not None:
        try:  # opened at start-up, where a failure was a traceback and uvicorn's exit 3
            with settings.trace_out.open("a"):
                pass
        except OSError as exc:
            raise OSError(
                f"cannot write --trace-out {settings.trace_out}: {exc.strerror or exc}"
            ) from None
    if cluster and not url:
        raise ValueError("redis_cluster (--redis-cluster) needs redis_url (--redis)")
    if key_store is None:
        redis_keys = None
        if settings.api_keys_redis:
            if not url:
                raise ValueError(
                    "--api-keys-redis (KVGATE_API_KEYS_REDIS) needs --redis (KVGATE_REDIS_URL):"
                    " the Redis that holds the key hash <prefix>:apikeys"
                )
            # one hash, one slot: plain HGETs, alike on standalone and Cluster
            with _naming_redis_url():
                timeout_s = settings.api_keys_redis_timeout_s
                redis_keys = redis_client(
                    url, cluster=cluster, socket_timeout_s=timeout_s, connect_timeout_s=timeout_s
                )
        try:
            key_store = KeyStore(
                redis=redis_keys,
                open_access=settings.open_access,
                redis_hash=layout.api_keys(),
                cache_ttl_s=settings.api_keys_cache_ttl_s,
                stale_s=settings.api_keys_stale_s,
                key_file=settings.api_keys_file,
                miss_rate=settings.api_keys_miss_rate,
                miss_burst=settings.api_keys_miss_burst,
                lookups_max=settings.api_keys_lookups_max,
                miss_rate_global=settings.api_keys_miss_rate_global,
                miss_burst_global=settings.api_keys_miss_burst_global,
                owns_redis=True,  # built here for it: closed by Gateway.stop
                redis_timeout_s=settings.api_keys_redis_timeout_s,
            )
        except KeyFileError as exc:  # named as the policy's refusal is ("invalid policy P: ")
            raise KeyFileError(
                f"invalid API key file (--api-keys, KVGATE_API_KEYS_FILE) {exc}"
            ) from None
    if not key_store.configured:
        raise ValueError(
            "no API keys configured: pass --api-keys FILE, --api-keys-redis, or --open"
        )
    timeouts = redis_timeouts(settings.redis_timeout_s)  # none set: each store's own
    if index is None and url:
        with _naming_redis_url():
            index = RedisIndex.from_url(url, layout, cluster=cluster, **timeouts)
    if load_store is None:
        with _naming_redis_url():
            load_store = (
                RedisLoadStore.from_url(url, layout, cluster=cluster, **timeouts)
                if url
                else MemoryLoadStore()
            )
    registry = None
    if settings.discover:
        if not url:
            raise ValueError("--discover needs --redis (agents register there)")
        from cachecore.registry import RedisRegistry

        registry = RedisRegistry.from_url(url, layout, cluster=cluster, **timeouts)
    gw = Gateway(
        settings,
        policy,
        index=index,
        load_store=load_store,
        key_store=key_store,
        agent_hook=agent_hook if agent_hook is not None else default_agent_hook(),
        replica_specs=specs,
        span_exporter=span_exporter,
        registry=registry,
    )
    if strategy is not None:  # the caller's, over KVGATE_STRATEGY (which Gateway read)
        gw.strategy_override = strategy
    gw.policies.weaken_settle_s = settings.policy_weaken_settle_s
    return gw


FORCE_CUT_S = 2.0
"""After a force-quit: how long the in-flight requests it cancelled get to end (each ends
at its next await, a stream with its ``draining`` error event) before the gateway's stop,
which then waits for none of them (its drain is cut)."""

CUT_END_S = 2.0
"""After uvicorn's wait for the requests in flight has run out (the drain timeout) and cut
them: how long the gateway's stop still waits for them to end (each at its next await: its
503 or the stream's ``draining`` error event, its trace record) before it closes what they
use. The end of the one drain budget (:meth:`_DrainingServer.shutdown`). The stop's drain
is also bounded by ``drain_timeout_s`` itself (:meth:`Gateway.stop`), so with a drain
timeout under this the cut requests get the drain timeout, not this."""

_UVICORN_CLOSE_PAUSE_S = 0.1
"""uvicorn's ``Server.shutdown`` (0.55) sleeps this long between closing the listeners and
its wait for the requests in flight (``timeout_graceful_shutdown``)."""


class _DrainingServer(uvicorn.Server):
    """uvicorn server that flips the gateway to draining the moment a stop is requested;
    with ``freeze_gc`` it freezes the start-up heap once the lifespan start-up is done.

    With ``drain_grace_s`` > 0 the first SIGTERM/SIGINT keeps the listener open that long
    before uvicorn's shutdown: ``/health`` answers 503 and new requests get 503
    ``draining``, so a load balancer's health checks take the gateway out of rotation while
    it still answers, instead of meeting refused connections. In-flight requests go on. A
    second signal ends the grace at once.

    The drain timeout is one budget (:meth:`shutdown`): uvicorn's wait for the requests in
    flight spends it and cuts those still running, and the lifespan's stop after it drains
    only what is left of it and :data:`CUT_END_S` for the cut requests to end, never more
    than the drain timeout (the stop's own bound). It drained for the whole timeout again:
    a request slow to end after its cut made a SIGTERM stop last the grace and twice the
    drain timeout.

    A SIGINT once the stop is under way (uvicorn's force-quit, Ctrl-C twice) cuts the
    in-flight requests instead of waiting for them, but the gateway's stop still runs to
    its end (uvicorn skips the lifespan shutdown on a force-quit: the embedded agents, the
    index, the stores, the request trace's last records were left to the process's exit),
    without draining again: a cut request still running after :data:`FORCE_CUT_S` made it
    wait up to the drain timeout more.
    A SIGINT after that one exits at once, for an operator whose stop hangs; SIGTERM never
    cuts the stop short."""

    def __init__(
        self,
        config: uvicorn.Config,
        gw: Gateway,
        freeze_gc: bool = False,
        drain_grace_s: float = 0.0,
    ) -> None:
        super().__init__(config)
        self.gw = gw
        self.freeze_gc = freeze_gc
        self.drain_grace_s = drain_grace_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if sockets is not None and self.started:  # uvicorn logs its address only without them
            for sock in sockets:
                host, port = sock.getsockname()[:2]
                log.info("serving", extra={"url": f"http://{url_host(host)}:{port}"})
        if self.freeze_gc and not self.should_exit:
            freeze_startup_heap()

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.gw.draining
        self.gw.draining = True
        loop = self._loop
        if first and self.drain_grace_s > 0 and self.started and loop is not None:
            log.info("draining before stopping", extra={"grace_s": self.drain_grace_s})
            self._captured_signals.append(sig)  # re-raised after the shutdown, as uvicorn does
            # a signal handler may interrupt the loop anywhere: only the thread-safe call
            loop.call_soon_threadsafe(loop.call_later, self.drain_grace_s, self._end_grace)
            return
        if sig == signal.SIGINT and self.force_exit:
            # Ctrl-C after a force-quit: the stop may take up to its bounds (a minute
            # with embedded agents), and an operator at a terminal needs a way out
            log.warning(
                "interrupted again: exiting before the gateway's stop has ended",
                extra={"signal": signal.Signals(sig).name},
            )
            for handler in logging.getLogger().handlers:
                handler.flush()  # os._exit skips it
            os._exit(128 + sig)
        forced = sig == signal.SIGINT and self.should_exit
        super().handle_exit(sig, frame)  # a force-quit sets force_exit: no drain wait
        if forced and loop is not None:
            loop.call_soon_threadsafe(self._cut_in_flight)

    def _end_grace(self) -> None:
        self.should_exit = True

    def _cut_in_flight(self) -> None:
        """A force-quit: cancel the requests still running, as uvicorn's drain timeout does
        (the gateway answers each as cut by the drain), instead of leaving them running
        under a stop that closes the client and the stores. The gateway's stop, to come or
        under way, does not wait for them (its drain is cut): only :meth:`shutdown` gives
        them :data:`FORCE_CUT_S` to end."""
        self.gw.cut_drain()
        tasks = list(self.server_state.tasks)
        log.warning(
            "forced to quit: cutting the requests in flight, then stopping the gateway",
            extra={"requests": len(tasks)},
        )
        for task in tasks:
            task.cancel(msg="Task cancelled, force quit")

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        budget_s = self.config.timeout_graceful_shutdown
        if budget_s is not None:  # None (an override, never kvgate serve's): uvicorn_config
            # one drain budget: uvicorn's wait below spends it, then cuts the requests
            # still running and runs the lifespan's stop, whose drain gets only what is
            # left of it and CUT_END_S (without: the drain timeout twice)
            loop = asyncio.get_running_loop()
            self.gw.drain_until(loop.time() + _UVICORN_CLOSE_PAUSE_S + budget_s + CUT_END_S)
        await super().shutdown(sockets)
        if self.force_exit and not self._lifespan_ended():
            # uvicorn skips the lifespan shutdown on a force-quit: the gateway's stop (its
            # steps each bounded) still runs, once the cut requests have ended
            tasks = list(self.server_state.tasks)
            if tasks:
                await asyncio.wait(tasks, timeout=FORCE_CUT_S)
            await self.lifespan.shutdown()

    def _lifespan_ended(self) -> bool:
        """Whether the lifespan's shutdown has run (or the lifespan has ended otherwise, or
        there is none): a force-quit that came while it ran found it under way."""
        event = getattr(self.lifespan, "shutdown_event", None)
        return event is None or event.is_set()


class _InLoopServer(_DrainingServer):
    """Runs inside someone else's event loop: leaves their signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_config(gw: Gateway, **overrides: Any) -> uvicorn.Config:
    """The gateway's uvicorn settings, ``overrides`` over them.

    ``timeout_graceful_shutdown`` is the gateway's ``drain_timeout_s``, always finite and
    > 0 (``KVGATE_DRAIN_TIMEOUT_S`` refuses 0, ``inf`` and an empty value; ``kvgate serve``
    has no flag for it): the one drain budget :meth:`_DrainingServer.shutdown` shares with
    :meth:`Gateway.stop`. No caller here overrides it. An override of None is uvicorn's
    wait without a bound, and nothing of the gateway's bounds it then: the requests in
    flight are waited for however long they run (a second SIGTERM does not end the wait,
    a force-quit does), no drain deadline is set, and the stop's drain finds none of them
    left (uvicorn waited for all, or the force-quit cut the drain), so it does not drain a
    second time. Measured (in-process, drain timeout 1 s, grace 0.3 s): a request that
    ends 3 s after the SIGTERM held the stop 3.08 s, with no drain timeout logged; one of
    20 s with a force-quit 2 s in: 2.07 s."""
    s = gw.settings
    app = create_app(gw)
    kwargs: dict[str, Any] = {
        "host": s.host,
        "port": s.port,
        "loop": "uvloop",
        "http": functools.partial(GatewayHttpProtocol, completions=app.state.completions),
        "lifespan": "on",
        "log_config": None,
        "access_log": False,
        # the gateway reads no client address, so X-Forwarded-* rewriting is work for nothing
        "proxy_headers": False,
        "timeout_graceful_shutdown": s.drain_timeout_s,  # seconds, fractions kept
        "timeout_keep_alive": 75,
        "backlog": LISTEN_BACKLOG,
    }
    kwargs.update(overrides)
    return uvicorn.Config(app, **kwargs)


class GatewayServer:
    """A gateway on its own thread and event loop (for synchronous callers)."""

    def __init__(self, settings: GatewaySettings | Gateway, **build: Any) -> None:
        self.gateway = (
            settings if isinstance(settings, Gateway) else build_gateway(settings, **build)
        )
        self._server = _DrainingServer(uvicorn_config(self.gateway, loop="asyncio"), self.gateway)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        s = self.gateway.settings
        return f"http://{s.host}:{s.port}"

    def start(self, timeout_s: float = 20.0) -> GatewayServer:
        self._thread = threading.Thread(target=self._server.run, name="kvgate-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway failed to start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop as a SIGTERM does (drain, then the gateway's stop) and wait for the server's
        thread to end: until it does by default (the stop bounds itself: docs/gateway.md,
        "how a stop runs"), at most ``timeout_s`` if given, then :class:`TimeoutError`
        while the thread still runs (a later ``stop()`` waits again). Before, the wait was
        a fixed 30 s that returned in silence with the thread still stopping: shorter than
        a stop at the defaults may take (drain 30 s + up to 2 s for cut requests + its
        steps), so a caller went on beside a gateway still draining and holding its port."""
        self.gateway.draining = True
        self._server.should_exit = True
        thread = self._thread
        if thread is None:
            return
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"the gateway's server thread is still stopping after {timeout_s} s")
        self._thread = None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.asynccontextmanager
async def serve_in_loop(gw: Gateway, timeout_s: float = 20.0) -> AsyncIterator[str]:
    """Run the gateway in the current event loop; yields its base URL."""
    server = _InLoopServer(uvicorn_config(gw, loop="none"), gw)
    task = asyncio.ensure_future(server.serve())
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("gateway exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("gateway did not start")
        await asyncio.sleep(0.01)
    try:
        yield f"http://{gw.settings.host}:{gw.settings.port}"
    finally:
        gw.draining = True
        server.should_exit = True
        await task


def start_gateway_process(
    args: Sequence[str], port: int, env: dict[str, str] | None = None, timeout_s: float = 30.0
) -> subprocess.Popen[bytes]:
    """``kvgate serve ARGS --port PORT`` as a subprocess, returned once /health answers."""
    cmd = [sys.executable, "-m", "gateway.cli", "serve", *args, "--port", str(port)]
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, env=full_env)
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=0.5).status_code == 200:
                return proc
        time.sleep(0.1)
    proc.terminate()
    raise TimeoutError("gateway did not become healthy")


# ---------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    # paths as text: the settings make them Paths and refuse an empty one ('' was '.')
    parser.add_argument("--policy", help="policy YAML (default: policies/default.yaml)")
    parser.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="[ID=]URL[=EVENTS,REPLAY]",
        help="an engine replica; with EVENTS,REPLAY an embedded cache agent follows it "
        "(repeatable; env KVGATE_REPLICAS, comma-separated)",
    )
    parser.add_argument("--redis", dest="redis_url", help="redis://... for the shared index")
    parser.add_argument(
        "--key-prefix",
        help="Redis key namespace, the agents' --key-prefix (env KVGATE_KEY_PREFIX; 'kvg')",
    )
    parser.add_argument(
        "--redis-cluster", action="store_true",
        help="--redis is a seed node of a Redis Cluster (env KVGATE_REDIS_CLUSTER)",
    )  # fmt: skip
    parser.add_argument(
        "--discover", action="store_true", help="add replicas that agents register in Redis"
    )
    parser.add_argument(
        "--allow", action="append", default=[], metavar="[ID=]URL",
        help="a replica URL agents may register, besides the --replica ones (repeatable; "
        "env KVGATE_REPLICA_ALLOWLIST, comma-separated)",
    )  # fmt: skip
    parser.add_argument("--api-keys", dest="api_keys_file", help="API key hash file")
    parser.add_argument("--api-keys-redis", action="store_true", help="API key hashes in Redis")
    parser.add_argument("--open", dest="open_access", action="store_true", help="no API keys")
    parser.add_argument(
        "--admin-key",
        help="admin key (env KVGATE_ADMIN_KEY, preferred: a flag shows in the process list)",
    )
    parser.add_argument("--host", help="listen address (env KVGATE_HOST; 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (env KVGATE_PORT; 8000)")
    parser.add_argument(
        "--strategy", choices=[s.value for s in Strategy],
        help="routing strategy, over the policy's routing.strategy (default: the policy's)",
    )  # fmt: skip
    parser.add_argument(
        "--seed", type=int, help="routing RNG seed (env KVGATE_SEED; default: random)"
    )
    parser.add_argument(
        "--gateway-id",
        help="this gateway's id in the shared in-flight records (env KVGATE_GATEWAY_ID; "
        "default: gw- and a random suffix)",
    )
    parser.add_argument(
        "--otel-endpoint",
        help="OTLP/HTTP traces endpoint (env KVGATE_OTEL_ENDPOINT; default: tracing off)",
    )
    parser.add_argument(
        "--trace-out", help="append one JSON line per answered request, for kvgate trace analyze"
    )
    parser.add_argument("--log-level", type=log_level, help="env KVGATE_LOG_LEVEL; INFO")
    parser.add_argument("--plain-logs", action="store_true", help="text logs instead of JSON")
    # each flag above that sets a setting names its variable (KVGATE_*), read off the model
    name_variables(parser, GatewaySettings, SERVE_RENAMED, SERVE_NEGATED)


# the flags of ``kvgate serve`` whose dest is not the name of the setting they set (every
# other flag's dest is its setting's field name), and the one that sets its setting false
SERVE_RENAMED = {"replica": "replicas", "allow": "replica_allowlist", "plain_logs": "log_json"}
SERVE_NEGATED = frozenset({"log_json"})


def serve_flags() -> dict[str, str]:
    """field -> the ``kvgate serve`` flag that sets it, read off the parser and the settings
    model (not kept by hand beside them), for a refusal to name the flag beside the
    variable: the value may have come from either."""
    parser = argparse.ArgumentParser()
    configure(parser)
    return {
        field: long_option(action)
        for field, action in flag_settings(parser, GatewaySettings, SERVE_RENAMED).items()
    }


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    overrides: dict[str, Any] = {}
    for name in (
        "policy", "redis_url", "api_keys_file", "admin_key", "host", "port", "seed",
        "gateway_id", "otel_endpoint", "log_level", "trace_out", "key_prefix", "strategy",
    ):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if args.replica:
        overrides["replicas"] = list(args.replica)
    if args.allow:
        overrides["replica_allowlist"] = list(args.allow)
    if args.discover:
        overrides["discover"] = True
    if args.api_keys_redis:
        overrides["api_keys_redis"] = True
    if args.redis_cluster:
        overrides["redis_cluster"] = True
    if args.open_access:
        overrides["open_access"] = True
    if args.plain_logs:
        overrides["log_json"] = False
    return GatewaySettings(**overrides)


def embedded_agent_settings_error(specs: Sequence[ReplicaSpec]) -> str | None:
    """Why the embedded agents' settings (``KVGATE_AGENT_*``, read as each agent starts)
    would be refused, or None. Checked before serving: the agents start inside the app's
    start-up, where a refusal was a traceback and uvicorn's exit 3."""
    spec = next((sp for sp in specs if sp.events), None)
    if spec is None:
        return None
    try:
        embedded_agent_settings(spec)
    except ValidationError as exc:
        return settings_error(exc, env_prefix=AgentSettings.model_config["env_prefix"])
    return None


def redis_mode_problem(settings: GatewaySettings) -> str | None:
    """--redis-cluster against a standalone Redis, or None (also when Redis does not
    answer: an outage the gateway serves through). That server's answer was otherwise taken
    for an outage for ever: every lookup fell back, the load and discovery never worked."""
    if not (settings.redis_url and settings.redis_cluster):
        return None
    url, switch = settings.redis_url, "--redis-cluster (KVGATE_REDIS_CLUSTER)"

    async def ask() -> str | None:
        try:  # bounded: a Redis that does not answer is served through, not waited for
            async with asyncio.timeout(10.0):
                return await cluster_mode_problem(url, True, switch)
        except TimeoutError:
            return None

    try:
        return asyncio.run(ask())
    except ValueError:  # a URL the client refuses: build_gateway says so, naming --redis
        return None


def unknown_settings(environ: Mapping[str, str]) -> list[str]:
    """:func:`cachecore.argtypes.unknown_settings` over every ``KVGATE_*`` variable: a
    gateway's environment holds its embedded agents' ``KVGATE_AGENT_*`` and is often shared
    with the replicas' ``KVGATE_REPLICA_*``, so all three are known here."""
    known = settings_variables(GatewaySettings, AgentSettings)
    if any(n.upper().startswith("KVGATE_REPLICA_") and n.upper() not in known for n in environ):
        # only then (KVGATE_REPLICA_ALLOWLIST is the gateway's own): the replica's settings
        # import the engine model and numpy, an OpenBLAS thread and ~13 MiB in a gateway
        from cachecore.replica.settings import ReplicaSettings

        known |= settings_variables(ReplicaSettings)
    return shared_unknown_settings(environ, known)


def no_replica_notice(settings: GatewaySettings) -> tuple[int, str]:
    """The start-up line (level, message) of a gateway with no static replica: with
    discovery and an allowlist the replicas come from the agents' registrations (not a
    problem); with discovery and no allowlist every registration is rejected."""
    if settings.discover and any(entry.strip() for entry in settings.replica_allowlist):
        return logging.INFO, (
            "no --replica given: replicas come from discovery (allowlisted agent "
            "registrations); until one has registered, a request naming a model gets 404 "
            "model_not_found and one without a model 503 no_replica"
        )
    if settings.discover:
        return logging.WARNING, (
            "no --replica and no --allow given: discovery rejects every registration, "
            "so no request can be served (404 model_not_found, or 503 without a model)"
        )
    return (
        logging.WARNING,
        "no --replica and no --discover given: no request can be served (404 "
        "model_not_found, or 503 without a model; pass --replica URL, or --redis URL "
        "--discover --allow URL)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvgate serve: {settings_error(exc, flags=serve_flags())}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_json)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call
    for warning in unknown_settings(os.environ):
        log.warning(warning)
    try:
        # held from here on and handed to uvicorn: a check that closed them again left a
        # window (the gateway's start-up) for another process to take the port
        listeners = bind_listeners(settings.host, settings.port)
    except ListenError as exc:  # else uvicorn logs "[Errno 98] ..." and exits 3
        advice = listen_advice(
            exc,
            port="; pick another --port (KVGATE_PORT) or stop what holds it",
            host="; --host (KVGATE_HOST) takes an address or a name of this host",
        )
        print(
            f"kvgate serve: cannot listen on {settings.host}:{settings.port} ({exc.reason})"
            f"{advice}",
            file=sys.stderr,
        )
        return 2
    try:
        problem = redis_mode_problem(settings)
        if problem is not None:
            log.error("cannot start the gateway", extra={"error": problem})
            print(f"kvgate serve: {problem}", file=sys.stderr)
            return 2
        try:
            gw = build_gateway(settings)  # --strategy is in the settings (strategy)
        except (PolicyError, ValueError, OSError) as exc:
            log.error("cannot start the gateway", extra={"error": str(exc)})
            print(f"kvgate serve: {exc}", file=sys.stderr)
            return 2
        agent_error = embedded_agent_settings_error(gw.specs)
        if agent_error is not None:
            log.error("cannot start the embedded agents", extra={"error": agent_error})
            print(f"kvgate serve: {agent_error}", file=sys.stderr)
            return 2
        if not gw.specs:
            log.log(*no_replica_notice(settings))
        if settings.replica_allowlist and not settings.discover:
            # only discovery reads it: the operator meant agents to register replicas
            log.warning(
                "--allow (KVGATE_REPLICA_ALLOWLIST) has no effect without --discover "
                "(KVGATE_DISCOVER): no agent's registration is read"
            )
        server = _DrainingServer(
            uvicorn_config(gw),
            gw,
            freeze_gc=settings.gc_freeze,
            drain_grace_s=settings.drain_grace_s,
        )
        server.run(sockets=listeners)
    finally:
        for sock in listeners:
            sock.close()
    return 0
