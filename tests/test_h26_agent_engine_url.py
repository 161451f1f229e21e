"""Review R2's O11: `kvgate agent --engine-url http://HOST:PORT/v1` (an OpenAI client's base
URL) was accepted and waited for ever on "engine not reachable" (its /v1/metrics answered
404), where `kvgate serve --replica` refused the same URL in one line. One rule now
(cachecore.agent.settings.check_engine_root_url) refuses it in both."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from cachecore.agent import cli
from cachecore.agent.settings import AgentSettings, check_engine_root_url
from gateway.replicas import ReplicaSpecError, parse_replica_spec

SAYS = "ends in /v1: give the engine's root URL, without /v1"


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:29101/v1", "http://127.0.0.1:29101/v1/", "https://e/serve/v1"]
)
def test_an_openai_base_url_is_refused_by_the_agents_settings(url: str) -> None:
    with pytest.raises(ValidationError) as exc:
        AgentSettings(replica_id="r9", engine_url=url, events="tcp://127.0.0.1:9")
    said = cli.settings_error(exc.value)
    assert said.startswith("engine_url (--engine-url, KVGATE_AGENT_ENGINE_URL): "), said
    assert SAYS in said, said


def test_root_urls_and_paths_under_a_prefix_pass() -> None:
    for url in ("http://127.0.0.1:29101", "http://e:80/engine", "http://e/v1x", "http://e/v10"):
        assert check_engine_root_url(url) == url
        s = AgentSettings(replica_id="r9", engine_url=url + "/", events="tcp://127.0.0.1:9")
        assert s.engine_url == url


def test_the_gateway_and_the_agent_say_the_same() -> None:
    url = "http://127.0.0.1:29101/v1"
    with pytest.raises(ReplicaSpecError) as spec:
        parse_replica_spec(f"r0={url}")
    with pytest.raises(ValueError) as rule:
        check_engine_root_url(url)
    assert str(spec.value) == f"replica URL {rule.value}"


def test_kvgate_agent_exits_2_in_one_line() -> None:
    """Unfixed, the agent starts and waits for the engine: a timeout bounds it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    argv = [
        "agent", "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9/v1",
        "--events", "tcp://127.0.0.1:9", "--redis", "redis://127.0.0.1:9/0",
        "--http-port", "0", "--no-register", "--gc-freeze-interval", "0",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.cli", *argv],
            env=env, capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("kvgate agent --engine-url .../v1 started")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and SAYS in done.stderr, done.stderr
