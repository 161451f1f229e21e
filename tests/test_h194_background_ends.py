"""A background response's watch ends however its run ends (D33, H194 review): a streamed
run that failed on its replica, a watcher cancelled before its first step; and a request
refused for the watch caps keeps its tenant's request rate. Real simulated replicas and a
real gateway, as ``test_h181_background_slots.py``."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from gateway.core import Dispatch
from gateway.limits import TenantLimiter
from policies.schema import TenantLimits
from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_support import stack
from tests.test_h181_background_slots import ONE_SLOT, _bg, _body, _in_flight, _slots
from tests.test_responses_background import _held, _until

pytestmark = pytest.mark.timeout(90)


def _kinds(raw: bytes) -> list[str]:
    """The types of a relayed Responses stream's events, in order: the gateway's own error
    event (an error object, no type) ``gateway_error``, ``[DONE]`` empty."""
    out = []
    for block in raw.strip().split(b"\n\n"):
        data = block.split(b"data: ", 1)[-1]
        obj = orjson.loads(data) if data.startswith(b"{") else {}
        out.append("gateway_error" if "error" in obj else obj.get("type", ""))
    return out


async def test_a_streamed_run_that_fails_on_its_engine_ends_its_watch_at_once() -> None:
    # vLLM 0.33 records no event of a failed streamed run (its error event fails
    # validation) and leaves it "queued" for ever: the watch ended only at its hour
    async with (
        stack(count=1, policy=ONE_SLOT, background_poll_s=0.05) as st,
        st.http() as h,
    ):
        seen = _slots(st.gw)
        body = _body(st, 1, background=True, stream=True)
        raw, rid = b"", None
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            assert resp.status_code == 200
            async for chunk in resp.aiter_bytes():
                raw += chunk
                if rid is None and b"response.output_text.delta" in raw:
                    rid = orjson.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"][
                        "id"
                    ]
                    # the engine fails the request (the API server and its store stay)
                    drv = st.fleet.replicas[0].driver
                    for running in list(drv._handles):
                        drv.abort(running, "engine failed")
        kinds = _kinds(raw)
        # no terminal event, no error event of the engine's: the gateway's 502 ends it
        assert kinds[-2:] == ["gateway_error", ""], kinds
        assert not {"error", "response.completed", "response.incomplete"} & set(kinds), kinds
        # the watch ended with the stream: ticket and slot back, once, counted
        await _until(lambda: not st.gw._background and _in_flight(st.gw) == 0, 3.0)
        assert _held(st.gw) == 0 and seen["admit"] == seen["release"] == 1, seen
        assert _count(st.gw.metrics.background_responses, outcome="stream_failed") == 1
        # its run was cancelled there: the stored response no longer reads "queued"
        assert rid is not None

        async def status() -> Any:
            got = await h.get(f"/v1/responses/{rid}")
            assert got.status_code == 200, got.text
            return got.json()["status"]

        deadline = time.monotonic() + 5.0
        while (got := await status()) != "cancelled":  # bounded: the deadline
            assert time.monotonic() < deadline, got
        # the tenant's only slot is free: the next request is served
        ok = await h.post("/v1/responses", json=_body(st, 2, 4))
        assert ok.status_code == 200, ok.text


async def test_a_client_that_leaves_a_background_stream_is_not_a_failed_run() -> None:
    # no error of the replica's: the run goes on, watched to its end (not cancelled)
    async with stack(count=1, background_poll_s=0.05) as st, st.http() as h:
        body = _body(st, 3, 60, background=True, stream=True)
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break
        await _until(lambda: _held(st.gw) == 0)
        bg = st.gw.metrics.background_responses
        assert _count(bg, outcome="stream_failed") == 0
        assert _count(bg, outcome="completed") + _count(bg, outcome="incomplete") == 1


async def test_a_watcher_cancelled_before_its_first_step_releases_once() -> None:
    # the tick in which stop cancels the background tasks may be the one a watcher was
    # spawned in: its coroutine never runs, so no code of its own can release
    async with stack(count=1, policy=ONE_SLOT, background_poll_s=0.05) as st, st.http() as h:
        gw, seen = st.gw, _slots(st.gw)
        watch = gw._watch_background

        def cancelled_at_once(d: Dispatch, *rest: Any) -> bool:
            kept = watch(d, *rest)
            if kept:
                gw._background[(d.replica, d.response_id or "")][1].cancel()
            return kept

        gw._watch_background = cancelled_at_once  # type: ignore[method-assign,assignment]
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
