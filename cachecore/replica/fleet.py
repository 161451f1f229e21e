"""Running a fleet of simulated replicas: in the current event loop (tests), or as a
``kvgate replica`` subprocess (benchmarks). Both give the replicas' endpoints.

In-process::

    async with run_fleet(ReplicaSettings(time_scale=0.1), count=2) as fleet:
        url = fleet.endpoints[0].url

Subprocess::

    with launch_fleet(2, ["--profile", "8b-h100-fast"]) as proc:
        urls = [e.url for e in proc.endpoints]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn
import zmq.asyncio
from starlette.types import ASGIApp

from cachecore.listen import ListenError, bind_listeners
from cachecore.replica.app import create_app
from cachecore.replica.dp import DataParallelFront
from cachecore.replica.server import SimReplica, TokenText
from cachecore.replica.settings import (
    ReplicaEndpoints,
    ReplicaPorts,
    ReplicaSettings,
    endpoints_for,
    load_score_template,
)
from cachecore.tasks import Step, run_steps, run_to_end
from cachecore.testing import free_ports
from cachecore.tokenizer import HFTokenizer, TokenizerError, builtin_tokenizer

logger = logging.getLogger(__name__)

FLEET_STEP_S = 10.0
"""How long one step of :func:`run_fleet`'s shutdown may take (a replica's engine, the HTTP
servers, a replica's event sockets) before it is cancelled, logged as failed, and the next
one runs."""


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signal handling to its owner (several servers share one
    event loop; uvicorn's own handlers would let only the last one see Ctrl-C)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass
class Fleet:
    settings: ReplicaSettings
    replicas: list[SimReplica]  # every engine core (a data-parallel replica's ranks in order)
    servers: list[uvicorn.Server] = field(default_factory=list)
    # each HTTP server's app: a replica's own, or the front of a data-parallel one's cores
    fronts: list[ASGIApp] = field(default_factory=list)

    @property
    def endpoints(self) -> list[ReplicaEndpoints]:
        return [r.endpoints for r in self.replicas]

    @property
    def urls(self) -> list[str]:
        return [r.endpoints.url for r in self.replicas]


def output_vocabulary(tokenizer: HFTokenizer) -> tuple[int, ...]:
    """The single-token words the simulated model "generates"; a tokenizer without enough
    of them (e.g. SentencePiece) falls back to a plain id range above its special tokens."""
    try:
        return tokenizer.word_vocabulary.ids
    except TokenizerError:
        return tuple(range(256, min(tokenizer.vocab_size, 32_000)))


def plan_ports(
    count: int, base_port: int | None = None, ports: Sequence[ReplicaPorts] | None = None
) -> list[ReplicaPorts]:
    """Explicit ports, or P+i / P+1000+i / P+2000+i from a base port, or free ports."""
    if ports is not None:
        if len(ports) != count:
            raise ValueError("one ReplicaPorts per replica")
        return list(ports)
    if base_port is not None:
        return [ReplicaPorts.from_base(base_port, i) for i in range(count)]
    free = free_ports(3 * count)
    return [ReplicaPorts(free[3 * i], free[3 * i + 1], free[3 * i + 2]) for i in range(count)]


def plan_rank_ports(
    servers: Sequence[ReplicaPorts], dp: int, planned: bool
) -> list[list[ReplicaPorts]]:
    """Each server's engine cores: core 0 on the server's ports, core r (data parallelism)
    on its HTTP port with its own event and replay ports: planned ports + r x servers (one
    server: + r, vLLM's offset by rank), else free ones."""
    if dp == 1:
        return [[p] for p in servers]
    n = len(servers)
    free = iter(free_ports(2 * n * (dp - 1))) if not planned else None
    out: list[list[ReplicaPorts]] = []
    for p in servers:
        ranks = [p]
        for r in range(1, dp):
            if free is None:
                ranks.append(ReplicaPorts(p.http, p.events + r * n, p.replay + r * n))
            else:
                ranks.append(ReplicaPorts(p.http, next(free), next(free)))
        out.append(ranks)
    taken = [q.events for ranks in out for q in ranks] + [q.replay for ranks in out for q in ranks]
    if len(set(taken)) != len(taken):
        raise ValueError("the cores' event and replay ports overlap: space the ports apart")
    return out


@contextlib.asynccontextmanager
async def run_fleet(
    settings: ReplicaSettings | None = None,
    count: int = 1,
    base_port: int | None = None,
    ports: Sequence[ReplicaPorts] | None = None,
    tokenizer: HFTokenizer | None = None,
) -> AsyncIterator[Fleet]:
    """Start ``count`` replicas (HTTP + ZMQ) in the running event loop; stop them on exit."""
    settings = settings or ReplicaSettings()
    fmt = settings.chat_template_content_format
    if tokenizer is None:
        tokenizer = (
            HFTokenizer.from_dir(Path(settings.tokenizer_dir), content_format=fmt)
            if settings.tokenizer_dir
            else builtin_tokenizer(fmt)
        )
    elif fmt != "auto":  # the operator's format over the given tokenizer's
        tokenizer = tokenizer.with_content_format(fmt)
    text = TokenText(tokenizer)
    vocab = output_vocabulary(tokenizer)
    # compiled once for the fleet, not once per replica
    score = load_score_template(settings.score_template) if settings.score_template else None
    ctx = zmq.asyncio.Context()
    dp = settings.data_parallel_size
    server_ports = plan_ports(count, base_port, ports)
    cores = plan_rank_ports(server_ports, dp, planned=base_port is not None or ports is not None)
    # one SimReplica per engine core; a data-parallel replica's cores share its HTTP port
    replicas = [
        SimReplica(
            i * dp + r, settings, p, tokenizer, ctx, text, vocab, r if dp > 1 else None, score
        )
        for i, ranks in enumerate(cores)
        for r, p in enumerate(ranks)
    ]
    fleet = Fleet(settings, replicas)
    tasks: list[asyncio.Task[None]] = []
    listeners: list[list[socket.socket]] = []
    try:
        for rep in replicas:
            await rep.start()
        # every HTTP port bound before any server starts: a port in use is an OSError here,
        # as one of the event ports is, not uvicorn's logged error and SystemExit(3)
        for i in range(count):
            port = replicas[i * dp].ports.http
            try:
                listeners.append(bind_listeners(settings.host, port))
            except ListenError as exc:  # the CLI prints it: name the port
                raise ListenError(f"{exc.reason} (HTTP {settings.host}:{port})") from None
        for i in range(count):
            rep = replicas[i * dp]
            app = create_app(rep) if dp == 1 else DataParallelFront(replicas[i * dp : i * dp + dp])
            fleet.fronts.append(app)
            config = uvicorn.Config(
                app,
                host=settings.host,
                port=rep.ports.http,
                lifespan="off",
                access_log=settings.access_log,
                log_config=None,
                timeout_graceful_shutdown=2,
                timeout_keep_alive=30,
            )
            server = _Server(config)
            fleet.servers.append(server)
            tasks.append(
                asyncio.create_task(server.serve(sockets=listeners[i]), name=f"http-{rep.index}")
            )
        deadline = time.monotonic() + 15
        while not all(s.started for s in fleet.servers):
            for t in tasks:
                if t.done():
                    t.result()  # re-raise the bind error
                    raise RuntimeError("a replica server exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("replica servers did not start")
            await asyncio.sleep(0.01)
        yield fleet
    except BaseException:
        # the error (a start-up's, the owner's cancellation) is raised; the shutdown's own
        # failure, or a cancellation during it, is logged
        try:
            await _stop_fleet(fleet, tasks, listeners, ctx)
        except asyncio.CancelledError:
            logger.warning("the replica fleet's stop was cancelled; it ran to its end")
        except Exception:
            logger.exception("stopping the replica fleet failed")
        raise
    await _stop_fleet(fleet, tasks, listeners, ctx)


async def _stop_fleet(
    fleet: Fleet,
    tasks: Sequence[asyncio.Task[None]],
    listeners: Sequence[Sequence[socket.socket]],
    ctx: zmq.asyncio.Context,
) -> None:
    """:func:`run_fleet`'s shutdown: every step of :func:`_stop_steps` runs, each within its
    bound, even when one fails or blocks (:func:`~cachecore.tasks.run_steps`: logged as
    ``fleet stop: a step failed`` with ``step``, the first failure raised at the end), in a
    task of its own run to its end (:func:`~cachecore.tasks.run_to_end`: its owner
    cancelled again during it stopped it in one step, and the HTTP servers served on, the
    event sockets stayed bound, the context alive)."""
    steps = _stop_steps(fleet, tasks, listeners, ctx)
    # the steps' bounds are the real ones; this one keeps a step that ignores its
    # cancellation from holding the owner for ever
    limit_s = sum(b or 0.0 for _, _, b in steps) + FLEET_STEP_S
    await run_to_end(run_steps(steps, "fleet stop"), limit_s, "fleet stop")


def _stop_steps(
    fleet: Fleet,
    tasks: Sequence[asyncio.Task[None]],
    listeners: Sequence[Sequence[socket.socket]],
    ctx: zmq.asyncio.Context,
) -> list[Step]:
    """The fleet's shutdown in order, each step with its bound and named for the log's
    ``step`` (``replica N: engine``, ``http servers``, ``replica N: event sockets``,
    ``listeners``, ``zmq context``): every replica's engine first (in-flight requests end,
    streams with an error chunk and [DONE], so the HTTP servers have no open responses to
    wait for), the HTTP servers, every replica's event sockets, the listening sockets, the
    ZMQ context."""

    def engine_stop(rep: SimReplica) -> Callable[[], Awaitable[None]]:
        return lambda: rep.driver.stop("replica shutting down")

    async def stop_servers() -> None:
        for s in fleet.servers:
            s.should_exit = True
        if tasks:  # uvicorn's graceful timeout (2 s) ends them; their outcomes are consumed
            await asyncio.wait(tasks)
            for t in tasks:
                if not t.cancelled():
                    t.exception()

    async def close_listeners() -> None:
        for socks in listeners:
            for sock in socks:
                sock.close()

    async def destroy_ctx() -> None:
        # destroy, not term: term() blocks the loop until every socket is closed, for ever
        # when a replica's stop failed before closing its own
        ctx.destroy(linger=0)

    steps: list[Step] = [
        (f"replica {rep.index}: engine", engine_stop(rep), FLEET_STEP_S) for rep in fleet.replicas
    ]
    steps.append(("http servers", stop_servers, FLEET_STEP_S))
    steps += [
        (f"replica {rep.index}: event sockets", rep.stop, FLEET_STEP_S) for rep in fleet.replicas
    ]
    steps.append(("listeners", close_listeners, None))
    steps.append(("zmq context", destroy_ctx, None))
    return steps


@dataclass
class FleetProcess:
    """The ``kvgate replica`` subprocess(es) of a fleet and the endpoints of its replicas:
    one process for all of them, or one per replica (``procs[i]`` serves ``endpoints[i]``)."""

    procs: list[subprocess.Popen[bytes]]
    endpoints: list[ReplicaEndpoints]
    log_path: Path | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The first (with one process per fleet, the only) process."""
        return self.procs[0]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    def stop(self, timeout_s: float = 10.0) -> None:
        running = [p for p in self.procs if p.poll() is None]
        for p in running:
            p.terminate()
        for p in running:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=timeout_s)


LOG_TAIL_LINES = 15


def _log_tail(log_path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of the fleet's log (the callers' logs are often temporary files,
    deleted with the error's context: the reason must travel in the message)."""
    if log_path is None:
        return ""
    try:
        with log_path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))  # the tail is enough; logs can be large
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _tail_note(log_path: Path | None) -> str:
    tail = _log_tail(log_path)
    return f"; the end of its log ({log_path}):\n{tail}" if tail else ""


