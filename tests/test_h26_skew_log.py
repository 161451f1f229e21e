"""The agent clock-skew log is bounded per replica.

The gateway logged an agent's clock once when it passed CLOCK_SKEW_WARN_MS of its own and
once when it was back, at each refresh (every 0.1 s) that saw the state change: an offset
that flips (hovering at the threshold, two agents with different clocks publishing for one
replica, a clock stepped back and forth) logged a WARNING and an INFO per flip, up to ten
lines a second per replica. Now a change is logged at once while the replica has had fewer
than CLOCK_SKEW_LOG_BURST lines in CLOCK_SKEW_LOG_INTERVAL_S; past that it waits for the
window and is told as the state reached, with ``changes_unlogged``.

Unit tests drive ``ClockSkewLog`` with a fake clock; the last test drives the gateway's
SharedLoadRefresher over a real Redis with an agent whose offset flips at every publish."""

from __future__ import annotations

import logging
import time

import pytest

from cachecore.loadstate import (
    CLOCK_SKEW_LOG_BURST,
    CLOCK_SKEW_LOG_INTERVAL_S,
    ClockSkewLog,
    EngineLoad,
    RedisLoadStore,
)
from tests.test_h25_load_clock import stores, wall_ms  # noqa: F401 (the fixture)

pytestmark = pytest.mark.timeout(30)

LOGGER = "tests.h26_skew"
OFF, ON = 5_000, 0  # ms: far past the threshold, and agreeing


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, int]]:
    return [
        (r.levelname, int(getattr(r, "changes_unlogged", -1)))
        for r in caplog.records
        if r.name == LOGGER
    ]


def _skew_log() -> tuple[ClockSkewLog, FakeClock]:
    clock = FakeClock()
    return ClockSkewLog(logging.getLogger(LOGGER), 1_000, clock=clock), clock


def test_a_skew_that_passes_and_comes_back_is_told_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger=LOGGER)
    sl, clock = _skew_log()
    for skew in (ON, OFF, OFF, OFF, ON, ON):
        sl.observe({"r": skew}, ["r"])
        clock.t += 0.1
    assert _lines(caplog) == [("WARNING", 0), ("INFO", 0)]
    assert sl.off == set()


def test_an_offset_flipping_at_every_refresh_is_bounded_per_replica(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """600 refreshes 0.1 s apart (a minute), the offset flipping at each, for two replicas:
    at most CLOCK_SKEW_LOG_BURST lines each in the minute (before: 600 each); the window's
    end tells the state reached and how many changes no line told."""
    caplog.set_level("INFO", logger=LOGGER)
    sl, clock = _skew_log()
    steps = int(CLOCK_SKEW_LOG_INTERVAL_S / 0.1)
    for i in range(steps):
        skew = OFF if i % 2 == 0 else ON
        sl.observe({"a": skew, "b": skew}, ["a", "b"])
        clock.t += 0.1
    lines = _lines(caplog)
    assert len(lines) == 2 * CLOCK_SKEW_LOG_BURST, lines
    assert lines == [("WARNING", 0), ("WARNING", 0), ("INFO", 0), ("INFO", 0)]
    caplog.clear()
    clock.t = 1000.0 + CLOCK_SKEW_LOG_INTERVAL_S  # the first line's window is over
    sl.observe({"a": OFF, "b": OFF}, ["a", "b"])
    # 598 flips since the INFO of step 1 (off at even steps, on at odd) and this one: the
    # line tells this one, and the 598 before it as unlogged
    assert _lines(caplog) == [("WARNING", steps - 2), ("WARNING", steps - 2)]
    assert sl.off == {"a", "b"}


def test_a_flip_and_back_within_the_bound_is_told_when_the_window_allows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger=LOGGER)
    sl, clock = _skew_log()
    for skew in (OFF, ON, OFF, ON):  # two lines told, then off and back: not told yet
        sl.observe({"r": skew}, ["r"])
        clock.t += 1.0
    assert _lines(caplog) == [("WARNING", 0), ("INFO", 0)]
    clock.t += CLOCK_SKEW_LOG_INTERVAL_S
    sl.observe({"r": ON}, ["r"])
    sl.observe({"r": ON}, ["r"])  # nothing new: nothing more
    assert _lines(caplog) == [("WARNING", 0), ("INFO", 0), ("INFO", 2)]


def test_a_replica_gone_from_the_pool_is_forgotten() -> None:
    sl, _clock = _skew_log()
    sl.observe({"r": OFF}, ["r"])
    assert sl.off == {"r"}
    sl.observe({}, [])
    assert sl.off == set()


async def test_the_gateway_bounds_the_log_of_an_agent_whose_offset_flips(
    stores: tuple[RedisLoadStore, RedisLoadStore],  # noqa: F811 (the fixture)
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway's refresher over a real Redis, an agent 10 s off at every other publish:
    20 refreshes log CLOCK_SKEW_LOG_BURST lines (before: 20)."""
    from gateway.load import InFlight, SharedLoadRefresher

    agent, gateway = stores
    refresher = SharedLoadRefresher(gateway, "gw-flip", InFlight(), lambda: ["clk"])
    caplog.set_level("INFO", logger="gateway.load")
    t0 = time.monotonic()
    for i in range(20):
        at = wall_ms() + (10_000 if i % 2 == 0 else 0)
        await agent.publish_engine("clk", EngineLoad(0, 0, 0.0, metrics_ts_ms=at), 5_000, at)
        await refresher.refresh_once()
    assert time.monotonic() - t0 < CLOCK_SKEW_LOG_INTERVAL_S  # all within one window
    said = [r.levelname for r in caplog.records if r.getMessage().startswith("agent clock")]
    assert said == ["WARNING", "INFO"][:CLOCK_SKEW_LOG_BURST], said
