"""A whole upstream answer is read up to ``KVGATE_MAX_UPSTREAM_BODY_BYTES`` (H193).

The relay read a non-streamed answer (and an error's body) whole before relaying it: a
replica, or anything answering on its port, that sent an endless or huge body grew the
gateway's memory for as long as it sent. Past the bound the client now gets a 502 (an
error's body: the error's own status, summarised), the body is read no further and its
connection closed, ``kvgate_upstream_errors{kind="body_too_large"}`` counts it, and it is
no failure of the replica's (the request chose its answer's size), as an oversized stream
event (H190, H191). Real gateway against a loopback engine on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.core import Gateway
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from gateway.upstream import _Conn
from tests.test_gateway_support import SECRET, words
from tests.test_h24_query_of_death import MODELS, read_request
from tests.test_responses_background import _held

pytestmark = pytest.mark.timeout(60)

LIMIT = 1024 * 1024
CHUNK = 64 * 1024
BIG = 32 * 1024 * 1024


def completion(size: int) -> bytes:
    """A chat completion of exactly ``size`` bytes (its content padded), spaced as no
    serialiser of ours would write it: relayed, it must come back byte for byte."""
    head = b'{ "id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [{'
    head += b'"index": 0, "message": {"role": "assistant", "content": "'
    tail = b'"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 8, '
    tail += b'"completion_tokens": 1, "total_tokens": 9} }'
    return head + b"y" * (size - len(head) - len(tail)) + tail


@contextlib.asynccontextmanager
async def engine() -> AsyncIterator[dict[str, Any]]:
    """A loopback engine whose next chat answer is ``state["mode"]``'s: ``("ok", n)`` an
    n-byte completion with its content-length; ``("chunked", status, total)`` ``total``
    bytes of status ``status`` in chunks, without a length, until sent or the gateway
    hangs up; ``("declared", n)`` a head declaring n bytes and no body byte. ``sent``: the
    body bytes written; ``closed``: the gateway hung up on a declared body."""
    state: dict[str, Any] = {"url": "", "sent": 0, "mode": ("ok", 1000), "closed": False}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(50):  # bounded: a test sends a few requests
                path, _body = await read_request(reader)
                answers = path == b"/v1/chat/completions" or path.startswith(b"/v1/responses/")
                mode: tuple[Any, ...] = state["mode"] if answers else ("models",)
                if mode[0] in ("ok", "models"):
                    answer = MODELS if mode[0] == "models" else completion(mode[1])
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                    )
                    await writer.drain()
                    state["sent"] += len(answer) if mode[0] == "ok" else 0
                elif mode[0] == "declared":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n" % mode[1]
                    )
                    await writer.drain()
                    # nothing more: the gateway must refuse it at the head and hang up
                    state["closed"] = await asyncio.wait_for(reader.read(1), 10) == b""
                    return
                else:
                    _, status, total = mode
                    writer.write(
                        b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                        b"transfer-encoding: chunked\r\n\r\n" % status
                    )
                    while state["sent"] < total:  # bounded by total
                        writer.write(b"%x\r\n%s\r\n" % (CHUNK, b"x" * CHUNK))
                        state["sent"] += CHUNK
                        await writer.drain()
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    state["url"] = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()
        await server.wait_closed()


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The body bytes the gateway's upstream connections received (this test's)."""
    read = {"bytes": 0}
    on_body = _Conn.on_body

    def counted(self: _Conn, body: bytes) -> None:
        read["bytes"] += len(body)
        on_body(self, body)

    monkeypatch.setattr(_Conn, "on_body", counted)
    return read


@contextlib.asynccontextmanager
async def gateway(url: str) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    gs = GatewaySettings(
        replicas=[url], port=free_port(), open_access=True, salt_secrets=[SecretStr(SECRET)],
        max_upstream_body_bytes=LIMIT, read_timeout_s=30.0, response_timeout_s=30.0,
    )  # fmt: skip
    gw = build_gateway(gs)
    async with serve_in_loop(gw) as gw_url, httpx.AsyncClient(base_url=gw_url, timeout=30) as h:
        yield gw, h


async def _chat(h: httpx.AsyncClient) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": words(8, 1)}],
            "max_tokens": 4}  # fmt: skip
    return await h.post("/v1/chat/completions", json=body)


def _too_large(gw: Gateway) -> float:
    value: float = gw.metrics.upstream_errors.labels(gw.specs[0].id, "body_too_large")._value.get()
    return value