def _check_alive(procs: Sequence[subprocess.Popen[bytes]], log_path: Path | None = None) -> None:
    for p in procs:
        if p.poll() is not None:
            msg = f"kvgate replica exited with code {p.returncode}"
            note = _tail_note(log_path)
            if note:
                msg += note
            elif log_path is None:
                msg += " (pass log_path to launch_fleet to keep its output)"
            raise RuntimeError(msg)


def _wait_ready(
    procs: Sequence[subprocess.Popen[bytes]],
    urls: Sequence[str],
    timeout_s: float,
    log_path: Path | None = None,
) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    with httpx.Client(timeout=1.0) as client:
        while pending:
            _check_alive(procs, log_path)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replicas not ready after {timeout_s}s: {pending}" + _tail_note(log_path)
                )
            url = pending[0]
            try:
                if client.get(f"{url}/health").status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.TransportError:
                pass
            time.sleep(0.05)


def _wait_ready_lines(
    procs: Sequence[subprocess.Popen[bytes]], log_path: Path, timeout_s: float, offset: int = 0
) -> None:
    """Wait for every process's ``ready {...}`` line (written past byte ``offset`` of the
    log): /health answers as soon as uvicorn is up, a moment before the endpoint lines are
    printed."""
    deadline = time.monotonic() + timeout_s
    # counted wherever they stand: two processes' lines can run together in the log
    while log_path.read_bytes()[offset:].count(b'ready {"profile"') < len(procs):
        _check_alive(procs, log_path)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no ready line in {log_path} after {timeout_s}s" + _tail_note(log_path)
            )
        time.sleep(0.02)


