"""Support for the gateway tests (no tests here): real simulated replicas + a real gateway
in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI
from pydantic import SecretStr

from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.replica.settings import ReplicaSettings
from cachecore.testing import PATIENT_TIMEOUT_S, free_port
from cachecore.tokenizer import builtin_tokenizer
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
