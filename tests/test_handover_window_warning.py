"""Review item G: KVGATE_AGENT_HANDOVER_WINDOW_S accepts up to a day (a slow upgrade may
need minutes), so a typo (3600 for 360, hours for seconds) kept a stopped engine discovered
after a hand-over, and ``kvgate index forget`` refusing it, for that long without a word.
``kvgate agent`` now warns at start when the window is more than 10 registration TTLs."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import pytest

from cachecore.agent import cli
from cachecore.agent.settings import (
    HANDOVER_WINDOW_WARN_RATIO,
    AgentSettings,
    handover_window_warning,
)

BASE = [
    "--replica-id", "r9", "--engine-url", "http://127.0.0.1:9",
    "--events", "tcp://127.0.0.1:9", "--redis", "redis://127.0.0.1:9/0",
]  # fmt: skip


def _run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``kvgate agent`` up to its start (its _main replaced): what it would run with."""
    for var in ("REPLICA_ID", "ENGINE_URL", "EVENTS", "REDIS", "HANDOVER_WINDOW_S"):
        monkeypatch.delenv(f"KVGATE_AGENT_{var}", raising=False)
    calls: list[dict[str, Any]] = []

    async def fake_main(settings: AgentSettings, *args: Any, **kwargs: Any) -> int:
        calls.append({"settings": settings, **kwargs})
        return 0

    monkeypatch.setattr(cli, "_main", fake_main)
    monkeypatch.setattr(cli, "configure_logging", lambda *a, **k: None)  # keep caplog's
    parser = argparse.ArgumentParser(prog="kvgate agent")
    cli.configure(parser)
    assert cli.run(parser.parse_args(argv)) == 0
    return calls


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "HANDOVER_WINDOW_S" in r.getMessage()
    ]


def test_a_window_far_above_the_registration_ttl_is_warned_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    calls = _run([*BASE, "--handover-window", "3600"], monkeypatch)
    assert len(calls) == 1  # still starts: up to a day is allowed
    (rec,) = _warnings(caplog)
    msg = rec.getMessage()
    assert "3600 s" in msg and "registration TTL (10 s)" in msg, msg
    assert "kvgate index forget" in msg, msg
    assert getattr(rec, "replica", None) == "r9"


def test_the_default_and_a_window_within_ten_ttls_are_not_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    _run(BASE, monkeypatch)
    _run([*BASE, "--handover-window", "100"], monkeypatch)  # 10 x the 10 s TTL
    # a longer TTL allows a longer window
    _run([*BASE, "--registration-ttl", "60", "--handover-window", "600"], monkeypatch)
    assert _warnings(caplog) == []


def test_an_agent_that_does_not_register_is_not_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    _run([*BASE, "--no-register", "--handover-window", "3600"], monkeypatch)
    assert _warnings(caplog) == []


def test_the_rule() -> None:
    ttl = 10.0
    at = AgentSettings(
        replica_id="r",
        engine_url="http://127.0.0.1:9",
        events="tcp://127.0.0.1:9",
        registration_ttl_s=ttl,
        handover_window_s=HANDOVER_WINDOW_WARN_RATIO * ttl,
    )
    assert handover_window_warning(at) is None
    above = at.model_copy(update={"handover_window_s": HANDOVER_WINDOW_WARN_RATIO * ttl + 1})
    assert handover_window_warning(above) is not None