def _not_ejected(gw: Gateway) -> None:
    rep = gw.pool.get(gw.specs[0].id) if gw.pool is not None else None
    assert rep is not None and rep.consecutive_failures == 0, rep


def _released(gw: Gateway) -> None:
    """The request's ticket and the tenant's concurrency slot were given back."""
    assert _held(gw) == 0
    assert gw.limiter.in_flight("anonymous") == 0


async def test_a_body_over_the_bound_is_a_502_read_no_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read = _count_reads(monkeypatch)
    async with engine() as eng, gateway(eng["url"]) as (gw, h):
        eng["mode"] = ("chunked", 200, BIG)
        r = await _chat(h)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert "KVGATE_MAX_UPSTREAM_BODY_BYTES" in err["message"]
        assert err["code"] == "upstream_error" and err["type"]
        # the gateway stopped at the bound (an upstream read or two past it): without the
        # bound it read all 32 MiB
        assert read["bytes"] <= LIMIT + 2 * 1024 * 1024, read
        assert _too_large(gw) == 1
        _not_ejected(gw)
        _released(gw)
        # the replica serves the next request, on a fresh connection
        eng["mode"], eng["sent"] = ("ok", 1000), 0
        r = await _chat(h)
        assert r.status_code == 200 and r.content == completion(1000)
        _released(gw)
    assert eng["sent"] == 1000


async def test_a_body_at_the_bound_is_relayed_byte_for_byte() -> None:
    async with engine() as eng, gateway(eng["url"]) as (gw, h):
        eng["mode"] = ("ok", LIMIT)
        r = await _chat(h)
        assert r.status_code == 200, r.text[:200]
        assert r.content == completion(LIMIT)
        assert _too_large(gw) == 0


async def test_a_declared_length_over_the_bound_is_refused_at_the_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read = _count_reads(monkeypatch)
    async with engine() as eng, gateway(eng["url"]) as (gw, h):
        eng["mode"] = ("declared", 10 * 1024**3)
        t0 = time.monotonic()
        r = await _chat(h)
        # refused at once: without the bound the gateway waited for the 10 GiB
        assert r.status_code == 502, r.text
        assert time.monotonic() - t0 < 5
        assert read["bytes"] == 0
        for _ in range(100):  # bounded: the engine sees the hang-up
            if eng["closed"]:
                break
            await asyncio.sleep(0.02)
        assert eng["closed"]
        assert _too_large(gw) == 1
        _not_ejected(gw)
        _released(gw)


@pytest.mark.parametrize(("status", "relayed"), [(400, 400), (500, 502)])
async def test_an_error_body_over_its_bound_is_summarised(
    monkeypatch: pytest.MonkeyPatch, status: int, relayed: int
) -> None:
    read = _count_reads(monkeypatch)
    async with engine() as eng, gateway(eng["url"]) as (gw, h):
        eng["mode"] = ("chunked", status, BIG)
        r = await _chat(h)
        # the engine's status stands, its body unread past the bound
        assert r.status_code == relayed, r.text
        err = orjson.loads(r.content)["error"]
        assert err["message"] == f"upstream replica returned HTTP {status}"
        assert read["bytes"] <= LIMIT + 2 * 1024 * 1024, read
        assert _too_large(gw) == 1
        rep = gw.pool.get(gw.specs[0].id) if gw.pool is not None else None
        # a 4xx is the client's; an engine's 5xx counts against it, whatever its body
        assert rep is not None and rep.consecutive_failures == (status >= 500)
        _released(gw)


async def test_a_background_poll_reads_at_most_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # the watchers' polls (and an orphan's cancel) read a stored response, the whole
    # output: through the gateway's own client, unbounded, as the relay's answers were
    read = {"bytes": 0}
    raw = httpx.Response.aiter_raw

    async def counted(self: httpx.Response, chunk_size: int | None = None) -> AsyncIterator[bytes]:
        async for chunk in raw(self, chunk_size):
            read["bytes"] += len(chunk)
            yield chunk

    monkeypatch.setattr(httpx.Response, "aiter_raw", counted)
    async with engine() as eng, gateway(eng["url"]) as (gw, _):
        eng["mode"] = ("chunked", 200, BIG)
        rep = gw.pool.get(gw.specs[0].id) if gw.pool is not None else None
        assert rep is not None
        assert await gw._replica_call(rep, False, "/v1/responses/resp_1") is None
        assert read["bytes"] <= LIMIT + 2 * 1024 * 1024, read
        assert _too_large(gw) == 1
