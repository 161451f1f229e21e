"""A clean agent stop says what it did with the replica's registration in one structured line.

A stop hands the registration over (engine serving), deregisters it, finds none of its own
to release, or fails to reach the registry (27c5a24, D27). Operators watching a rollout
read which from the log: a counter would not do, as the process (or, embedded, the agent
and its registry) ends with the stop, so a scrape would almost never see it move
(docs/agent.md, "Stopping the agent"). The line said it only in its words, differently per
case: ``removed`` on one, ``kept`` on another, the window only on a hand-over, nothing at
all for an agent that never registered, and a registry failure was a WARNING followed by an
INFO line that read as if a successor held the registration. Now every release is one line
with ``outcome`` (handover, deregister, absent, failed), ``action``, ``replica``,
``handover_window_s``, ``mode``, ``engine_serving`` and ``agent_id``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cachecore.index.memory import MemoryIndex
from cachecore.logs import PlainFormatter
from cachecore.registry import MemoryRegistry, Registration, RegistryError
from tests.test_agent_helpers import MODEL, Rig, counter_total, until

pytestmark = pytest.mark.timeout(60)

RID = "r0"
WINDOW_S = 6.0
FIELDS = {"outcome", "action", "replica", "handover_window_s", "mode", "engine_serving"}


class FailingRegistry(MemoryRegistry):
    """Registers; its hand-over and deregistration fail (a Redis gone at the stop)."""

    async def deregister(self, replica_id: str, agent_id: str) -> bool:
        raise RegistryError("registry down")

    async def hand_over(self, replica_id: str, agent_id: str, ttl_ms: int, now_ms: int) -> bool:
        raise RegistryError("registry down")


class RefusingRegistry(MemoryRegistry):
    """Refuses every registration (heartbeats fail); deregisters as the memory store does."""

    async def register(self, reg: Registration, ttl_ms: int, now_ms: int) -> None:
        raise RegistryError("registration refused")


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex(), registration_ttl_s=1.0, handover_window_s=WINDOW_S)
    try:
        yield r
    finally:
        await r.close()


async def _registered(registry: MemoryRegistry) -> bool:
    return bool(await registry.discover(int(time.time() * 1000), [RID]))


def _release_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The stop's lines about the registration: every agent line that names an outcome,
    or that the old code wrote about the registration."""
    words = ("registration", "deregist", "hand-over", "handed over")
    return [
        r
        for r in caplog.records
        if r.name.startswith("cachecore.agent")
        and (hasattr(r, "outcome") or any(w in r.getMessage() for w in words))
    ]


async def _stop_and_read(
    rig: Rig, registry: MemoryRegistry, caplog: pytest.LogCaptureFixture
) -> logging.LogRecord:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cachecore.agent"):
        await rig.stop_agent()  # raises nothing: a failed release is logged, not raised
    lines = _release_lines(caplog)
    assert len(lines) == 1, [(r.levelname, r.getMessage(), r.__dict__) for r in lines]
    line = lines[0]
    missing = {f for f in FIELDS if not hasattr(line, f)}
    assert not missing, (missing, line.getMessage())
    assert line.replica == RID  # type: ignore[attr-defined]
    assert line.handover_window_s == WINDOW_S  # type: ignore[attr-defined]
    return line


