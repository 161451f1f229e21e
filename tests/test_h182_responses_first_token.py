"""A streamed Responses run's first token is its first output event, not its first chunk
(D30): vLLM 0.33's responses_stream_generator sends ``response.created`` and
``response.in_progress`` before it reads the engine's first output, so the stream's first
chunk comes before the prefill. Real gateway, real simulated replicas (whose prefill runs
between the two, as vLLM's), a prompt long enough that the prefill takes a measurable
while: the measured TTFT, the cost model's fit sample, the queue accounting and the D16/D17
watch all take the first output event, and a stream with none releases once."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

import cachecore.replica.app as replica_app
from cachecore.replica.responses import sse_event
from cachecore.replica.settings import ReplicaSettings
from gateway.core import Outcome
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(90)

# the simulator's real time: a 2000-token prefill takes about 0.5 s
SLOW = ReplicaSettings(time_scale=1.0)
_PREAMBLE = ("response.created", "response.in_progress")


def _spy(st: Stack) -> tuple[list[Outcome], list[float]]:
    """Each outcome the gateway finishes with, and each TTFT (ms) its fit is fed."""
    outcomes: list[Outcome] = []
    fed: list[float] = []
    finish, update = st.gw.finish, st.gw.fit.update

    def on_finish(d: Any, out: Outcome) -> None:
        outcomes.append(out)
        finish(d, out)

    def on_update(x: Sequence[float], observed_ms: float) -> bool:
        fed.append(observed_ms)
        return update(x, observed_ms)

    st.gw.finish = on_finish  # type: ignore[method-assign]
    st.gw.fit.update = on_update  # type: ignore[method-assign]
    return outcomes, fed


async def _finished(outcomes: list[Outcome], n: int) -> None:
    """Wait (bounded) for the gateway's finish of the ``n``-th exchange: it runs after the
    stream's last write, which the client may read first."""
    for _ in range(200):
        if len(outcomes) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(outcomes)} exchanges finished, not {n}")


async def _stream(
    st: Stack, body: dict[str, Any], path: str = "/v1/responses"
) -> list[tuple[str, float]]:
    """The stream's events as (type, seconds since the request was sent)."""
    marks: list[tuple[str, float]] = []
    async with st.http() as h:
        t0 = time.perf_counter()
        async with h.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            buf = b""
            async for chunk in resp.aiter_bytes():
                at = time.perf_counter() - t0
                buf += chunk
                *done, buf = buf.split(b"\n\n")
                for block in done:
                    data = block.split(b"data: ", 1)[1]
                    kind = "done" if data == b"[DONE]" else orjson.loads(data).get("type", "chunk")
                    marks.append((kind, at))
    return marks


async def test_a_responses_streams_ttft_is_its_first_output_event() -> None:
    async with stack(count=1, replica=SLOW) as st:
        outcomes, fed = _spy(st)
        body = {"model": st.model, "input": words(2000, 1), "max_output_tokens": 3, "stream": True}
        marks = await _stream(st, body)
        kinds = [k for k, _ in marks]
        assert tuple(kinds[:2]) == _PREAMBLE and kinds[-1] == "response.completed"
        created = marks[0][1]
        first = next(at for k, at in marks if k not in _PREAMBLE)
        assert kinds[2] == "response.output_item.added"
        # the replica sends its preamble before the prefill, as vLLM's: a real gap
        assert first - created > 0.25, marks
        await _finished(outcomes, 1)
        (out,) = outcomes
        assert out.ttft_s is not None
        # the first output event, not response.created (0.03 s without the fix)
        assert out.ttft_s == pytest.approx(first, abs=0.15), (out.ttft_s, created, first)
        assert out.ttft_s - created > 0.2
        assert fed == [pytest.approx(out.ttft_s * 1000.0)]  # the fit is fed that value
        # as a chat stream of the same prompt length measures it
        chat = {
            "model": st.model, "messages": [{"role": "user", "content": words(2000, 2)}],
            "max_tokens": 3, "stream": True,
        }  # fmt: skip
        chat_marks = await _stream(st, chat, "/v1/chat/completions")
        await _finished(outcomes, 2)
        assert outcomes[1].ttft_s == pytest.approx(chat_marks[0][1], abs=0.15)
        assert outcomes[1].ttft_s == pytest.approx(out.ttft_s, rel=0.5)


