"""Review R2's O10: ``--redis-cluster`` against a standalone Redis was read as an endless
outage: the agent retried "index not reachable at startup" for ever (never ready) and the
gateway fell back on every lookup behind WARNINGs, while the server answered each time
"Cluster mode is not enabled on this node". Now the agent refuses at start-up (one line,
exit 2) and the gateway's fallback is an ERROR naming the switch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from cachecore.index.layout import KeyLayout
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex, cluster_mode_problem
from cachecore.testing import PATIENT_TIMEOUT_S, RedisClusterServers, RedisServer, free_port
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics

SWITCH = "--redis-cluster (KVGATE_AGENT_REDIS_CLUSTER)"


async def test_a_standalone_server_is_named_not_an_outage(redis_url: str) -> None:
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    problem = await cluster_mode_problem(redis_url, True, SWITCH)
    assert problem is not None
    assert problem.startswith(f"{SWITCH} is set but 127.0.0.1:{port} is not a Redis Cluster"), (
        problem
    )
    assert "drop the switch" in problem
    assert await cluster_mode_problem(redis_url, False, SWITCH) is None


async def test_an_unreachable_server_is_no_mismatch() -> None:
    """An outage stays the callers' to retry: a node that does not answer says nothing of
    its mode."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert await cluster_mode_problem(url, True, SWITCH) is None


async def test_a_real_cluster_passes(redis_cluster: RedisClusterServers) -> None:
    assert await cluster_mode_problem(redis_cluster.url, True, SWITCH) is None


def test_kvgate_agent_refuses_in_one_line(redis_url: str) -> None:
    """Unfixed, the agent retries the index for ever: a timeout bounds it. The password is
    never echoed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    url = redis_url.replace("redis://", "redis://default:S3CRETPW@")
    argv = [
        "agent", "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9",
        "--events", "tcp://127.0.0.1:9", "--redis", url, "--redis-cluster",
        "--http-port", "0", "--no-register", "--gc-freeze-interval", "0",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *argv],
            env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("kvgate agent --redis-cluster against a standalone Redis started")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kvgate agent: {SWITCH} is set but 127.0.0.1:"), done.stderr
    assert "S3CRETPW" not in done.stderr


async def test_the_gateways_fallback_names_the_switch_at_error(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    primary = RedisIndex.from_url(
        redis_url.rsplit("/", 1)[0] + "/0",
        KeyLayout(),
        cluster=True,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )
    index = GatewayIndex(primary, GatewayMetrics(), MemoryIndex())
    caplog.set_level(logging.WARNING, logger="gateway.indexing")
    try:
        got = await index.lookup([bytes(16)], ["r0"], 0, timeout_s=5.0)
    finally:
        await primary.close()
    assert got.source == "local" and index.fallbacks == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "--redis-cluster (KVGATE_REDIS_CLUSTER)" in errors[0], errors
    assert "refuses CLUSTER SLOTS: a standalone Redis (drop the switch)" in errors[0]


async def test_an_acl_user_is_asked_by_the_command_it_may_run(redis_own: RedisServer) -> None:
    """A user without INFO: CLUSTER SLOTS' own answer ("cluster support disabled") says it;
    a user allowed neither says nothing (None), rather than a guess."""
    import redis

    admin = redis.Redis.from_url(redis_own.url)
    try:
        for user, allowed in (("slots", "+cluster|slots"), ("mute", "+ping")):
            setuser = ("ACL", "SETUSER", user, "on", ">pw", allowed, "~*")
            admin.execute_command(*setuser)  # type: ignore[no-untyped-call]
    finally:
        admin.close()
    base = redis_own.url.replace("redis://", "redis://{}:pw@")
    problem = await cluster_mode_problem(base.format("slots"), True, SWITCH)
    assert problem is not None and "is not a Redis Cluster node" in problem
    assert await cluster_mode_problem(base.format("mute"), True, SWITCH) is None


def test_kvgate_serve_refuses_in_one_line(redis_url: str) -> None:
    """Unfixed, the gateway serves (every lookup falling back): a timeout bounds it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    argv = ["serve", "--open", "--plain-logs", "--port", "0", "--redis", redis_url,
            "--redis-cluster", "--replica", "r0=http://127.0.0.1:9"]  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *argv],
            env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("kvgate serve --redis-cluster against a standalone Redis served")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    switch = "--redis-cluster (KVGATE_REDIS_CLUSTER)"
    assert last.startswith(f"kvgate serve: {switch} is set but 127.0.0.1:"), done.stderr[-2000:]
