"""Upstream failures through the real gateway, against scripted fake replicas (raw asyncio
servers that answer health and model probes and script their completion answers): what
is resent, what is counted towards ejection, what the client gets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.core import Gateway
from gateway.routing import rendezvous_weight
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import parse_policy_text

pytestmark = pytest.mark.timeout(60)

MODEL = "fake-model"
Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


def answer(status: int, body: bytes) -> bytes:
    head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (status, len(body)) + body


OK = answer(
    200,
    json.dumps(
        {
            "choices": [{"index": 0, "text": "ok"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
        }
    ).encode(),
)


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    try:
        head = await r.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    return head, await r.readexactly(n) if n else b""


class FakeReplica:
    """Answers ``GET /health`` and ``GET /v1/models``; a completion POST is recorded in
    ``posts`` and answered by ``script`` (default: a valid JSON completion)."""

    def __init__(self, script: Script | None = None) -> None:
        self.script = script
        self.posts = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            for _ in range(1000):  # bounded: a test sends a handful of requests
                req = await read_request(r)
                if req is None:
                    return
                line = req[0].split(b"\r\n", 1)[0]
                if line.startswith(b"GET /health"):
                    w.write(answer(200, b"{}"))
                elif line.startswith(b"GET /v1/models"):
                    models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                    w.write(answer(200, json.dumps(models).encode()))
                elif line.startswith(b"POST /v1/"):
                    self.posts += 1
                    if self.script is None:
                        w.write(OK)
                    else:
                        await self.script(w)
                        if w.is_closing():
                            return
                else:
                    w.write(answer(404, b"{}"))
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()


@contextlib.asynccontextmanager
async def gateway(
    replicas: list[FakeReplica], policy: str = "", **settings: Any
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    for rep in replicas:
        await rep.start()
    gs = GatewaySettings(
        replicas=[r.url for r in replicas],
        port=free_port(),
        open_access=True,
        salt_secrets=[SecretStr("s" * 32)],
        seed=7,
        **settings,
    )
    gw = build_gateway(gs, policy=parse_policy_text(policy))
    try:
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as h:
            yield gw, h
    finally:
        for rep in replicas:
            await rep.stop()


def completion(prompt: str = "hello world") -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1}


async def test_a_malformed_answer_is_a_502_and_never_resent() -> None:
    """The replica answered (badly): it had the request and may have run it, so it is not
    sent to another replica; the client gets a 502 and the replica a failure."""

    async def garbage(w: asyncio.StreamWriter) -> None:
        w.write(b"NOT HTTP AT ALL\r\n\r\n")

    bad, good = FakeReplica(garbage), FakeReplica()
    async with gateway([bad, good], "routing: {strategy: round_robin}") as (_, h):
        statuses = [
            (await h.post("/v1/completions", json=completion(f"p{i}"))).status_code
            for i in range(4)
        ]
        assert statuses.count(502) == bad.posts >= 1
        assert bad.posts + good.posts == 4  # each request ran once


async def test_a_replica_that_never_answers_is_ejected() -> None:
    async def silent(w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    hung, good = FakeReplica(silent), FakeReplica()
    policy = "routing: {strategy: round_robin}\nhealth: {eject_after_failures: 2, eject_s: 30}"
    # the timeout bounds the good replica's answers too: 1 s, so that a busy host's stall
    # is no third 504 (at 0.3 s, any of its six answers that late made one)
    async with gateway([hung, good], policy, response_timeout_s=1.0) as (gw, h):
        assert gw.pool is not None
        hung_id = next(r.id for r in gw.pool.all() if r.url == hung.url)
        statuses = []
        for i in range(8):  # bounded: two timeouts eject it, the rest go to the good one
            statuses.append((await h.post("/v1/completions", json=completion(f"q{i}"))).status_code)
        assert statuses.count(504) == 2 and statuses[-4:] == [200] * 4, statuses
        assert hung_id not in {r.id for r in gw.pool.candidates(MODEL)}


async def test_an_error_body_cut_short_is_a_502() -> None:
    async def cut(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 500 X\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{")
        await w.drain()
        w.close()

    async with gateway([FakeReplica(cut)]) as (_, h):
        r = await h.post("/v1/completions", json=completion())
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_error"


async def test_a_retry_stays_inside_the_tenants_cold_replicas() -> None:
    """A connect failure's retry is routed again: a tenant confined to k replicas for its
    cold traffic stays on them (the retry's route used to forget the confinement)."""
    reps = [FakeReplica() for _ in range(4)]
    policy = "tenants: {anonymous: {limits: {cold_replica_count: 2}}}"
    async with gateway(reps, policy) as (gw, _):
        assert gw.pool is not None
        ids = sorted(
            (r.id for r in gw.pool.all()), key=lambda rid: rendezvous_weight("anonymous", rid)
        )
        cold = set(ids[-2:])
        for i in range(20):
            body = completion(f"cold prompt {i} " * 20)
            d = await gw.prepare("completion", "anonymous", body, {}, f"r{i}", explain_only=True)
            assert d.replica in cold
            assert gw.reroute(d, d.replica)
            assert d.replica in cold, (d.replica, cold)


async def test_an_engine_that_will_not_tokenize_is_reported_at_start_up() -> None:
    """A pool tokenized by the engine whose render endpoint refuses (vLLM 0.33 without
    --enable-scale-out answers 403): said at start-up, not discovered request by request."""

    async def forbidden(w: asyncio.StreamWriter) -> None:
        w.write(answer(403, b'{"error": {"message": "render needs --enable-scale-out"}}'))

    policy = "models: {default: {tokenizer: engine_render}}"
    async with gateway([FakeReplica(forbidden)], policy) as (gw, h):
        assert any("engine_render" in p and "403" in p for p in gw.alignment_problems)
        r = await h.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 502


async def test_clients_that_give_up_do_not_clear_a_wedged_replicas_failures() -> None:
    """A client that leaves (499) says nothing of the replica: it was counted as a success,
    which reset the first-byte timeouts counted towards ejection, so a wedged engine
    stayed in with impatient and patient clients alternating."""

    async def silent(w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    hung = FakeReplica(silent)
    policy = "health: {eject_after_failures: 2, eject_s: 30}"
    async with gateway([hung], policy, response_timeout_s=0.3) as (gw, h):
        assert gw.pool is not None
        rep = gw.pool.all()[0]
        for i in range(4):  # a patient client (504), then one that gives up, twice
            if i % 2 == 0:
                r = await h.post("/v1/completions", json=completion(f"q{i}"))
                assert r.status_code == 504
            else:
                with contextlib.suppress(httpx.TimeoutException):
                    await h.post("/v1/completions", json=completion(f"q{i}"), timeout=0.1)
                await asyncio.sleep(0.1)  # the gateway sees the disconnect
        assert rep.id not in {r.id for r in gw.pool.candidates(MODEL)}  # ejected


async def test_a_long_non_streamed_answer_is_not_a_timeout() -> None:
    """A non-streamed answer's head comes after the whole generation, so it is bounded by
    ``response_timeout_s``, not by the first-byte timeout that bounds a stream's first
    chunk: a generation longer than that was a 504 to the client and a failure counted
    against a healthy replica. A stream is still held to the first-byte bound."""

    async def slow(w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.6)  # a long generation, then the whole answer
        w.write(OK)

    policy = "health: {eject_after_failures: 1, eject_s: 30}"
    settings = {"first_byte_timeout_s": 0.2, "response_timeout_s": 10.0}
    async with gateway([FakeReplica(slow)], policy, **settings) as (gw, h):
        assert gw.pool is not None
        rep = gw.pool.all()[0]
        r = await h.post("/v1/completions", json=completion("a long answer"))
        assert r.status_code == 200, r.text
        assert rep.id in {c.id for c in gw.pool.candidates(MODEL)}  # not charged a failure
        r = await h.post("/v1/completions", json={**completion("streamed"), "stream": True})
        assert r.status_code == 504
        assert rep.id not in {c.id for c in gw.pool.candidates(MODEL)}


@pytest.mark.parametrize(
    ("status", "body", "message", "param"),
    [
        # SGLang's (and vLLM's before its {"error": ...} envelope) flat error object
        (
            400,
            {
                "object": "error",
                "message": "Requested token count exceeds the model's maximum context length",
                "type": "BadRequestError",
                "param": "max_tokens",
                "code": 400,
            },
            "Requested token count exceeds the model's maximum context length",
            "max_tokens",
        ),
        # a FastAPI engine's own refusal
        (404, {"detail": "Not Found"}, "Not Found", None),
        (422, {"detail": [{"loc": ["body", "n"], "msg": "must be 1"}]}, "body.n: must be 1", None),
        # a detail list off FastAPI's shape: a 500 'internal gateway error' (TypeError), or
        # a string loc spelled out letter by letter
        (422, {"detail": [{"loc": 5, "msg": "bad n"}]}, "5: bad n", None),
        (422, {"detail": [{"loc": "body", "msg": "bad n"}]}, "body: bad n", None),
    ],
)
async def test_an_engine_error_in_another_shape_keeps_its_words(
    status: int, body: dict[str, Any], message: str, param: str | None
) -> None:
    """Review: an engine error whose body was not OpenAI's ``{"error": {...}}`` reached the
    client as "upstream replica returned HTTP 400", its message (the only hint of what to
    change in the request) dropped. It keeps the engine's status and words, in OpenAI's
    shape."""
    raw = json.dumps(body).encode()

    async def refuse(w: asyncio.StreamWriter) -> None:
        w.write(answer(status, raw))

    async with gateway([FakeReplica(refuse)]) as (_, h):
        for stream in (False, True):
            r = await h.post("/v1/completions", json={**completion(), "stream": stream})
            assert r.status_code == status
            err = r.json()["error"]
            assert err["message"] == message, err
            assert err["param"] == param
            assert isinstance(err["type"], str) and err["type"]


async def test_the_gateways_own_connection_cap_is_not_held_against_a_replica() -> None:
    """Review: a request that waited past the pool timeout for one of the gateway's own
    upstream connections (KVGATE_MAX_CONNECTIONS per replica, all busy) counted as a
    failure of the replica, so a busy fleet's healthy replicas were ejected one after the
    other; the client got a 502 "upstream replica unreachable". The replica stays in
    service and the client gets a 503 naming the gateway's limit."""
    release = asyncio.Event()

    async def slow(w: asyncio.StreamWriter) -> None:
        await asyncio.wait_for(release.wait(), 10)
        w.write(OK)

    rep = FakeReplica(slow)
    policy = "health: {eject_after_failures: 1, eject_s: 30}"
    async with gateway([rep], policy, max_connections=1, connect_timeout_s=0.3) as (gw, h):
        assert gw.pool is not None
        first = asyncio.create_task(h.post("/v1/completions", json=completion("a")))
        for _ in range(200):  # bounded: until the first request holds the one connection
            if rep.posts:
                break
            await asyncio.sleep(0.01)
        second = await h.post("/v1/completions", json=completion("b"))
        release.set()
        assert (await first).status_code == 200
        assert second.status_code == 503, second.text
        assert "KVGATE_MAX_CONNECTIONS" in second.json()["error"]["message"]
        assert [r.url for r in gw.pool.candidates(MODEL)] == [rep.url]  # not ejected


@pytest.mark.parametrize(
    "body",
    [b"<html><body>It works!</body></html>", b"[1, 2]", b"", b'{"choices": [{"text": "cut'],
)
async def test_a_200_that_is_no_json_object_is_a_502_counted_against_the_replica(
    body: bytes,
) -> None:
    """Review: a non-streamed 200 whose body is not a JSON object (a web server that is not
    the engine, on the port given; truncated JSON) reached the client
    as a 200 it could not parse, and the replica was credited with a success."""

    async def page(w: asyncio.StreamWriter) -> None:
        w.write(answer(200, body))

    policy = "health: {eject_after_failures: 2, eject_s: 30}"
    async with gateway([FakeReplica(page)], policy) as (gw, h):
        assert gw.pool is not None
        for i in range(2):
            r = await h.post("/v1/completions", json=completion(f"x{i}"))
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "upstream_error"
        assert not gw.pool.candidates(MODEL)  # two malformed answers eject it