async def test_the_prefill_stays_queued_and_watched_until_the_first_output() -> None:
    async with stack(count=1, replica=SLOW) as st, st.http() as h:
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]
        inflight = st.gw.inflight
        outcomes, _ = _spy(st)
        body = {"model": st.model, "input": words(2000, 3), "max_output_tokens": 3, "stream": True}
        prefill: tuple[float, int, float, float] | None = None
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for chunk in resp.aiter_bytes():
                if prefill is None:
                    assert b"response.created" in chunk and b"output_item" not in chunk
                    await asyncio.sleep(0.2)  # in the prefill: the replica computes
                    now = time.monotonic()
                    queued, requests, _ = inflight.own(rep.id)
                    # far in the future: still waiting for its first token, it is overdue
                    late = inflight.overdue_s(rep.id, now + 1000.0, 0.0)
                    prefill = (queued, requests, inflight.since_progress_s(rep.id, now), late)
        # after response.created, in the prefill: its tokens queued, no progress seen, its
        # first token watched (D16), as a chat stream's before its first chunk (without
        # the fix: (0.0, 0, 0.2, 0.0), taken at response.created)
        assert prefill is not None
        assert prefill[0] >= 1900 and prefill[1] == 1, prefill
        assert prefill[2] == math.inf and prefill[3] > 900.0, prefill
        # once the output came: out of the queue, progress seen, nothing overdue
        await _finished(outcomes, 1)
        assert inflight.own(rep.id) == (0.0, 0, 0)
        assert inflight.since_progress_s(rep.id, time.monotonic()) < 5.0
        assert inflight.overdue_s(rep.id, time.monotonic() + 1000.0, 0.0) == 0.0


@pytest.mark.parametrize("end", ["response.completed", "error"])
async def test_a_stream_without_output_releases_once_with_no_ttft(
    monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    # every output event held back (as a reasoning or tool parser may hold every token),
    # or an error event in the terminal event's place: no first token is seen

    def only_preamble_and_end(event: dict[str, Any]) -> bytes:
        if event["type"] in _PREAMBLE:
            return sse_event(event)
        if event["type"] == "response.completed":
            if end == "error":
                return sse_event({"type": "error", "code": "500", "message": "x", "param": None})
            return sse_event(event)
        return b""

    monkeypatch.setattr(replica_app, "sse_event", only_preamble_and_end)
    async with stack(count=1, replica=SLOW) as st:
        outcomes, fed = _spy(st)
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]
        body = {"model": st.model, "input": words(2000, 4), "max_output_tokens": 3, "stream": True}
        kinds = [k for k, _ in await _stream(st, body)]
        await _finished(outcomes, 1)
        # (an error event in the terminal event's place: the gateway ends the stream as
        # one that broke off, its own error event and [DONE] after the engine's)
        assert kinds[:3] == [*_PREAMBLE, end], kinds
        (out,) = outcomes
        assert out.ttft_s is None and fed == []  # no TTFT observed, no fit sample
        assert (out.status, out.error is None) == ((200, True) if end != "error" else (502, False))
        ttft = st.gw.metrics.ttft.labels(rep.id).collect()[0].samples
        assert next(s.value for s in ttft if s.name.endswith("_count")) == 0
        # released: nothing queued or running, nothing watched (a ticket moves at most
        # once, load.Ticket)
        assert st.gw.inflight.own(rep.id) == (0.0, 0, 0)
        assert st.gw.inflight.overdue_s(rep.id, time.monotonic() + 1000.0, 0.0) == 0.0
        # its engine finished it (a terminal event): progress; an error is none
        since = st.gw.inflight.since_progress_s(rep.id, time.monotonic())
        assert (since < 5.0) == (end != "error"), since


async def test_a_background_stream_left_in_its_prefill_is_not_overdue() -> None:
    # its client leaves after response.created: the run goes on unseen, its ticket held by
    # the watcher (D33); it leaves the queue at its predicted first token, as a JSON
    # answer's, and its replica is never read as stalled for want of a reader
    async with stack(count=1, replica=SLOW, background_poll_s=0.05) as st, st.http() as h:
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]
        body = {
            "model": st.model, "input": words(2000, 5), "max_output_tokens": 400,
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for chunk in resp.aiter_bytes():
                assert b"output_item" not in chunk
                created = chunk.split(b"\n\n", 1)[0].split(b"data: ", 1)[1]
                rid = orjson.loads(created)["response"]["id"]
                break
        for _ in range(100):  # bounded: the watcher takes the ticket at the finish
            if st.gw._background:
                break
            await asyncio.sleep(0.01)
        ((d, _),) = st.gw._background.values()
        assert d.ticket is not None
        await asyncio.sleep(max(0.0, d.ticket.expected - time.monotonic()) + 0.05)
        now = time.monotonic()
        assert st.gw.inflight.overdue_s(rep.id, now + 1000.0, 0.0) == 0.0
        queued, requests, running = st.gw.inflight.own(rep.id)
        assert (queued, requests, running) == (0.0, 0, 1)
        await st.client().responses.cancel(rid)
