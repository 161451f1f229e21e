"""Helpers that start real components on loopback for tests and benchmarks.

Nothing here fakes a component: :class:`RedisServer` runs the real ``redis-server`` binary on
a free loopback port with persistence off and stops it afterwards.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


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


class RedisServer:
    """A real redis-server on a free loopback port. ``restart()`` keeps the port but loses
    all data (persistence is off), which is what a Redis restart looks like to kvgate."""

    def __init__(self, port: int | None = None, extra_args: list[str] | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.binary = binary
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self._dir = Path(tempfile.mkdtemp(prefix="kvgate-redis-"))
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
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def redis_server(extra_args: list[str] | None = None) -> Iterator[RedisServer]:
    with RedisServer(extra_args=extra_args) as srv:
        yield srv
