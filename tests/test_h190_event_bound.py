"""An upstream SSE event is buffered up to ``KVGATE_MAX_UPSTREAM_EVENT_BYTES`` (H190).

The relay buffers a stream's bytes until an event's blank line. A replica (or a proxy in
front of it) that sends an event without one grew the gateway's memory without limit, for
each such stream: measured, a 50 MB event with no blank line was read and held whole, then
relayed to the client as the stream's tail. Past the bound the stream now ends with the
gateway's mid-stream error event, read no further (the upstream connection is closed),
counted in ``kvgate_upstream_errors{kind="event_too_large"}`` and held against the replica.
Real gateway against a loopback engine on a free port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.proxy import _event_end
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from gateway.upstream import UpstreamResponse
from tests.test_gateway_support import SECRET, words
from tests.test_h24_query_of_death import MODELS, read_request

pytestmark = pytest.mark.timeout(60)

LIMIT = 1024 * 1024
CHUNK = 64 * 1024
_ROLE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m","choices":'
    b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
)


def _chunk_event(content: bytes) -> bytes:
    return (
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","model":"m","choices":'
        b'[{"index":0,"delta":{"content":"' + content + b'"},"finish_reason":null}]}\n\n'
    )


@contextlib.asynccontextmanager
async def streaming_engine(body: bytes, total: int = 0) -> AsyncIterator[dict[str, Any]]:
    """A loopback engine that answers a chat completion with a chunked SSE stream: the role
    chunk, ``body`` in ``CHUNK``-byte pieces, then (``total`` > 0) ``x`` bytes without a
    blank line until ``total`` bytes were written or the gateway closed the connection,
    then ``data: [DONE]``. Yields its URL and the bytes it wrote (``sent``)."""
    state: dict[str, Any] = {"url": "", "sent": 0}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def piece(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            state["sent"] += len(data)

        try:
            for _ in range(50):  # bounded: a test sends a few requests
                path, _body = await read_request(reader)
                if path != b"/v1/chat/completions":
                    answer = MODELS if path == b"/v1/models" else b"{}"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                    )
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                piece(_ROLE)
                for at in range(0, len(body), CHUNK):
                    piece(body[at : at + CHUNK])
                    await writer.drain()
                if total:
                    piece(b"data: {")
                    while state["sent"] < total:
                        piece(b"x" * CHUNK)
                        await writer.drain()
                piece(b"data: [DONE]\n\n")
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
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
    """The bytes the relay read from upstream answers (all of them, this test's)."""
    read = {"bytes": 0}
    raw = UpstreamResponse.aiter_raw

    async def counted(self: UpstreamResponse) -> AsyncIterator[bytes]:
        async for chunk in raw(self):
            read["bytes"] += len(chunk)
            yield chunk

    monkeypatch.setattr(UpstreamResponse, "aiter_raw", counted)
    return read


async def _chat(url: str, **settings: Any) -> tuple[bytes, Any]:
    gs = GatewaySettings(
        replicas=[url], port=free_port(), open_access=True,
        salt_secrets=[SecretStr(SECRET)], **settings,
    )  # fmt: skip
    gw = build_gateway(gs)
    body = {"model": "m", "messages": [{"role": "user", "content": words(8, 1)}],
            "max_tokens": 4, "stream": True}  # fmt: skip
    async with serve_in_loop(gw) as gw_url, httpx.AsyncClient(base_url=gw_url, timeout=30) as h:
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.content, gw


async def test_an_event_without_end_is_cut_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    read = _count_reads(monkeypatch)
    async with streaming_engine(b"", total=32 * 1024 * 1024) as eng:
        content, gw = await _chat(eng["url"], max_upstream_event_bytes=LIMIT)
    # the relay stopped reading at the bound (one upstream read past it at most): without
    # the bound it read all 32 MiB and relayed them
    assert read["bytes"] <= LIMIT + 2 * 1024 * 1024, read
    assert eng["sent"] < 32 * 1024 * 1024
    assert len(content) < 4096, len(content)
    assert content.startswith(_ROLE)
    events = content.split(b"\n\n")
    err = orjson.loads(events[1].removeprefix(b"data: "))
    assert err["error"]["message"] == "upstream replica failed mid-stream"
    assert events[2] == b"data: [DONE]"
    rid = gw.specs[0].id
    assert gw.metrics.upstream_errors.labels(rid, "event_too_large")._value.get() == 1
    # no failure of the replica's (H191): a healthy vLLM's logprobs-heavy Responses stream
    # reaches the bound, so a tenant asking for such streams would eject healthy replicas
    rep = gw.pool.get(rid) if gw.pool is not None else None
    assert rep is not None and rep.consecutive_failures == 0, rep


async def test_an_event_just_under_the_bound_passes_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read = _count_reads(monkeypatch)
    # one event of LIMIT - 1 bytes, its blank line included, in CHUNK-byte pieces
    event = _chunk_event(b"y" * (LIMIT - 1 - len(_chunk_event(b""))))
    assert len(event) == LIMIT - 1
    async with streaming_engine(event) as eng:
        content, gw = await _chat(eng["url"], max_upstream_event_bytes=LIMIT)
    assert content == _ROLE + event + b"data: [DONE]\n\n"
    assert read["bytes"] == eng["sent"]
    rid = gw.specs[0].id
    assert gw.metrics.upstream_errors.labels(rid, "event_too_large")._value.get() == 0
    assert gw.metrics.upstream_errors.labels(rid, "mid_stream")._value.get() == 0


def test_a_blank_line_split_across_chunks_ends_its_event() -> None:
    """The relay looks for an event's end in each new chunk and the 3 bytes before it
    only (the pending bytes hold none: they were cut at their last one): a blank line
    split anywhere across the two is found as in the whole."""
    for tail in (b"data: c\n\ndata: d", b"data: c\r\n\r\ndata: d", b"data: c\r\n\r\n"):
        whole = b"data: abc" + tail
        for split in range(len(whole) + 1):
            pending, chunk = whole[:split], whole[split:]
            if _event_end(pending) >= 0:
                continue
            assert _event_end(pending + chunk, len(pending) - 3) == _event_end(whole), split
