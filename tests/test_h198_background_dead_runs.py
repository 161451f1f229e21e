"""A dead background run told from a queued one (D33, H198): a streamed run whose stream
fails before its first output is watched on, not cancelled (it may be queued behind load
past the read timeout); the watcher ends a run as dead (``engine_idle``, cancelled there)
when its replica's engine reports no running and no waiting request on
:data:`~gateway.load.IDLE_SCRAPES` fresh scrapes in a row since the watch began; a stored
response too large to read ends its watch (``too_large``). Real simulated replicas, their
metrics scraped by embedded agents, and a real gateway, as
``test_h194_background_ends.py``."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest

from cachecore.replica.settings import ReplicaSettings
from gateway.load import IDLE_SCRAPES, IdleEngine, SharedLoad
from gateway.metrics import GatewayMetrics
from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_support import Stack, stack
from tests.test_h181_background_slots import ONE_SLOT, _body, _in_flight, _slots
from tests.test_h194_background_ends import _kinds
from tests.test_responses_background import _held, _until

pytestmark = pytest.mark.timeout(90)

SCRAPE_S = 0.1  # the embedded agents' scrape interval here (1 s by default)
ONE_SEQ = ReplicaSettings(time_scale=0.05, max_num_seqs=1)  # one request at a time


@pytest.fixture(autouse=True)
def _fast_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_AGENT_SCRAPE_INTERVAL_S", str(SCRAPE_S))


def _outcomes(st: Stack) -> dict[str, float]:
    bg = st.gw.metrics.background_responses
    names = ("completed", "incomplete", "stream_failed", "engine_idle", "too_large", "expired")
    return {o: _count(bg, outcome=o) for o in names}


async def _stream_to_end(h: httpx.AsyncClient, body: dict[str, Any]) -> tuple[bytes, str]:
    """POST a streamed Responses request and read it to its end: its bytes and its id."""
    raw = b""
    async with h.stream("POST", "/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        async for chunk in resp.aiter_bytes():
            raw += chunk
    first = orjson.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    return raw, first["response"]["id"]


async def _status(h: httpx.AsyncClient, rid: str) -> str:
    got = await h.get(f"/v1/responses/{rid}")
    assert got.status_code == 200, got.text
    return str(got.json()["status"])


async def test_a_run_queued_past_the_read_timeout_is_watched_to_completion() -> None:
    # one sequence at a time: a long stream runs, the background run queues behind it for
    # longer than the read timeout; 093fec5 took the timeout for a dead run and cancelled
    async with (
        stack(count=1, replica=ONE_SEQ, agents=True, background_poll_s=0.05,
              read_timeout_s=0.5) as st,
        st.http() as h,
    ):  # fmt: skip
        seen = _slots(st.gw)
        blocker_started = asyncio.Event()

        async def blocker() -> None:
            body = _body(st, 1, 3000, stream=True)
            async with h.stream("POST", "/v1/responses", json=body) as resp:
                async for chunk in resp.aiter_bytes():
                    if b"output_text.delta" in chunk:
                        blocker_started.set()

        task = asyncio.create_task(blocker())
        await asyncio.wait_for(blocker_started.wait(), 10.0)
        t0 = time.monotonic()
        raw, rid = await _stream_to_end(h, _body(st, 2, 8, background=True, stream=True))
        # its stream hit the read timeout before any output: the engine still had it
        kinds = _kinds(raw)
        assert "response.output_text.delta" not in kinds and "gateway_error" in kinds, kinds
        assert time.monotonic() - t0 >= 0.5
        assert not task.done()  # still queued behind the blocker
        assert await _status(h, rid) == "queued"
        await asyncio.wait_for(task, 30.0)
        await _until(lambda: not st.gw._background, 10.0)
        got = _outcomes(st)
        ran = got["completed"] + got["incomplete"]  # incomplete: its max_output_tokens
        assert ran == 1 and got["stream_failed"] == got["engine_idle"] == 0, got
        assert await _status(h, rid) in ("completed", "incomplete")  # not cancelled
        assert _held(st.gw) == 0 and seen["admit"] == seen["release"], seen


async def test_a_dead_run_is_ended_within_a_few_scrapes() -> None:
    # vLLM 0.33's streamed run whose engine request fails stays "queued" for ever: its
    # replica's engine then holds no request, which tells it from a queued one
    async with (
        stack(count=1, policy=ONE_SLOT, agents=True, background_poll_s=0.05,
              background_idle_s=0) as st,
        st.http() as h,
    ):  # fmt: skip
        seen = _slots(st.gw)
        drv = st.fleet.replicas[0].driver
        drv.pause(5.0)  # the request waits in the engine: no output yet
        raw = b""
        body = _body(st, 3, 40, background=True, stream=True)
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for chunk in resp.aiter_bytes():
                raw += chunk
                if b"response.in_progress" in raw and drv._handles:
                    for running in list(drv._handles):  # the engine fails it
                        drv.abort(running, "engine failed")
        rid = orjson.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
        ended = time.monotonic()
        await _until(lambda: not st.gw._background, 5.0)
        took = time.monotonic() - ended
        got = _outcomes(st)
        assert got["engine_idle"] == 1 and got["stream_failed"] == 0, got
        # about IDLE_SCRAPES scrape intervals, not the read timeout nor the hour
        assert took < 3.0, took
        assert _held(st.gw) == 0 and _in_flight(st.gw) == 0
        assert seen["admit"] == seen["release"] == 1, seen
        deadline = time.monotonic() + 5.0
        while (status := await _status(h, rid)) != "cancelled":  # bounded: the deadline
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.05)
        ok = await h.post("/v1/responses", json=_body(st, 4, 4))  # the only slot is free
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("agents", "tools"),
    [(False, None), (True, [{"type": "function", "name": "f"}, {"type": "web_search_preview"}])],
    ids=["no_scrapes", "builtin_tool"],
)
async def test_a_run_its_engine_cannot_judge_stays_watched(
    agents: bool, tools: list[dict[str, Any]] | None
) -> None:
    # no agent scrapes the engine, or the run lists a tool vLLM's server runs itself (its
    # engine holds none of the run's requests while the tool runs): nothing tells a dead
    # run from a live one, and the watch's own bound (KVGATE_BACKGROUND_WATCH_MAX_S) stands
    async with stack(count=1, agents=agents, background_poll_s=0.05) as st, st.http() as h:
        drv = st.fleet.replicas[0].driver
        drv.pause(5.0)
        raw = b""
        extra = {} if tools is None else {"tools": tools}
        body = _body(st, 5, 40, background=True, stream=True, **extra)
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for chunk in resp.aiter_bytes():
                raw += chunk
                if b"response.in_progress" in raw and drv._handles:
                    for running in list(drv._handles):
                        drv.abort(running, "engine failed")
        rid = orjson.loads(raw.split(b"data: ", 1)[1].split(b"\n", 1)[0])["response"]["id"]
        await asyncio.sleep(20 * SCRAPE_S)
        assert len(st.gw._background) == 1 and _held(st.gw) == 1
        assert await _status(h, rid) == "queued"
        got = _outcomes(st)
        assert got["engine_idle"] == got["stream_failed"] == 0, got
        cancel = await h.post(f"/v1/responses/{rid}/cancel")  # the client still can
        assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
        await _until(lambda: not st.gw._background and _held(st.gw) == 0, 3.0)


async def test_a_stored_response_over_the_body_bound_ends_its_watch() -> None:
    # c33da89: the poll's answer over the bound is not read (None), and the watcher read
    # up to the bound again every poll interval to the watch's hour
    async with (
        stack(count=1, policy=ONE_SLOT, background_poll_s=0.05,
              max_upstream_body_bytes=4096) as st,
        st.http() as h,
    ):  # fmt: skip
        seen = _slots(st.gw)
        cancels: list[Any] = []
        cancel = st.gw._cancel_orphan

        def spy(d: Any, *rest: Any) -> None:
            cancels.append(d)
            cancel(d, *rest)

        st.gw._cancel_orphan = spy  # type: ignore[method-assign,assignment]
        r = await h.post("/v1/responses", json=_body(st, 6, 2000, background=True))
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        await _until(lambda: not st.gw._background, 10.0)
        assert _outcomes(st)["too_large"] == 1
        assert _held(st.gw) == 0 and seen["admit"] == seen["release"] == 1, seen
        assert cancels == []  # the run had ended: nothing to cancel
        stored = [s.response["status"] for s in st.fleet.replicas[0].responses._items.values()]
        assert stored in (["completed"], ["incomplete"]), stored
        got = await h.get(f"/v1/responses/{r.json()['id']}")
        assert got.status_code == 502, got.text  # the client's read is refused alike


def _load(ts: int, running: int = 0, waiting: int = 0) -> SharedLoad:
    return SharedLoad(running=running, waiting=waiting, metrics_ts_ms=ts)


def test_only_fresh_consecutive_idle_scrapes_since_the_watch_count() -> None:
    idle = IdleEngine(since_ms=1000)
    assert not idle.dead(_load(900))  # scraped before the watch began
    assert not idle.dead(_load(1000))
    for ts in range(1001, 1000 + IDLE_SCRAPES):
        assert not idle.dead(_load(ts))
        assert not idle.dead(_load(ts))  # the same scrape again adds nothing
    assert idle.dead(_load(1000 + IDLE_SCRAPES))
    busy = IdleEngine(since_ms=0)
    for ts in range(1, 10):  # a waiting or running request breaks the row
        assert not busy.dead(_load(ts, waiting=ts % IDLE_SCRAPES == 0))
    gap = IdleEngine(since_ms=0)
    for ts in range(1, IDLE_SCRAPES):
        gap.dead(_load(ts))
    assert not gap.dead(None) and not gap.dead(_load(0))  # no report: unknown
    assert not gap.dead(_load(IDLE_SCRAPES))


def test_the_outcome_metric_names_the_new_outcomes() -> None:
    help_text = GatewayMetrics().background_responses._documentation
    assert "engine_idle" in help_text and "too_large" in help_text
