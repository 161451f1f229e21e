"""The agent's latency window: the last N values, exact percentiles, fixed memory."""

import pytest

from cachecore.agent.metrics import LatencyWindow


def test_the_window_keeps_the_last_values_in_order() -> None:
    w = LatencyWindow(size=4)
    assert (len(w), w.values(), w.percentile(50)) == (0, [], None)
    for v in (1.0, 2.0, 3.0):
        w.add(v)
    assert (len(w), w.values()) == (3, [1.0, 2.0, 3.0])
    for v in (4.0, 5.0, 6.0):
        w.add(v)
    assert (len(w), w.values()) == (4, [3.0, 4.0, 5.0, 6.0])
    w.clear()
    assert (len(w), w.values(), w.percentile(99)) == (0, [], None)
    w.add(7.0)
    assert w.values() == [7.0]


def test_percentiles_are_exact_over_the_kept_values() -> None:
    w = LatencyWindow(size=100)
    for v in range(200):  # only 100..199 remain
        w.add(float(v))
    assert w.percentile(50) == 149.0
    assert w.percentile(99) == 198.0
    assert w.percentile(100) == 199.0
    assert w.percentile(0) == 100.0


def test_memory_is_allocated_once() -> None:
    w = LatencyWindow(size=1000)
    size = w._buf.buffer_info()[1]
    for v in range(5000):
        w.add(v / 1000)
    assert w._buf.buffer_info()[1] == size == 1000
    with pytest.raises(ValueError):
        LatencyWindow(size=0)
