"""A background response's watch ends however it ends (D33, H194 review): a watcher
cancelled before its first step; and a request refused for the watch caps keeps its
tenant's request rate. Real simulated replicas and a real gateway, as
``test_h181_background_slots.py``."""

from __future__ import annotations

import pytest

from gateway.core import Dispatch, Outcome
from gateway.limits import TenantLimiter
from policies.schema import TenantLimits
from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_support import stack
from tests.test_h181_background_slots import ONE_SLOT, _bg, _body, _in_flight, _slots
from tests.test_responses_background import _held, _until

pytestmark = pytest.mark.timeout(90)


async def test_a_watcher_cancelled_before_its_first_step_releases_once() -> None:
    # the tick in which stop cancels the background tasks may be the one a watcher was
    # spawned in: its coroutine never runs, so no code of its own can release
    async with stack(count=1, policy=ONE_SLOT, background_poll_s=0.05) as st, st.http() as h:
        gw, seen = st.gw, _slots(st.gw)
        watch = gw._watch_background

        def cancelled_at_once(d: Dispatch, out: Outcome) -> bool:
            kept = watch(d, out)
            if kept:
                gw._background[(d.replica, d.response_id or "")][1].cancel()
            return kept

        gw._watch_background = cancelled_at_once  # type: ignore[method-assign]
        r = await _bg(h, st, 4)
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        await _until(lambda: not gw._background and _in_flight(gw) == 0, 3.0)
        assert _held(gw) == 0 and seen["admit"] == seen["release"] == 1, seen
        assert _count(gw.metrics.background_responses, outcome="shutdown") == 1


async def test_refusals_for_the_watch_cap_spend_no_request_rate() -> None:
    # three requests at once, next to none over the test: the one run holds the cap
    policy = "default_tenant:\n  limits: {requests_per_s: 0.001, requests_burst: 3}\n"
    async with (
        stack(count=1, policy=policy, background_poll_s=0.05, background_watch_max=1) as st,
        st.http() as h,
    ):
        r = await _bg(h, st, 5)
        assert r.status_code == 200, r.text
        for i in range(5):
            refused = await _bg(h, st, 10 + i)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["limit"] == "background_watch", refused.text
        for i in range(2):  # the rest of its burst
            ok = await h.post("/v1/responses", json=_body(st, 20 + i, 4))
            assert ok.status_code == 200, ok.text
        over = await h.post("/v1/responses", json=_body(st, 30, 4))
        assert over.status_code == 429 and over.json()["error"]["limit"] == "rate"


def test_a_refunded_request_token_never_exceeds_the_burst() -> None:
    lim, limits = TenantLimiter(), TenantLimits(requests_per_s=0.001, requests_burst=2)
    assert lim.admit("t", limits, 0.0) is None
    for _ in range(3):
        lim.refund_request("t", 0.0)
    assert lim.admit("t", limits, 0.0) is None and lim.admit("t", limits, 0.0) is None
    rej = lim.admit("t", limits, 0.0)
    assert rej is not None and rej.limit == "rate"
    lim.refund_request("nobody", 0.0)  # a tenant never admitted: nothing to give back
