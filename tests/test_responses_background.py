"""The Responses API's background mode through the gateway (D33), end to end: real
simulated replicas (serving ``background``, polling, the replayed stream and cancel as vLLM
0.33 does) and a real gateway. A background response's ticket on its replica is held until
the engine's stored response is terminal, not released at the "queued" answer."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.core import Gateway
from gateway.responses import SEALED_PREFIX
from gateway.upstream import UpstreamResponse
from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_support import Stack, keys_file, kill_replica, stack, words

pytestmark = pytest.mark.timeout(90)

FAST_POLL: dict[str, Any] = {"background_poll_s": 0.05}


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(b.split(b"data: ", 1)[1]) for b in raw.strip().split(b"\n\n") if b]


def _held(gw: Gateway) -> int:
    """Requests the gateway counts in flight on its replicas (tickets, pool counters)."""
    assert gw.pool is not None
    reps = gw.pool.all()
    counted = sum(r.in_flight for r in reps)
    running = sum(gw.inflight.own(r.id)[2] + gw.inflight.own(r.id)[1] for r in reps)
    assert counted == running, (counted, running)
    return counted


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # bounded: the deadline
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _outcome(st: Stack, outcome: str) -> float:
    return _count(st.gw.metrics.background_responses, outcome=outcome)


async def test_a_background_first_turn_is_queued_polled_and_held_until_it_ends() -> None:
    async with stack(count=2, **FAST_POLL) as st:
        c = st.client()
        r = await c.responses.create(
            model=st.model, input=words(40, 1), max_output_tokens=60, background=True
        )
        assert r.status == "queued" and r.background and r.id.startswith(SEALED_PREFIX)
        assert r.output == [] and r.usage is None
        # the engine computes on: the replica's ticket is held, and watched
        assert _held(st.gw) == 1
        assert st.gw.metrics.background_watched._value.get() == 1
        seen: set[str | None] = {r.status}
        for _ in range(400):  # bounded: the SDK's own polling loop, as a client writes it
            got = await c.responses.retrieve(r.id)
            seen.add(got.status)
            if got.status not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.02)
        # vLLM stores "queued" until the run ends (never "in_progress")
        assert got.status in ("completed", "incomplete") and seen <= {"queued", got.status}
        assert got.id == r.id and got.output_text and got.usage is not None
        assert got.usage.output_tokens == 60 and got.usage.input_tokens > 0
        await _until(lambda: _held(st.gw) == 0)
        assert st.gw.metrics.background_watched._value.get() == 0
        assert _outcome(st, got.status) == 1
        # a first turn keyed and charged as any: its prompt's blocks were predicted
        r2 = await c.responses.create(
            model=st.model, input=words(40, 1), max_output_tokens=2, background=True
        )
        await _until(lambda: _held(st.gw) == 0)
        assert _outcome(st, "incomplete") + _outcome(st, "completed") == 2
        back = await c.responses.retrieve(r2.id)
        assert back.usage is not None and back.usage.input_tokens_details.cached_tokens > 0


async def test_the_watcher_alone_releases_the_ticket_and_charges_the_follow_up() -> None:
    # nobody polls through the gateway: its watcher reads the engine's status; a
    # background follow-up's prefill past its charge is taken as a follow-up's is (D30)
    async with stack(count=1, **FAST_POLL) as st, st.http() as h:
        body = {"model": st.model, "input": words(300, 1), "max_output_tokens": 2}
        first = (await h.post("/v1/responses", json=body)).json()["id"]
        debits: list[float] = []
        real = st.gw.limiter.debit_uncached

        def spy(tenant: str, tokens: float, now: float) -> None:
            debits.append(tokens)
            real(tenant, tokens, now)

        st.gw.limiter.debit_uncached = spy  # type: ignore[method-assign]
        r = await h.post(
            "/v1/responses",
            json={
                "model": st.model, "input": "x", "instructions": words(3, 50),
                "previous_response_id": first, "max_output_tokens": 8, "background": True,
            },
        )  # fmt: skip
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        assert r.json()["previous_response_id"] == first
        assert _held(st.gw) == 1 and not debits  # nothing known of its prefill yet
        await _until(lambda: _held(st.gw) == 0)
        assert _outcome(st, "completed") + _outcome(st, "incomplete") == 1
        done = (await h.get(f"/v1/responses/{r.json()['id']}")).json()
        u = done["usage"]
        computed = u["input_tokens"] - u["input_tokens_details"]["cached_tokens"]
        # the whole stored conversation again (new instructions go first): charged
        assert computed > 300 and len(debits) == 1
        assert computed - 30 < debits[0] < computed, (debits, computed)


async def test_a_running_background_response_is_cancelled_through_the_gateway() -> None:
    async with stack(count=2, **FAST_POLL) as st, st.http() as h:
        c = st.client()
        r = await c.responses.create(
            model=st.model, input=words(30, 2), max_output_tokens=2000, background=True
        )
        assert _held(st.gw) == 1
        cancelled = await c.responses.cancel(r.id)
        assert cancelled.id == r.id and cancelled.status == "cancelled"
        # the cancel's answer ends the watch at once
        assert _held(st.gw) == 0 and _outcome(st, "cancelled") == 1
        assert (await c.responses.retrieve(r.id)).status == "cancelled"
        # vLLM's answer for one no longer running, relayed (id rewritten)
        again = await h.post(f"/v1/responses/{r.id}/cancel")
        assert again.status_code == 400, again.text
        assert again.json()["error"]["message"] == "Cannot cancel a synchronous response."
        # a synchronous one: the same 400
        sync = await c.responses.create(model=st.model, input=words(10, 3), max_output_tokens=2)
        r2 = await h.post(f"/v1/responses/{sync.id}/cancel")
        assert r2.status_code == 400 and r2.json()["error"]["param"] == "response_id", r2.text
        assert not st.gw._background
        assert _count(st.gw.metrics.requests, endpoint="response_cancel", status="200") == 1


async def test_cancel_and_get_of_a_foreign_or_forged_id_are_one_404(tmp_path: Path) -> None:
    async with (
        stack(count=2, api_keys_file=keys_file(tmp_path, "ab"), **FAST_POLL) as st,
        st.http() as h,
    ):
        a = st.client(api_key="sk-a")
        mine = await a.responses.create(
            model=st.model, input=words(30, 1), max_output_tokens=500, background=True
        )
        text = mine.id[len(SEALED_PREFIX) :]
        flipped = text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:]
        bodies = set()
        for who, rid in (("sk-b", mine.id), ("sk-a", SEALED_PREFIX + flipped),
                         ("sk-a", "resp_nope")):  # fmt: skip
            auth = {"authorization": f"Bearer {who}"}
            for method, url in (
                ("POST", f"/v1/responses/{rid}/cancel"),
                ("GET", f"/v1/responses/{rid}"),
                ("GET", f"/v1/responses/{rid}?stream=true&starting_after=2"),
            ):
                r = await h.request(method, url, headers=auth)
                assert r.status_code == 404, (method, url, r.text)
                err = r.json()["error"]
                assert err["code"] == "response_not_found" and err["param"] == "response_id"
                bodies.add(err["message"].replace(rid, "<id>"))
        assert len(bodies) == 1, bodies
        # still running, still held: another tenant's cancel touched nothing
        assert _held(st.gw) == 1
        assert (await a.responses.cancel(mine.id)).status == "cancelled"
        assert _held(st.gw) == 0


async def test_a_background_stream_is_replayed_after_a_sequence_number() -> None:
    async with stack(count=2, **FAST_POLL) as st, st.http() as h:
        body = {
            "model": st.model, "input": words(30, 5), "max_output_tokens": 6,
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            raw = await resp.aread()
        events = _events(raw)
        assert events[0]["type"] == "response.created" and events[-1]["type"] in (
            "response.completed", "response.incomplete",
        )  # fmt: skip
        rid = events[0]["response"]["id"]
        assert rid.startswith(SEALED_PREFIX) and events[0]["response"]["background"]
        after = 3
        async with h.stream(
            "GET", f"/v1/responses/{rid}", params={"stream": "true", "starting_after": after}
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            tail_raw = await resp.aread()
        tail = _events(tail_raw)
        # the tail after that sequence number, as sent the first time, ids sealed
        assert [e["sequence_number"] for e in tail] == list(range(after + 1, len(events)))
        assert tail == events[after + 1 :]
        assert b'"resp_' not in tail_raw.replace(SEALED_PREFIX.encode(), b"")
        assert _held(st.gw) == 0
        # the query is checked as the engine's route reads it
        r = await h.get(f"/v1/responses/{rid}?starting_after=x")
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
        r = await h.get(f"/v1/responses/{rid}?stream=perhaps")
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        r = await h.get(f"/v1/responses/{rid}?stream=false")
        assert r.status_code == 200 and r.json()["id"] == rid


async def test_a_background_stream_whose_client_leaves_stays_held_until_it_ends() -> None:
    async with stack(count=1, **FAST_POLL) as st, st.http() as h:
        body = {
            "model": st.model, "input": words(30, 6), "max_output_tokens": 80,
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for _ in resp.aiter_bytes():
                break  # leave after the first bytes: the engine runs on
        await _until(lambda: bool(st.gw._background))
        assert _held(st.gw) == 1
        await _until(lambda: _held(st.gw) == 0)
        assert _outcome(st, "incomplete") + _outcome(st, "completed") == 1


async def test_watching_is_bounded_expires_and_stops_with_the_gateway() -> None:
    async with stack(
        count=1, background_poll_s=0.05, background_watch_max=1, background_watch_max_s=30
    ) as st:
        c = st.client()
        one = await c.responses.create(
            model=st.model, input=words(20, 7), max_output_tokens=4000, background=True
        )
        # past the cap (the tenant's share of it, at least one): refused before any work,
        # never served unwatched (H181)
        with pytest.raises(openai.RateLimitError) as err:
            await c.responses.create(
                model=st.model, input=words(20, 8), max_output_tokens=4000, background=True
            )
        assert isinstance(err.value.body, dict) and err.value.body["limit"] == "background_watch"
        assert one.status == "queued"
        assert _held(st.gw) == 1 and len(st.gw._background) == 1
        assert _outcome(st, "refused_share") == 1
        gw = st.gw
    # the gateway stopped: its watcher was cancelled and released the ticket
    assert not gw._background and _held(gw) == 0
    assert _count(gw.metrics.background_responses, outcome="shutdown") == 1
    async with stack(count=1, background_poll_s=0.05, background_watch_max_s=0.3) as st:
        c = st.client()
        await c.responses.create(
            model=st.model, input=words(20, 9), max_output_tokens=4000, background=True
        )
        await _until(lambda: _held(st.gw) == 0, 10.0)
        assert _outcome(st, "expired") == 1


async def test_background_refusals_before_any_work() -> None:
    async with stack(count=1) as st, st.http() as h:
        base = {"model": st.model, "input": words(10, 14), "max_output_tokens": 2}
        r = await h.post("/v1/responses", json={**base, "background": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
        # vLLM's own refusal: background needs store (relayed, charge given back)
        r = await h.post("/v1/responses", json={**base, "background": True, "store": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
        assert "store" in r.json()["error"]["message"]
        assert _held(st.gw) == 0 and not st.gw._background
    with pytest.raises(openai.NotFoundError):
        async with stack(count=1) as st:
            await st.client().responses.cancel(SEALED_PREFIX + "A" * 40)


async def test_cancel_meets_its_replica_out_of_service_unreachable_or_gone() -> None:
    # the retrieval's table (D30): cordoned 503 with Retry-After, unreachable 502, removed
    # the 404; a removed replica's watched response is lost, its ticket released
    async with stack(count=2, **FAST_POLL) as st, st.http() as h:
        c = st.client()
        r = await c.responses.create(
            model=st.model, input=words(30, 11), max_output_tokens=4000, background=True
        )
        home = (await h.get(f"/v1/responses/{r.id}")).headers["x-kvgate-replica"]
        idx = [st.replica_id(0), st.replica_id(1)].index(home)
        cancel = f"/v1/responses/{r.id}/cancel"
        assert (
            await h.post(f"/admin/replicas/{home}/cordon", headers=st.admin_headers())
        ).is_success
        got = await h.post(cancel)
        assert got.status_code == 503 and got.headers["retry-after"], got.text
        assert got.json()["error"]["code"] == "no_replica"
        await h.post(f"/admin/replicas/{home}/uncordon", headers=st.admin_headers())
        assert _held(st.gw) == 1
        await kill_replica(st.fleet, idx)
        got = await h.post(cancel)
        assert got.status_code in (502, 503), got.text
        assert got.json()["error"]["code"] in ("upstream_unreachable", "no_replica")
        assert st.gw.pool is not None
        st.gw.pool.remove(home)
        got = await h.post(cancel)
        assert got.status_code == 404 and got.json()["error"]["param"] == "response_id"
        await _until(lambda: not st.gw._background)
        assert _outcome(st, "lost") == 1 and _held(st.gw) == 0


async def test_a_background_post_dropped_after_its_replica_took_it_is_cancelled_there() -> None:
    # H177: replica A stores and starts the run (vLLM's goes on without the connection),
    # then the connection breaks before its "queued" answer: the gateway retries on B
    # (D32), and A's run, whose id never reached the client, is cancelled, not left to
    # run for no one beside B's
    async with stack(count=2, **FAST_POLL) as st, st.http() as h:
        assert st.gw.upstream is not None
        post = st.gw.upstream.post
        dropped: list[tuple[str, str]] = []

        async def drop_once(url: str, path: str, headers: Any, body: bytes, *a: Any) -> Any:
            resp = await post(url, path, headers, body, *a)
            if dropped or path != "/v1/responses":
                return resp
            await resp.aread()  # A answered "queued": its run goes on
            await resp.aclose()
            dropped.append((url, orjson.loads(body)["request_id"]))
            raise httpx.RemoteProtocolError("peer closed connection without a response")

        st.gw.upstream.post = drop_once  # type: ignore[method-assign,assignment]
        body = {"model": st.model, "input": words(30, 12), "max_output_tokens": 4000}
        r = await h.post("/v1/responses", json={**body, "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        ((a_url, engine_id),) = dropped
        served = r.headers["x-kvgate-replica"]
        assert next(x.url for x in st.gw.pool.all() if x.id == served) != a_url  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=a_url) as direct:
            for _ in range(250):  # bounded: A's run is cancelled, or still queued
                on_a = (await direct.get(f"/v1/responses/{engine_id}")).json()
                if on_a["status"] != "queued":
                    break
                await asyncio.sleep(0.02)
        assert on_a["status"] == "cancelled", on_a["status"]
        assert _outcome(st, "orphan_cancelled") == 1
        # B's run, the one the client holds, is watched as any
        assert _held(st.gw) == 1 and len(st.gw._background) == 1
        await h.post(f"/v1/responses/{r.json()['id']}/cancel")
        assert _held(st.gw) == 0


class _BrokenBody(UpstreamResponse):
    """An upstream answer whose body breaks off after its head."""

    __slots__ = ()

    async def aread_parts(self, cap: int | None = None) -> list[bytes]:
        # aread joins these: the relay reads through either (388d8af: aread_parts)
        await self.body.aclose()
        raise httpx.ReadError("connection reset mid-body")


async def test_a_background_answer_that_breaks_off_cancels_its_run() -> None:
    # H177: the engine stored and started the run, its "queued" answer broke off after
    # the head (a 502 to the client, who never learns the id): the run is cancelled there
    async with stack(count=1, **FAST_POLL) as st, st.http() as h:
        assert st.gw.upstream is not None
        post = st.gw.upstream.post
        sent: list[str] = []

        async def broken(url: str, path: str, headers: Any, body: bytes, *a: Any) -> Any:
            resp = await post(url, path, headers, body, *a)
            if path != "/v1/responses":
                return resp
            sent.append(orjson.loads(body)["request_id"])
            return _BrokenBody(resp.status_code, resp.headers, resp.body)

        st.gw.upstream.post = broken  # type: ignore[method-assign,assignment]
        body = {"model": st.model, "input": words(30, 13), "max_output_tokens": 4000}
        r = await h.post("/v1/responses", json={**body, "background": True})
        assert r.status_code == 502, r.text
        (engine_id,) = sent
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]
        async with httpx.AsyncClient(base_url=rep.url) as direct:
            for _ in range(250):  # bounded: cancelled, or still queued
                on_rep = (await direct.get(f"/v1/responses/{engine_id}")).json()
                if on_rep["status"] != "queued":
                    break
                await asyncio.sleep(0.02)
        assert on_rep["status"] == "cancelled", on_rep["status"]
        assert _held(st.gw) == 0 and not st.gw._background


async def test_a_replica_that_hangs_its_polls_holds_at_most_a_quarter_of_the_pool() -> None:
    # H177: the watchers' polls share the gateway's client with the health probes and
    # remote tokenization; a replica that hangs its answers held one connection per
    # watched response (up to KVGATE_BACKGROUND_WATCH_MAX, the whole pool at the
    # defaults), and every probe then waited for a connection
    async with stack(count=1, max_connections=8, **FAST_POLL) as st:
        c = st.client()
        client = st.gw.client
        assert client is not None
        stream = client.stream  # the polls read their answers through it (bounded, H193)
        now = peak = 0

        @contextlib.asynccontextmanager
        async def hung(method: str, url: Any, **kw: Any) -> AsyncIterator[Any]:
            nonlocal now, peak
            if "/v1/responses/" not in str(url):
                async with stream(method, url, **kw) as r:
                    yield r
                return
            now += 1
            peak = max(peak, now)
            try:
                await asyncio.sleep(60)  # no answer (cut by the gateway's stop)
            finally:
                now -= 1
            yield None

        client.stream = hung  # type: ignore[method-assign]
        for i in range(5):
            await c.responses.create(
                model=st.model, input=words(10, 20 + i), max_output_tokens=4000, background=True
            )
        assert len(st.gw._background) == 5
        await asyncio.sleep(0.5)  # every watcher has polled (every 0.05 s) or waits to
        assert peak == 2, peak  # 8 // 4


async def test_a_queued_answer_is_no_evidence_of_the_engines_progress() -> None:
    # H177: vLLM's API server answers a background POST "queued" before its engine core
    # computes anything; a wedged engine answers it at once. It counted as engine progress
    # (D17's stall evidence) and as a success clearing the replica's first-byte timeouts
    async with stack(count=1, **FAST_POLL) as st:
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]
        successes: list[str] = []
        record = st.gw.pool.record_success  # type: ignore[union-attr]

        def spy(replica: str) -> None:
            successes.append(replica)
            record(replica)

        st.gw.pool.record_success = spy  # type: ignore[method-assign,union-attr]
        r = await st.client().responses.create(
            model=st.model, input=words(30, 30), max_output_tokens=4000, background=True
        )
        assert r.status == "queued"
        assert st.gw.inflight.since_progress_s(rep.id, time.monotonic()) == float("inf")
        assert not successes
        await st.client().responses.cancel(r.id)  # a retrieval's answer: not one either
        assert st.gw.inflight.since_progress_s(rep.id, time.monotonic()) == float("inf")
        assert not successes and _held(st.gw) == 0


async def test_a_replayed_follow_up_names_its_previous_response_by_the_sealed_id() -> None:
    # H177: a streamed replay's events carry the response object, whose
    # previous_response_id the engine writes with its own id; the JSON retrieval reseals
    # it, the replay relayed it raw (an engine id the client never had, D30)
    async with stack(count=1, **FAST_POLL) as st, st.http() as h:
        base = {"model": st.model, "max_output_tokens": 4}
        first = (await h.post("/v1/responses", json={**base, "input": words(20, 31)})).json()
        body = {
            **base, "input": "and then", "previous_response_id": first["id"],
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            events = _events(await resp.aread())
        rid = events[0]["response"]["id"]
        assert events[0]["response"]["previous_response_id"] == first["id"]
        async with h.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as resp:
            raw = await resp.aread()
        replay = _events(raw)
        assert replay == events
        assert b'"resp_' not in raw.replace(SEALED_PREFIX.encode(), b"")
        got = (await h.get(f"/v1/responses/{rid}")).json()
        assert got["previous_response_id"] == first["id"]


async def test_the_retrieval_query_is_read_as_vllms_route_reads_it() -> None:
    # H177: vLLM's FastAPI route reads stream and starting_after with pydantic (lax): the
    # gateway's own parsing refused "3.0" and took " true" and a full-width digit
    async with stack(count=1) as st, st.http() as h:
        base = {"model": st.model, "input": words(10, 32), "max_output_tokens": 2}
        rid = (await h.post("/v1/responses", json=base)).json()["id"]
        for query, status, param in (
            ("starting_after=3.0", 200, None),
            ("starting_after=%203%20", 200, None),
            ("starting_after=%EF%BC%93", 400, "starting_after"),
            ("stream=%20true", 400, "stream"),
            ("stream=No", 200, None),
        ):
            r = await h.get(f"/v1/responses/{rid}?{query}")
            assert r.status_code == status, (query, r.text)
            if param is not None:
                assert r.json()["error"]["param"] == param, (query, r.text)


async def test_replays_that_fail_by_design_are_not_held_against_the_replica() -> None:
    # H177: vLLM's replay of a response without a streamed run fails inside its stream
    # (after the 200 head), and that of a cancelled one waits for ever; counted as the
    # replica's failures, three GETs of a tenant's own response ejected its replica
    async with stack(count=1) as st, st.http() as h:
        base = {"model": st.model, "input": words(10, 40), "max_output_tokens": 2}
        rid = (await h.post("/v1/responses", json=base)).json()["id"]
        assert st.gw.pool is not None
        (rep,) = st.gw.pool.all()
        for _ in range(2 * st.gw.pool.policy.eject_after_failures):
            r = await h.get(f"/v1/responses/{rid}?stream=true")
            assert r.status_code == 200 and b"error" in r.content, r.text
        assert rep.consecutive_failures == 0 and not rep.ejected_until
        assert (await h.post("/v1/responses", json=base)).status_code == 200


async def test_a_replay_that_waits_does_not_make_its_replica_overdue() -> None:
    # H177: a replay past the events recorded so far waits (vLLM's waits for ever once the
    # run is over); its first chunk was watched as a stream's first token (D16), so one
    # client's GET made its replica read as stalled to every tenant's routing
    async with stack(count=1, **FAST_POLL) as st, st.http() as h:
        body = {
            "model": st.model, "input": words(20, 41), "max_output_tokens": 4000,
            "background": True, "stream": True,
        }  # fmt: skip
        async with h.stream("POST", "/v1/responses", json=body) as resp:
            async for chunk in resp.aiter_bytes():
                rid = _events(chunk.split(b"\n\n", 1)[0] + b"\n\n")[0]["response"]["id"]
                break
        (rep,) = st.gw.pool.all()  # type: ignore[union-attr]

        async def replay() -> None:
            url = f"/v1/responses/{rid}?stream=true&starting_after=1000000"
            async with h.stream("GET", url) as resp:
                await resp.aread()

        waiting = asyncio.create_task(replay())
        await asyncio.sleep(0.5)  # far past its predicted first token
        assert not waiting.done()
        assert st.gw.inflight.overdue_s(rep.id, time.monotonic(), 0.0) == 0.0
        waiting.cancel()
        await st.client().responses.cancel(rid)
