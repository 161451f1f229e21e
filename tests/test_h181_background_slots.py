"""A background response holds its tenant's concurrency slot until it is terminal, and its
place under the watch cap is taken up front, fairly (D33, H181 review): real simulated
replicas and a real gateway, as ``test_responses_background.py``."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core import Gateway
from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_support import Stack, keys_file, stack, words
from tests.test_responses_background import _held, _until

pytestmark = pytest.mark.timeout(90)

ONE_SLOT = "default_tenant:\n  limits: {max_concurrency: 1}\n"


def _slots(gw: Gateway) -> Counter[str]:
    """Count the limiter's admits and releases from now on (admit's successes only)."""
    seen: Counter[str] = Counter()
    lim = gw.limiter
    admit, release = lim.admit, lim.release

    def spy_admit(*a: Any, **kw: Any) -> Any:
        rej = admit(*a, **kw)
        if rej is None:
            seen["admit"] += 1
        return rej

    def spy_release(tenant: str, replay: bool = False) -> None:
        seen["release"] += 1
        release(tenant, replay)

    lim.admit = spy_admit  # type: ignore[method-assign]
    lim.release = spy_release  # type: ignore[method-assign]
    return seen


def _body(st: Stack, seed: int, tokens: int = 4000, **kw: Any) -> dict[str, Any]:
    return {"model": st.model, "input": words(20, seed), "max_output_tokens": tokens, **kw}


async def _bg(h: httpx.AsyncClient, st: Stack, seed: int, tokens: int = 4000, **kw: Any) -> Any:
    return await h.post("/v1/responses", json=_body(st, seed, tokens, background=True), **kw)


def _in_flight(gw: Gateway, tenant: str = "anonymous") -> int:
    return gw.limiter.in_flight(tenant)


async def test_a_running_background_response_holds_the_tenants_only_slot() -> None:
    async with stack(count=1, policy=ONE_SLOT, background_poll_s=0.05) as st, st.http() as h:
        seen = _slots(st.gw)
        r = await _bg(h, st, 1)
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        rid = r.json()["id"]
        assert _in_flight(st.gw) == 1  # the engine computes on: its slot stays taken
        for body in (_body(st, 2, 4), _body(st, 3, 4, background=True)):
            refused = await h.post("/v1/responses", json=body)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["limit"] == "concurrency"
            assert refused.headers["retry-after"]
        # its retrieval and cancel do no engine work: not refused for the slot it holds
        got = await h.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["status"] == "queued"
        cancel = await h.post(f"/v1/responses/{rid}/cancel")
        assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
        # ended: released once, by the cancel that saw it end
        assert _in_flight(st.gw) == 0 and seen["admit"] == seen["release"] == 3, seen
        ok = await h.post("/v1/responses", json=_body(st, 2, 4))
        assert ok.status_code == 200, ok.text
        # a short one, ended by its watcher alone: the slot is free only then
        r = await _bg(h, st, 4, tokens=40)
        assert r.status_code == 200 and _in_flight(st.gw) == 1
        await _until(lambda: _held(st.gw) == 0)
        assert _in_flight(st.gw) == 0 and seen["admit"] == seen["release"], seen
        ok = await h.post("/v1/responses", json=_body(st, 5, 4, background=True))
        assert ok.status_code == 200, ok.text
        await _until(lambda: _in_flight(st.gw) == 0)


async def test_the_slot_is_released_once_when_its_replica_is_lost_or_the_gateway_stops() -> None:
    async with stack(count=2, policy=ONE_SLOT, background_poll_s=0.05) as st, st.http() as h:
        seen = _slots(st.gw)
        r = await _bg(h, st, 6)
        assert r.status_code == 200 and _in_flight(st.gw) == 1, r.text
        home = r.headers["x-kvgate-replica"]
        assert st.gw.pool is not None
        st.gw.pool.remove(home)  # its run is lost: the watcher's poll says so
        await _until(lambda: not st.gw._background)
        assert _count(st.gw.metrics.background_responses, outcome="lost") == 1
        assert _in_flight(st.gw) == 0 and seen["admit"] == seen["release"] == 1, seen
        r = await _bg(h, st, 7)
        assert r.status_code == 200 and _in_flight(st.gw) == 1, r.text
        gw = st.gw
    # the gateway stopped: its watcher was cancelled and gave the slot back, once
    assert not gw._background and _in_flight(gw) == 0
    assert seen["admit"] == seen["release"] == 2, seen
    assert _count(gw.metrics.background_responses, outcome="shutdown") == 1


async def test_one_tenant_at_its_share_refuses_neither_anothers_nor_serves_unwatched(
    tmp_path: Path,
) -> None:
    # a cap of 4, a tenant's share half of it: tenant a fills its share and is refused
    # (429) past it; b's responses are still served and watched; past the cap c is
    # refused (503), never served unwatched: its replica's routing would not see its run
    async with (
        stack(
            count=1, api_keys_file=keys_file(tmp_path, "abc"), background_poll_s=0.05,
            background_watch_max=4, background_watch_tenant_share=0.5,
        ) as st,
        st.http() as h,
    ):  # fmt: skip
        auth = {t: {"authorization": f"Bearer sk-{t}"} for t in "abc"}
        a = [await _bg(h, st, 10 + i, headers=auth["a"]) for i in range(4)]
        assert [r.status_code for r in a] == [200, 200, 429, 429], [r.text for r in a]
        err = a[2].json()["error"]
        assert err["code"] == "rate_limit_exceeded" and err["limit"] == "background_watch"
        assert int(a[2].headers["retry-after"]) >= 1
        b = [await _bg(h, st, 20 + i, headers=auth["b"]) for i in range(2)]
        assert [r.status_code for r in b] == [200, 200], [r.text for r in b]
        assert len(st.gw._background) == 4 and _held(st.gw) == 4
        c = await _bg(h, st, 30, headers=auth["c"])
        assert c.status_code == 503 and int(c.headers["retry-after"]) >= 1, c.text
        assert c.json()["error"]["code"] == "background_capacity"
        m = st.gw.metrics.background_responses
        assert _count(m, outcome="refused_share") == 2
        assert _count(m, outcome="refused_capacity") == 1
        assert _count(m, outcome="unwatched") == 0
        # refused before any work: the four served are all that reached the replica
        assert _count(st.gw.metrics.requests, endpoint="responses", status="200") == 4
        assert _count(st.gw.metrics.decisions) == 4
        # one of a's ends: its place is free again, for anyone
        rid = a[0].json()["id"]
        await h.post(f"/v1/responses/{rid}/cancel", headers=auth["a"])
        c = await _bg(h, st, 31, headers=auth["c"])
        assert c.status_code == 200 and len(st.gw._background) == 4, c.text


async def test_slots_held_by_background_runs_are_retried_after_the_poll_interval() -> None:
    """H189: a 429 ``concurrency`` while the tenant's background runs hold its every slot
    says the poll interval (no slot frees before a watcher's poll), not 1 s."""
    async with stack(count=1, policy=ONE_SLOT, background_poll_s=7.0) as st, st.http() as h:
        r = await _bg(h, st, 1)
        assert r.status_code == 200 and _in_flight(st.gw) == 1, r.text
        for body in (_body(st, 2, 4), _body(st, 3, 4, background=True)):
            refused = await h.post("/v1/responses", json=body)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["limit"] == "concurrency"
            assert refused.headers["retry-after"] == "7", refused.headers
        cancel = await h.post(f"/v1/responses/{r.json()['id']}/cancel")
        assert cancel.status_code == 200 and _in_flight(st.gw) == 0
        assert st.gw.slot_retry_s("anonymous", 1) == 1.0  # no run holds it: a sync one's
