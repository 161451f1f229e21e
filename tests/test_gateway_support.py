"""Support for the gateway tests (no tests here): real simulated replicas + a real gateway
in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import httpx
from openai import AsyncOpenAI
from pydantic import SecretStr

from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.replica.settings import ReplicaSettings
from cachecore.testing import PATIENT_TIMEOUT_S, free_port, wait_for_port
from cachecore.tokenizer import builtin_tokenizer
from gateway.auth import hash_key
from gateway.core import Gateway
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text

SECRET = "test-salt-secret-0123456789abcdef"
ADMIN = "admin-key-for-tests"
FAST = ReplicaSettings(time_scale=0.05)
VOCAB = builtin_tokenizer().word_vocabulary


@dataclass
class Stack:
    fleet: Fleet
    gw: Gateway
    url: str

    @property
    def model(self) -> str:
        return self.fleet.endpoints[0].model

    def client(self, api_key: str = "none", **kw: Any) -> AsyncOpenAI:
        kw.setdefault("max_retries", 0)
        return AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, **kw)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=30.0)

    def replica_id(self, i: int) -> str:
        return self.gw.specs[i].id

    def admin_headers(self) -> dict[str, str]:
        return {"x-admin-key": ADMIN}


def words(n: int, seed: int) -> str:
    """``n`` single-token words (exact token counts)."""
    return VOCAB.text(n, random.Random(seed))


@contextlib.asynccontextmanager
async def stack(
    count: int = 2,
    replica: ReplicaSettings = FAST,
    policy: str | None = None,
    agents: bool = False,
    extra_replicas: list[str] | None = None,
    build: dict[str, Any] | None = None,
    policy_file: Path | None = None,
    **settings: Any,
) -> AsyncIterator[Stack]:
    async with run_fleet(replica, count=count) as fleet:
        specs = [
            f"{e.url}={e.events_endpoint},{e.replay_endpoint}" if agents else e.url
            for e in fleet.endpoints
        ]
        settings.setdefault("open_access", "api_keys_file" not in settings)
        if settings.get("redis_url"):  # a test's redis-server: not the serving defaults
            settings.setdefault("redis_timeout_s", PATIENT_TIMEOUT_S)
        if policy_file is not None:
            settings.update(policy=policy_file, policy_poll_s=0.05)
        gs = GatewaySettings(
            replicas=specs + (extra_replicas or []),
            port=free_port(),
            salt_secrets=[SecretStr(SECRET)],
            admin_key=SecretStr(ADMIN),
            seed=7,
            **settings,
        )
        pol = parse_policy_text(policy) if policy is not None else None
        gw = build_gateway(gs, policy=pol, **(build or {}))
        async with serve_in_loop(gw) as url:
            yield Stack(fleet, gw, url)


def record_pending(gw: Gateway) -> list[tuple[Any, ...]]:
    """Each call of ``gw``'s index ``add_pending`` from now on (its positional arguments),
    passed on to the index: whether a request wrote pending entries, and for which keys."""
    assert gw.index is not None
    calls: list[tuple[Any, ...]] = []
    real = gw.index.add_pending

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return real(*args, **kw)

    gw.index.add_pending = spy  # type: ignore[method-assign]
    return calls


async def kill_replica(fleet: Fleet, i: int, timeout_s: float = 5.0) -> None:
    """Crash replica ``i``: stop listening and abort its open connections (like SIGKILL)."""
    server = fleet.servers[i]
    server.force_exit = True
    server.should_exit = True
    for conn in list(getattr(server.server_state, "connections", ())):
        transport = getattr(conn, "transport", None)
        if transport is not None:
            transport.abort()
    port = fleet.endpoints[i].http_port
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        await asyncio.sleep(0.02)
    raise TimeoutError("replica did not stop listening")


class LoopbackProxy:
    """A loopback TCP proxy to ``upstream_port`` (a test's redis-server) relaying each
    connection both ways; a subclass delays or drops chunks in :meth:`pass_on`. Connections
    are numbered from 0 in the order accepted (:attr:`accepted` counts them)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.accepted = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def pass_on(self, conn: int, from_client: bool, src: asyncio.StreamReader) -> bool:
        """Called before each chunk read from ``src`` (the client's side where
        ``from_client``) of connection ``conn`` is passed on: False drops it and stops that
        direction."""
        return True

    async def write(
        self, conn: int, from_client: bool, data: bytes, dst: asyncio.StreamWriter
    ) -> None:
        """Pass ``data`` on to ``dst`` (a subclass may split or pace it)."""
        dst.write(data)
        await dst.drain()

    def on_client_closed(self, conn: int) -> None:
        """The client closed connection ``conn`` (seen once its chunks are passed on)."""

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn, self.accepted = self.accepted, self.accepted + 1
        task = asyncio.get_running_loop().create_task(self._relay(conn, reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _relay(
        self, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            from_client = src is reader
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if not await self.pass_on(conn, from_client, src):
                        break
                    await self.write(conn, from_client, data, dst)
            if from_client:
                self.on_client_closed(conn)
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for writer in self._writers:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def script_server(tmp_path: Path, script: str, *args: str) -> AsyncIterator[str]:
    """``script`` (a Python server taking its port, then ``args``) run on a free loopback
    port while the block runs: its URL."""
    path = tmp_path / "server.py"
    path.write_text(script)
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        sys.executable, str(path), str(port), *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_for_port, port, 15.0)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), timeout=10)


def keys_file(tmp_path: Path, tenants: str) -> Path:
    """An API keys file: key ``sk-<t>`` for tenant ``<t>``, one per letter of ``tenants``."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n"
        + "".join(f"  - {{sha256: {hash_key('sk-' + t)}, tenant: {t}}}\n" for t in tenants)
    )
    return keys
