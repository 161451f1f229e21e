"""R1's N9 (twenty-sixth session): the harness's policy scales the routing margins that are
compared against costs with the costs. At --time-scale 0.5 the cost coefficients were
halved but the 0.5 ms tie band and the sensitive sessions' 50 ms slack were not: in engine
time twice as wide as the shipped policy's."""

from __future__ import annotations

import pytest

from loadtest.harness import scaled_policy
from policies.schema import builtin_policy_path, load_policy, parse_policy_text


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.2])
def test_margins_compared_against_costs_scale_with_them(scale: float) -> None:
    base = load_policy(builtin_policy_path("default"))
    pol = parse_policy_text(scaled_policy("expected_latency", scale))
    assert pol.cost.overhead_ms == pytest.approx(base.cost.overhead_ms * scale)
    assert pol.routing.tie_epsilon_ms == pytest.approx(base.routing.tie_epsilon_ms * scale)
    slack = pol.routing.sensitive_sticky.slack_ms
    assert slack == pytest.approx(base.routing.sensitive_sticky.slack_ms * scale)
    # a wait on the host's wall clock: not scaled
    assert pol.routing.overdue_grace_ms == base.routing.overdue_grace_ms
