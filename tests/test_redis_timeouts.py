"""KVGATE_REDIS_TIMEOUT_S and KVGATE_AGENT_REDIS_TIMEOUT_S (--redis-timeout): the gateway's
index, load-store and discovery Redis clients and the agent's index, load and registration
clients had fixed timeouts (0.25-2 s) that neither an operator with a distant Redis nor a
test on a loaded machine could raise. Unset, each client keeps exactly its old ones; set,
every one of them waits that long to connect and to read. Read off the built clients'
connection pools (the clients connect lazily: nothing here needs a Redis)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from pydantic import ValidationError

from cachecore.agent import cli as agent_cli
from cachecore.agent.settings import AgentSettings
from cachecore.index.layout import KeyLayout
from cachecore.registry import RedisRegistry
from gateway.cli import main
from gateway.serve import build_gateway
from gateway.settings import GatewaySettings

URL = "redis://127.0.0.1:9/0"  # nothing listens: no test here connects
GATEWAY_VARIABLE = "KVGATE_REDIS_TIMEOUT_S"
AGENT_VARIABLE = "KVGATE_AGENT_REDIS_TIMEOUT_S"


def timeouts(client: Any) -> tuple[float, float]:
    """(read, connect) timeout a standalone client's new connections get."""
    kwargs = client.connection_pool.connection_kwargs
    return kwargs["socket_timeout"], kwargs["socket_connect_timeout"]


def test_the_registry_takes_timeouts_as_the_load_store_does() -> None:
    assert timeouts(RedisRegistry.from_url(URL).client) == (1.0, 1.0)  # as before
    given = RedisRegistry.from_url(URL, KeyLayout(), socket_timeout_s=3.0, connect_timeout_s=4.0)
    assert timeouts(given.client) == (3.0, 4.0)


async def built_gateway_timeouts(settings: GatewaySettings) -> dict[str, tuple[float, float]]:
    gw = build_gateway(settings)
    stores = {"index": gw._index_arg, "load": gw._load_store, "registry": gw.registry}
    built: dict[str, Any] = stores  # the Redis ones, with their clients
    try:
        return {name: timeouts(store.client) for name, store in built.items()}
    finally:  # never started, so no stop(): close the clients build_gateway made
        for store in built.values():
            await store.close()


async def test_the_gateway_setting_reaches_its_index_load_and_discovery_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(GATEWAY_VARIABLE, raising=False)
    base: dict[str, Any] = {"redis_url": URL, "open_access": True, "discover": True}
    unset = await built_gateway_timeouts(GatewaySettings(**base))
    assert unset == {"index": (0.25, 0.5), "load": (0.5, 0.5), "registry": (1.0, 1.0)}
    given = await built_gateway_timeouts(GatewaySettings(**base, redis_timeout_s=3.5))
    assert given == dict.fromkeys(("index", "load", "registry"), (3.5, 3.5))
    monkeypatch.setenv(GATEWAY_VARIABLE, "2.5")
    from_env = await built_gateway_timeouts(GatewaySettings(**base))
    assert from_env == dict.fromkeys(("index", "load", "registry"), (2.5, 2.5))


def agent_settings(argv: list[str]) -> AgentSettings:
    parser = argparse.ArgumentParser(prog="kvgate agent")
    agent_cli.configure(parser)
    required = ["--replica-id", "r0", "--engine-url", "http://127.0.0.1:1"]
    return agent_cli.settings_from_args(
        parser.parse_args([*required, "--events", "tcp://127.0.0.1:2", "--redis", URL, *argv])
    )


async def built_agent_timeouts(settings: AgentSettings) -> dict[str, tuple[float, float]]:
    index, load, registry = agent_cli.redis_stores(settings)
    assert registry is not None
    try:
        return {
            "index": timeouts(index.client),
            "load": timeouts(load.client),
            "registry": timeouts(registry.client),
        }
    finally:
        await index.close()
        await load.close()
        await registry.close()


async def test_the_agent_setting_reaches_its_index_load_and_registry_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(AGENT_VARIABLE, raising=False)
    unset = await built_agent_timeouts(agent_settings([]))
    assert unset == {"index": (2.0, 1.0), "load": (0.5, 0.5), "registry": (1.0, 1.0)}
    given = await built_agent_timeouts(agent_settings(["--redis-timeout", "3.5"]))
    assert given == dict.fromkeys(("index", "load", "registry"), (3.5, 3.5))
    monkeypatch.setenv(AGENT_VARIABLE, "2.5")
    from_env = await built_agent_timeouts(agent_settings([]))
    assert from_env == dict.fromkeys(("index", "load", "registry"), (2.5, 2.5))


BAD = [
    ("0", "Input should be greater than 0"),
    ("-1", "Input should be greater than 0"),
    ("inf", "Input should be a finite number"),
    ("nan", "Input should be a finite number"),
    ("soon", "Input should be a valid number"),
]


@pytest.mark.parametrize(("value", "says"), BAD)
def test_a_bad_gateway_timeout_is_one_line_and_exit_2(
    value: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No timeout at all (0, below) and an infinite one (a write on a partitioned Redis
    that holds its connection for ever) are refused at start, naming the variable."""
    monkeypatch.setenv(GATEWAY_VARIABLE, value)
    with pytest.raises(ValidationError):  # first: without the check, main() would serve
        GatewaySettings()
    assert main(["serve", "--open", "--redis", URL, "--port", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"redis_timeout_s ({GATEWAY_VARIABLE}): {says}" in err[0], err


@pytest.mark.parametrize(
    ("where", "value", "says"),
    [("variable", *bad) for bad in BAD]
    + [("flag", *bad) for bad in BAD if bad[0] != "soon"],  # argparse's float refuses it
)
def test_a_bad_agent_timeout_is_one_line_and_exit_2(
    value: str,
    says: str,
    where: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var in ("REPLICA_ID", "ENGINE_URL", "EVENTS", "REDIS"):
        monkeypatch.delenv(f"KVGATE_AGENT_{var}", raising=False)
    argv = [
        "--replica-id", "r0", "--engine-url", "http://127.0.0.1:1",
        "--events", "tcp://127.0.0.1:2", "--redis", URL, "--http-port", "0",
    ]  # fmt: skip
    if where == "flag":
        argv += ["--redis-timeout", value]
    else:
        monkeypatch.setenv(AGENT_VARIABLE, value)
    parser = argparse.ArgumentParser(prog="kvgate agent")
    agent_cli.configure(parser)
    with pytest.raises(ValidationError):  # first: without the check, run() would start
        agent_cli.settings_from_args(parser.parse_args(argv))
    assert agent_cli.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err.splitlines()
    named = f"redis_timeout_s (--redis-timeout, {AGENT_VARIABLE}): {says}"
    assert len(err) == 1 and named in err[0], err
