"""docs/runbook.md says which ZMQ endpoints an agent's --events / --replay take; the agent
checks them at start-up (bb8a248), so the page must name those forms, not "any ZMQ
endpoint" (inproc://, udp:// or a source-interface tcp://eth0;HOST:PORT are refused)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachecore.agent.settings import check_zmq_endpoint

RUNBOOK = Path(__file__).resolve().parents[1] / "docs" / "runbook.md"


def _sentence() -> str:
    text = " ".join(RUNBOOK.read_text().split())
    m = re.search(r"the agent's `--events` / `--replay` take ([^.]*)", text)
    assert m, "docs/runbook.md no longer says what --events / --replay take"
    return m.group(1)


def test_the_runbook_names_the_endpoints_the_agent_takes() -> None:
    said = _sentence()
    assert "any" not in said.split(), said
    named = re.findall(r"`(\w+)://([A-Z]+)(?::([A-Z]+))?`", said)
    assert {scheme for scheme, _, _ in named} == {"tcp", "ipc"}, said
    examples = {"tcp": "tcp://10.0.0.5:5557", "ipc": "ipc:///tmp/kv-events"}
    for scheme, _, _ in named:
        assert check_zmq_endpoint(examples[scheme]) == examples[scheme]


@pytest.mark.parametrize("endpoint", ["inproc://kv", "udp://h:5557", "tcp://h", "pgm://x"])
def test_other_zmq_endpoints_are_refused(endpoint: str) -> None:
    with pytest.raises(ValueError):
        check_zmq_endpoint(endpoint)