@contextlib.contextmanager
def launch_fleet(
    count: int,
    extra_args: Sequence[str] = (),
    settings: ReplicaSettings | None = None,
    ports: Sequence[ReplicaPorts] | None = None,
    timeout_s: float = 60.0,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    process_per_replica: bool = False,
) -> Iterator[FleetProcess]:
    """Run ``kvgate replica`` in a subprocess on free ports (or ``ports``), wait until every
    replica answers /health, and stop it on exit. ``extra_args`` are passed through (e.g.
    ``["--profile", "8b-h100-fast", "--time-scale", "0.1"]``); ``settings`` only informs the
    returned endpoints (host, model) and should match them. ``log_path`` receives the
    process's stdout (the endpoint lines) and logs.

    ``process_per_replica`` starts one process per replica: replicas that share a process
    share its event loop, so one replica's prefill step or request parse delays the others'
    step timers (loop lag that stretches their modelled time); benchmarks that need each
    replica's clock to hold use it."""
    settings = settings or ReplicaSettings()
    model = settings.model
    if "--model" in extra_args:
        model = extra_args[list(extra_args).index("--model") + 1]
    log_file = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    # ports picked here are free when picked, not when the replica binds them: another
    # process may take one in between (seen under parallel test runs), so a bind failure
    # on picked ports starts over on new ones; ports given by the caller are not retried
    attempts = 3 if ports is None else 1
    try:
        for attempt in range(attempts):
            planned = plan_ports(count, ports=ports)
            groups = [[p] for p in planned] if process_per_replica else [planned]
            endpoints = [
                endpoints_for(settings.model_copy(update={"model": model}), i, p)
                for i, p in enumerate(planned)
            ]
            procs: list[subprocess.Popen[bytes]] = []
            fp = FleetProcess(procs, endpoints, log_path)
            if log_file is not None:
                log_file.flush()
            offset = log_path.stat().st_size if log_path is not None else 0
            try:
                for group in groups:
                    cmd = [
                        sys.executable, "-m", "gateway.cli", "replica",
                        "--count", str(len(group)),
                        "--http-ports", ",".join(str(p.http) for p in group),
                        "--events-ports", ",".join(str(p.events) for p in group),
                        "--replay-ports", ",".join(str(p.replay) for p in group),
                        *extra_args,
                    ]  # fmt: skip
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdout=log_file if log_file is not None else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT
                            if log_file is not None
                            else subprocess.DEVNULL,
                            env={**os.environ, **(env or {})},
                        )
                    )
                _wait_ready(procs, [e.url for e in endpoints], timeout_s, log_path)
                if log_path is not None:
                    _wait_ready_lines(procs, log_path, timeout_s, offset)
            except RuntimeError as exc:
                fp.stop()
                if attempt + 1 < attempts and "already in use" in str(exc).lower():
                    continue
                raise
            except BaseException:
                fp.stop()
                raise
            break
        try:
            yield fp
        finally:
            fp.stop()
    finally:
        if log_file is not None:
            log_file.close()
