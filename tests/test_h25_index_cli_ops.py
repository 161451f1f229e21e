"""``kvgate index`` as an operator runs it: only its own settings, what the index knows of
an agentless replica, and the Redis server's clock.

* It read the gateway's whole settings: an unrelated bad ``KVGATE_*`` variable (a port,
  a CORS origin) refused the index command. It reads the Redis URL, Cluster flag and key
  prefix only, and names a bad one of those.
* ``stats`` showed no time for a replica with no agent (only gateways route to it): now
  ``ROUTED`` (``routed_age_s``) says when its gateways' newest pending entry or in-flight
  record lapsed, or that one is live.
* ``forget --idle-for`` read the agents' and gateways' stamps against the operator's own
  clock: a laptop or job two hours ahead judged a live replica idle and forgot it. Ages
  are now read against Redis' ``TIME``.

On a real redis-server (the fixtures of tests/test_h24_index_cli), keys written by a real
RedisIndex, RedisRegistry and RedisLoadStore; the command through ``gateway.cli.main`` or
its module's ``run`` in a thread."""

from __future__ import annotations

import json
import time
import types
from collections.abc import AsyncIterator

import pytest

from cachecore.index.base import ReplicaState
from cachecore.index.redis import RedisIndex
from cachecore.loadstate import RedisLoadStore
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway import index_cli
from tests.test_h24_index_cli import (
    HOUR_MS,
    KEYS,
    L,
    cli,
    kvgate,
    kvgate_in_thread,
    now_ms,
    replica_keys,
)

pytestmark = pytest.mark.redis


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[tuple[RedisIndex, str]]:
    """``static``: no agent, routed to just now (a pending entry, an in-flight record);
    ``quiet``: no agent, its gateways' entries lapsed 30 minutes ago; ``stopped``: an
    agent's replica whose agent stopped a minute ago (no registration, meta updated)."""
    index = RedisIndex.from_url(
        redis_url, L, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    load = RedisLoadStore(index.client, L, gateway_ttl_ms=60_000)
    now = now_ms()
    await index.add_pending("static", KEYS[:2], 60_000, now)
    await load.add_inflight("gw1", "static", 1, 10, now)
    await index.add_pending("quiet", KEYS[:1], 60_000, now - 31 * 60_000)
    await index.clear_replica("stopped", ReplicaState.LIVE, now - 60_000)
    yield index, redis_url
    await index.close()


def test_unrelated_bad_gateway_settings_do_not_refuse_it(
    fleet: tuple[RedisIndex, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: `kvgate index: port (KVGATE_PORT): Input should be a valid integer`."""
    _, url = fleet
    monkeypatch.setenv("KVGATE_PORT", "abc")
    monkeypatch.setenv("KVGATE_CORS_ALLOWED_ORIGINS", "ftp://not an origin")
    monkeypatch.setenv("KVGATE_CORS_MAX_AGE_S", "-1")
    code, out, err = kvgate(cli(url, "stats", "--json"), capsys)
    assert code == 0, err
    assert {r["replica"] for r in json.loads(out)["replicas"]} == {"static", "quiet", "stopped"}


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("KVGATE_KEY_PREFIX", "a b", "key_prefix (KVGATE_KEY_PREFIX): "),
        ("KVGATE_REDIS_CLUSTER", "maybe", "redis_cluster (KVGATE_REDIS_CLUSTER): "),
        ("KVGATE_REDIS_URL", "http://x", "redis_url (KVGATE_REDIS_URL): "),
        ("KVGATE_REDIS_URL", " ", "redis_url (KVGATE_REDIS_URL): empty"),
    ],
)
def test_a_bad_value_of_its_own_settings_is_named(
    name: str,
    value: str,
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv(name, value)
    code, out, err = kvgate(["index", "stats"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvgate index: ") and says in err, err


def test_stats_shows_when_gateways_last_routed_an_agentless_replica(
    fleet: tuple[RedisIndex, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `-` under UPDATED, nothing else, for a replica only gateways write for."""
    _, url = fleet
    code, out, err = kvgate(cli(url, "stats", "--json"), capsys)
    assert code == 0, err
    rows = {r["replica"]: r for r in json.loads(out)["replicas"]}
    assert rows["static"]["updated_age_s"] is None and rows["static"]["state"] is None
    assert -61 < rows["static"]["routed_age_s"] < -50  # live a minute more
    assert 29 * 60 < rows["quiet"]["routed_age_s"] < 31 * 60  # lapsed 30 minutes ago
    assert rows["stopped"]["routed_age_s"] is None  # no gateway entry at all
    code, out, err = kvgate(cli(url, "stats"), capsys)
    assert code == 0, err
    table = {line.split()[0]: line.split() for line in out.splitlines()[1:4]}
    assert table["static"][-3:] == ["-", "now", "no"]
    assert table["quiet"][-4:] == ["-", "30m", "ago", "no"]
    assert table["stopped"][-4:] == ["1m", "ago", "-", "no"]
    assert "UPDATED -: no agent stamp" in out and "ROUTED: when its gateways'" in out


def _ahead(seconds: float) -> types.SimpleNamespace:
    """This host's clock, ``seconds`` ahead of the fleet's (and Redis')."""
    return types.SimpleNamespace(
        time=lambda: time.time() + seconds, monotonic=time.monotonic, sleep=time.sleep
    )


async def test_an_operator_clock_ahead_does_not_make_a_live_replica_idle(
    fleet: tuple[RedisIndex, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two hours ahead: before, `stopped` (its agent wrote a minute ago) and `static`
    (gateways route to it now) read as idle for an hour and were forgotten."""
    index, url = fleet
    monkeypatch.setattr(index_cli, "time", _ahead(2 * HOUR_MS / 1000))
    before = {r: await replica_keys(index.client, r) for r in ("static", "stopped")}
    why = {
        "stopped": "its meta was updated 1m ago (under --idle-for 1h)",
        "static": "gateways are routing to it (their entries for it live ",
    }
    for rid, says in why.items():
        code, out, err = await kvgate_in_thread(
            cli(url, "forget", rid, "--idle-for", "1h")[1:], capsys
        )
        assert code == 2 and out == "", out
        assert f"not forgetting {rid}: {says}" in err, err
    argv = cli(url, "forget", "--departed", "--idle-for", "1h", "--dry-run")[1:]
    code, out, _ = await kvgate_in_thread(argv, capsys)
    assert code == 0 and out == "no departed replica (unregistered, idle for 1h)\n"
    code, out, _ = await kvgate_in_thread(cli(url, "stats", "--json")[1:], capsys)
    rows = {r["replica"]: r for r in json.loads(out)["replicas"]}
    assert 50 < rows["stopped"]["updated_age_s"] < 120  # a minute, not two hours
    for rid, keys in before.items():
        assert await replica_keys(index.client, rid) == keys
    # the replica idle for real (30 minutes) is still taken with a shorter --idle-for
    code, out, err = await kvgate_in_thread(
        cli(url, "forget", "quiet", "--idle-for", "10m")[1:], capsys
    )
    assert code == 0 and out.startswith("forgot quiet: "), err
