"""KVGATE_API_KEYS_REDIS_TIMEOUT_S: the API-key Redis client's timeouts were fixed at 0.25 s
in build_gateway. They run on the event loop's clock, so a healthy Redis' answer read late
behind a burst failed closed (503 for a key never seen), and an operator with a slower Redis
(TLS, a cross-zone hop) could not raise them. Now a setting, 1 s by default."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from cachecore.argtypes import settings_error
from cachecore.index.redis import redis_client
from cachecore.testing import RedisServer
from gateway.auth import KeyStoreUnavailable, hash_key
from gateway.cli import main
from gateway.serve import build_gateway
from gateway.settings import GatewaySettings

VARIABLE = "KVGATE_API_KEYS_REDIS_TIMEOUT_S"


@contextlib.contextmanager
def silent_redis(stage: str) -> Iterator[str]:
    """A redis:// URL that never answers. ``read``: connections are accepted (by the
    kernel) and nothing is ever sent back, as a stopped or partitioned Redis whose
    connection was open. ``connect``: the listener's accept queue is full, so a new
    connection's SYN is dropped and the connect itself waits."""
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(socket.socket())
        srv.bind(("127.0.0.1", 0))
        port = srv.getsockname()[1]
        if stage == "read":
            srv.listen(16)
        else:
            srv.listen(0)  # Linux queues backlog + 1 handshakes, then drops SYNs
            for _ in range(2):
                queued = stack.enter_context(socket.socket())
                queued.setblocking(False)
                queued.connect_ex(("127.0.0.1", port))
            time.sleep(0.1)  # the handshakes settle into the queue
        yield f"redis://127.0.0.1:{port}/0"


async def lookup_fails_after(settings: GatewaySettings) -> float:
    """Seconds a key never seen waits on the silent Redis before failing closed."""
    gw = build_gateway(settings)
    try:
        started = time.monotonic()
        with pytest.raises(KeyStoreUnavailable):
            await gw.key_store.tenant_for("Bearer sk-never-seen", "127.0.0.1")
        return time.monotonic() - started
    finally:  # never started, so no stop(): close the clients build_gateway made
        if gw.index is not None:
            await gw.index.close()
        await gw.key_store.close()


@pytest.mark.parametrize("stage", ["read", "connect"])
async def test_the_setting_bounds_the_key_lookups_wait_on_a_silent_redis(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key store's client waits the configured timeout (connecting, and for an
    answer), not 0.25 s: with 1.5 s it failed after 0.25 s; the default (1 s) too."""
    monkeypatch.delenv(VARIABLE, raising=False)
    with silent_redis(stage) as url:
        configured = GatewaySettings(
            redis_url=url, api_keys_redis=True, api_keys_redis_timeout_s=1.5
        )
        waited = await lookup_fails_after(configured)
        assert 1.4 <= waited < 15.0, waited  # bounded: a partition is not a hang
        default = await lookup_fails_after(GatewaySettings(redis_url=url, api_keys_redis=True))
        assert 0.9 <= default < 15.0, default


async def test_the_variable_reaches_the_key_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VARIABLE, "1.5")
    with silent_redis("read") as url:
        waited = await lookup_fails_after(GatewaySettings(redis_url=url, api_keys_redis=True))
    assert 1.4 <= waited < 15.0, waited


async def test_a_healthy_redis_answering_late_is_waited_for(
    redis_own: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer that comes 0.4 s late (a slow Redis, or a loop backlog that reads it late:
    the timeout cannot tell them apart) resolves the key at the default, with 0.6 s to
    spare for a busy host. With the fixed 0.25 s a key never seen failed closed
    (KeyStoreUnavailable, a 503)."""
    monkeypatch.delenv(VARIABLE, raising=False)
    admin = redis_client(redis_own.url, socket_timeout_s=5.0, connect_timeout_s=5.0)
    gw = build_gateway(GatewaySettings(redis_url=redis_own.url, api_keys_redis=True))
    try:
        await admin.hset("kvg:apikeys", mapping={hash_key("sk-real"): "acme"})
        await admin.execute_command("CLIENT", "PAUSE", "400", "ALL")
        started = time.monotonic()
        assert await gw.key_store.tenant_for("Bearer sk-real", "127.0.0.1") == "acme"
        assert time.monotonic() - started >= 0.3  # it did wait out the pause
    finally:
        await admin.aclose()
        if gw.index is not None:
            await gw.index.close()


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("0", "Input should be greater than 0"),
        ("-1", "Input should be greater than 0"),
        ("inf", "Input should be a finite number"),
        ("nan", "Input should be a finite number"),
        ("1e400", "Input should be a finite number"),
        ("soon", "Input should be a valid number"),
    ],
)
def test_a_bad_timeout_is_one_line_and_exit_2(
    value: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No timeout at all (0, below) and an infinite one (a lookup on a partitioned Redis
    that never fails over) are refused at start, naming the variable, nothing started."""
    monkeypatch.setenv(VARIABLE, value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert f"api_keys_redis_timeout_s ({VARIABLE}): {says}" in settings_error(info.value)
    argv = ["serve", "--api-keys-redis", "--redis", "redis://127.0.0.1:9/0", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"({VARIABLE}): {says}" in err[0], err
