"""Shared pieces of the benchmarks that drive a simulated fleet through a real kvgate gateway
(``kvgate demo``, ``kvgate bench routers``): the time-scaled policy, the gateway subprocess,
the cache flush between systems and the strategy switch by admin policy reload."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from cachecore.replica.fleet import FleetProcess
from gateway.auth import hash_key
from gateway.serve import start_gateway_process
from policies.schema import builtin_policy_path

MODEL = "kvgate-sim-8b"
FLUSH_TIMEOUT_S = 30.0


def scaled_policy(strategy: str, time_scale: float, max_num_seqs: int | None = None) -> str:
    """The shipped default policy with the strategy set and the cost coefficients scaled to
    the replicas' time scale (they are in ms of engine time), and with them the routing
    margins compared against costs (the tie band, the sensitive sessions' slack), which
    would otherwise be wider in engine time at a faster scale. ``overdue_grace_ms`` stays:
    it waits out the host's wall-clock jitter, which no time scale shrinks. ``max_num_seqs``:
    the replicas' sequence slots, which an operator declares in the policy (engines do not
    publish it); left at the policy's 256, a 16-slot engine never looks saturated."""
    data: dict[str, Any] = yaml.safe_load(builtin_policy_path("default").read_text())
    data["routing"]["strategy"] = strategy
    if max_num_seqs is not None:
        data["models"]["default"]["max_num_seqs"] = max_num_seqs
    cost = data["cost"]
    for name in (
        "overhead_ms",
        "prefill_ms_per_token",
        "load_ms_per_token",
        "decode_ms_per_running",
        "saturation_ms",
    ):
        cost[name] = cost[name] * time_scale
    routing = data["routing"]
    routing["tie_epsilon_ms"] = routing["tie_epsilon_ms"] * time_scale
    routing["sensitive_sticky"]["slack_ms"] = routing["sensitive_sticky"]["slack_ms"] * time_scale
    data["index"]["pending_ttl_ms"] = max(200, int(data["index"]["pending_ttl_ms"] * time_scale))
    return yaml.safe_dump(data, sort_keys=False)


def pending_settle_s(time_scale: float) -> float:
    """How long to wait after a flush so the index's pending entries have expired."""
    return max(0.5, 2.5 * time_scale)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_api_keys(path: Path, keys: Mapping[str, str]) -> None:
    """An API-key file with one key per tenant (``{tenant: key}``)."""
    entries = [{"sha256": hash_key(key), "tenant": tenant} for tenant, key in keys.items()]
    path.write_text(yaml.safe_dump({"keys": entries}))


@contextlib.contextmanager
def gateway(
    fleet: FleetProcess,
    port: int,
    policy: Path,
    keys: Path,
    admin_key: str,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """``kvgate serve`` in front of the fleet (embedded index, one agent per replica);
    yields its base URL and stops it on exit."""
    with gateway_process(fleet, port, policy, keys, admin_key, extra_args, extra_env) as gw:
        yield gw[0]


@contextlib.contextmanager
def gateway_process(
    fleet: FleetProcess,
    port: int,
    policy: Path,
    keys: Path,
    admin_key: str,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`gateway`, yielding the process too (for benchmarks that watch it);
    ``extra_env``: more ``KVGATE_*`` settings."""
    args = [
        "--policy",
        str(policy),
        "--api-keys",
        str(keys),
        "--plain-logs",
        "--log-level",
        "WARNING",
        *extra_args,
    ]
    for e in fleet.endpoints:
        args += ["--replica", f"r{e.index}={e.url}={e.events_endpoint},{e.replay_endpoint}"]
    env = {
        "KVGATE_ADMIN_KEY": admin_key,
        "KVGATE_AGENT_TOPIC": "kv-events",
        "KVGATE_SALT_SECRETS": secrets.token_hex(32),
        **(extra_env or {}),
    }
    proc = start_gateway_process(args, port, env=env, timeout_s=60)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except Exception:
            proc.kill()


async def reset_caches(client: httpx.AsyncClient, urls: Sequence[str]) -> None:
    """Flush every replica's prefix cache, retrying while a request still holds blocks
    (agents see AllBlocksCleared)."""
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        left = []
        for url in pending:
            r = await client.post(url + "/flush_cache")
            if r.status_code != 200:
                left.append(url)
        pending = left
        if pending:
            await asyncio.sleep(0.2)
    if pending:
        raise RuntimeError(f"could not flush {pending}")


async def set_strategy(
    client: httpx.AsyncClient,
    base: str,
    admin_key: str,
    strategy: str,
    time_scale: float,
    max_num_seqs: int | None = None,
) -> None:
    """Switch the gateway's routing strategy by an admin policy reload."""
    r = await client.post(
        base + "/admin/policy",
        content=scaled_policy(strategy, time_scale, max_num_seqs),
        headers={"authorization": f"Bearer {admin_key}"},
    )
    r.raise_for_status()