async def test_a_hand_over_is_one_line_with_its_outcome_and_window(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    registry = MemoryRegistry()
    agent = await rig.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    line = await _stop_and_read(rig, registry, caplog)
    assert line.levelno == logging.INFO
    assert line.getMessage() == "registration left for the replica's next agent"
    assert (line.outcome, line.action, line.mode, line.engine_serving) == (  # type: ignore[attr-defined]
        "handover", "handover", "auto", True,
    )  # fmt: skip
    link = agent.registry_link
    assert link is not None and line.agent_id == link.agent_id  # type: ignore[attr-defined]
    # the plain text line carries the same fields as key=value (the JSON line as keys)
    text = PlainFormatter().format(line)
    for part in ("outcome=handover", f"replica={RID}", f"handover_window_s={WINDOW_S}"):
        assert part in text, text


@pytest.mark.parametrize("how", ["engine down", "always"])
async def test_a_deregistration_is_one_line_with_its_outcome(
    rig: Rig, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    registry = MemoryRegistry()
    if how == "always":
        rig.settings_kw["deregister_on_stop"] = "always"
    await rig.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    if how == "engine down":
        rig.stub.up = False  # /health answers 503
    line = await _stop_and_read(rig, registry, caplog)
    assert line.levelno == logging.INFO
    assert line.getMessage() == "replica deregistered"
    serving = False if how == "engine down" else None  # always: the engine is not asked
    assert (line.outcome, line.action, line.engine_serving) == (  # type: ignore[attr-defined]
        "deregister", "deregister", serving,
    )  # fmt: skip
    assert not await _registered(registry)


async def test_a_successors_registration_is_an_absent_outcome(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Agents overlapping in a rollout: the new one registered before the old one stops.
    The old one's line says it had nothing to release (it read as a failed hand-over)."""
    registry = MemoryRegistry()
    rig.settings_kw.update(heartbeat_interval_s=5.0, registration_ttl_s=10.0)  # one, at start
    await rig.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    successor = Registration(
        replica_id=RID, url="http://10.0.0.1:8000", model=MODEL, block_size=16,
        capacity_blocks=100, agent_id="successor", registered_ms=1,
    )  # fmt: skip
    await registry.register(successor, 2_000, int(time.time() * 1000))
    line = await _stop_and_read(rig, registry, caplog)
    assert line.levelno == logging.INFO
    assert (line.outcome, line.action) == ("absent", "handover")  # type: ignore[attr-defined]


async def test_an_agent_that_never_registered_says_so(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Its heartbeats never got through: the stop's deregistration (of its own only) finds
    nothing, and says so, where it logged nothing at all."""
    registry = RefusingRegistry()
    agent = await rig.start(registry=registry)
    await until(lambda: counter_total(agent.metrics.heartbeats, outcome="error") >= 1, 5.0)
    line = await _stop_and_read(rig, registry, caplog)
    assert line.levelno == logging.INFO
    assert (line.outcome, line.action, line.engine_serving) == (  # type: ignore[attr-defined]
        "absent", "deregister", None,
    )  # fmt: skip


@pytest.mark.parametrize("engine_up", [True, False])
async def test_a_registry_failure_is_one_warning_with_a_failed_outcome(
    rig: Rig, caplog: pytest.LogCaptureFixture, engine_up: bool
) -> None:
    """It was a WARNING without an outcome and then, for a hand-over, an INFO "no longer
    this agent's": a failure read as a successor's registration."""
    registry = FailingRegistry()
    await rig.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    rig.stub.up = engine_up
    line = await _stop_and_read(rig, registry, caplog)
    assert line.levelno == logging.WARNING
    assert line.outcome == "failed"  # type: ignore[attr-defined]
    assert line.action == ("handover" if engine_up else "deregister")  # type: ignore[attr-defined]
    assert "registry down" in line.error  # type: ignore[attr-defined]
    assert line.registration_ttl_s == 1.0  # type: ignore[attr-defined]


def test_the_outcomes_are_the_documented_ones() -> None:
    """docs/agent.md names each outcome the code can log."""
    from pathlib import Path

    from cachecore.agent.agent import RegistrationRelease

    doc = (Path(__file__).resolve().parents[1] / "docs" / "agent.md").read_text()
    section = doc[doc.index("### Stopping the agent") : doc.index("### How a stop runs")]
    for outcome in RegistrationRelease:
        assert f"`{outcome.value}`" in section, outcome
    for field in sorted(FIELDS | {"agent_id"}):
        assert f"`{field}`" in section, field


async def test_never_hands_over_without_asking_the_engine_as_the_doc_says(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """``never`` does not probe the engine either: its line's ``engine_serving`` is null,
    which docs/agent.md listed only for ``always`` and an agent with nothing registered."""
    registry = MemoryRegistry()
    rig.settings_kw["deregister_on_stop"] = "never"
    await rig.start(registry=registry)
    await until(lambda: _registered(registry), 5.0)
    rig.stub.up = False  # /health answers 503: never hands over all the same
    line = await _stop_and_read(rig, registry, caplog)
    assert (line.outcome, line.action, line.mode, line.engine_serving) == (  # type: ignore[attr-defined]
        "handover", "handover", "never", None,
    )  # fmt: skip
    sentence = _engine_serving_doc()
    assert "`never`" in sentence, sentence


def _engine_serving_doc() -> str:
    """docs/agent.md's sentence on the line's ``engine_serving`` field."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "agent.md").read_text()
    return doc[doc.index("`engine_serving` (the probe's") :][:200]
