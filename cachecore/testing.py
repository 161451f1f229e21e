"""Helpers that start real components on loopback for tests and benchmarks.

Nothing here fakes a component: :class:`RedisServer` runs the real ``redis-server`` binary on
a free loopback port with persistence off and stops it afterwards; :class:`RedisClusterServers`
runs several of them as a real Redis Cluster (created with ``redis-cli --cluster create``);
:func:`serve_asgi` serves an ASGI app with a real uvicorn server in the current event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import redis
import uvicorn

PATIENT_TIMEOUT_S = 5.0
"""Socket and connect timeout for Redis clients in correctness tests. The stores' defaults
(0.25-1 s, connect 0.5 s) are for a serving hot path that must fail fast; a loaded CI
machine can stall a loopback reply or connect that long (seen: a cluster node's reply to
the property test; a connect in the memory/Redis property test, thirty-first session's
CI), which is not what those tests check."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together so they cannot repeat)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for_port(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout_s}s")


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any, *, start_timeout_s: float = 10.0, **config: Any
) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port, as a task in the running loop;
    yields its base URL (``https://`` when ``ssl_certfile`` is given) once it listens.

    ``config`` overrides uvicorn's settings (defaults: no lifespan, warnings only, the
    running loop, at most 5 s of graceful shutdown). On exit the server is told to stop and
    awaited: its connections close and its task ends before the caller's next step (a
    response still in flight, as in a test that failed half way, is cut after those 5 s
    rather than holding the stop until pytest's timeout).
    """
    port = free_port()
    settings: dict[str, Any] = {
        "lifespan": "off",
        "log_level": "warning",
        "loop": "none",
        "timeout_graceful_shutdown": 5,
    }
    settings.update(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **settings))
    task = asyncio.ensure_future(server.serve())
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:  # bounded by start_timeout_s
            if task.done() or time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start on port {port} in {start_timeout_s}s")
            await asyncio.sleep(0.01)
        scheme = "https" if settings.get("ssl_certfile") else "http"
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


class MissingProgram(RuntimeError):
    """A program the command starts (redis-server, redis-cli) is not installed:
    ``kvgate`` prints it in one line and exits 2, not as a traceback."""


class RedisServer:
    """A real redis-server on a free loopback port. ``restart()`` keeps the port but loses
    all data (persistence is off), which is what a Redis restart looks like to kvgate."""

    def __init__(
        self,
        port: int | None = None,
        extra_args: list[str] | None = None,
        directory: Path | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise MissingProgram("redis-server is not on PATH (install Redis)")
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self._own_dir = directory is None
        self._dir = directory or Path(tempfile.mkdtemp(prefix="kvgate-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--protected-mode", "yes",
            *self.extra_args,
        ]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def redis_server_version(binary: str = "redis-server") -> tuple[int, ...]:
    """``(major, minor, patch)`` of a redis-server binary (``redis-server --version``)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out.stdout)
    if found is None:
        raise RuntimeError(f"cannot read the version of {binary}: {out.stdout!r}")
    return tuple(int(g) for g in found.groups())


class ClusterUnsupportedError(RuntimeError):
    """The ``redis-server`` binary cannot run in cluster mode."""


class RedisClusterServers:
    """A real Redis Cluster of ``primaries`` redis-servers (no replicas) on free loopback
    ports, slots spread evenly by ``redis-cli --cluster create``. Each node gets an explicit
    cluster bus port (``cluster-port``, Redis >= 7.0): the default, port + 10000, may be taken
    or beyond 65535 for an ephemeral port. ``start`` returns once every node reports
    ``cluster_state:ok`` with every node known and all 16384 slots assigned, or raises after
    ``timeout_s`` (30 s: ``--cluster create`` polls the join once a second and takes 2-5 s
    on an idle 2-core machine; 10 s ran out once under a loaded CI run)."""

    def __init__(self, primaries: int = 3, timeout_s: float = 30.0) -> None:
        if primaries < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 primaries")
        cli = shutil.which("redis-cli")
        if cli is None:
            raise MissingProgram("redis-cli is not on PATH (install Redis)")
        self.cli = cli
        self.timeout_s = timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="kvgate-redis-cluster-"))
        ports = free_ports(2 * primaries)
        self.servers: list[RedisServer] = []
        for port, bus in zip(ports[:primaries], ports[primaries:], strict=True):
            node_dir = self._dir / str(port)
            node_dir.mkdir()
            args = [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(node_dir / f"nodes-{port}.conf"),
                "--cluster-port", str(bus),
                "--cluster-node-timeout", "5000",
            ]  # fmt: skip
            self.servers.append(RedisServer(port, args, directory=node_dir))

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """A seed node's URL (cluster clients discover the others)."""
        return self.servers[0].url

    def on_every_node(self, *command: str) -> None:
        """Run one command on every primary (FLUSHALL, SCRIPT FLUSH: cluster clients send
        such commands to one node only)."""
        for url in self.urls:
            client = redis.Redis.from_url(url)
            try:
                client.execute_command(*command)  # type: ignore[no-untyped-call]
            finally:
                client.close()

    def start(self) -> RedisClusterServers:
        try:
            version = redis_server_version(self.servers[0].binary)
            if version < (7, 0):  # no cluster-port, no allow-cross-slot-keys script flag
                raise ClusterUnsupportedError(f"redis-server {version} < 7.0")
            for srv in self.servers:
                srv.start()
                with redis.Redis("127.0.0.1", srv.port, socket_timeout=2) as client:
                    info = client.info("cluster")
                if info.get("cluster_enabled") != 1:
                    raise ClusterUnsupportedError(f"{srv.binary} runs without cluster support")
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            create = [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0"]
            done = subprocess.run(
                [*create, "--cluster-yes"], capture_output=True, text=True, timeout=self.timeout_s
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}")
            self._wait_ok()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ok(self) -> None:
        """Poll ``CLUSTER INFO`` on every node (bounded in count and in time) until each
        reports state ok, every node known and every slot assigned."""
        want = {
            "cluster_state": "ok",
            "cluster_known_nodes": str(len(self.servers)),
            "cluster_slots_assigned": "16384",
        }
        deadline = time.monotonic() + self.timeout_s
        behind: list[str] = []
        for _ in range(1000):
            behind = []
            for port in self.ports:
                with redis.Redis("127.0.0.1", port, socket_timeout=1, decode_responses=True) as c:
                    text = str(c.execute_command("CLUSTER", "INFO"))
                fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
                got = {k: fields.get(k) for k in want}
                if got != want:
                    behind.append(f"{port}: {got}")
            if not behind:
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        raise TimeoutError(f"cluster not ok after {self.timeout_s}s: {'; '.join(behind)}")

    def stop(self) -> None:
        for srv in self.servers:
            srv.stop()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def redis_server(extra_args: list[str] | None = None) -> Iterator[RedisServer]:
    with RedisServer(extra_args=extra_args) as srv:
        yield srv
