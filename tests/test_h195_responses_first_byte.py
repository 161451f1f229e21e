"""A Responses stream's first-byte timeout runs until its first output event (H195).

vLLM 0.33's ``responses_stream_generator`` sends ``response.created`` and
``response.in_progress`` before the prefill (D30), and the upstream reader ended the
first-byte timeout at the first bytes: a wedged engine that had answered those two was
caught only by ``KVGATE_READ_TIMEOUT_S``, and never while something (a proxy's keepalive
comment) kept the connection busy. Now its deadline is the first output event's (the
TTFT's test, ``_output``), keepalives and opening events not extending it; it ends as a
chat stream's does: the mid-stream error event, counted against the replica. Also:
``_output`` and the relay's event reading ignore SSE comment lines wherever they stand.
Real gateway against a loopback engine on a free port, and against the simulated replica."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from pydantic import SecretStr

from cachecore.replica.settings import ReplicaSettings
from cachecore.testing import free_port
from gateway.proxy import Usage, _event_end, _output, filter_events
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET, stack, words
from tests.test_h24_query_of_death import MODELS, read_request

pytestmark = pytest.mark.timeout(60)

FIRST_BYTE_S = 0.5
READ_S = 20.0  # far above: a stream cut near FIRST_BYTE_S was cut by the first-byte bound
WEDGED_S = 8.0  # how long the wedged engine keeps its connection open (bounded)


def _event(kind: str, extra: str = "") -> bytes:
    data = f'{{"type":"{kind}","response":{{"id":"resp_x","status":"in_progress"}}{extra}}}'
    return f"event: {kind}\ndata: {data}\n\n".encode()


@contextlib.asynccontextmanager
async def wedged_engine(keepalive_s: float | None) -> AsyncIterator[str]:
    """A loopback engine that answers a Responses stream with ``response.created`` and
    ``response.in_progress``, then (``keepalive_s``) a keepalive comment that often, or
    nothing, for ``WEDGED_S`` or until the gateway closes the connection; a chat stream with
    its head and nothing more for as long. Yields its URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def piece(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        try:
            for _ in range(20):  # bounded: a test sends a few requests
                path, _body = await read_request(reader)
                if path not in (b"/v1/responses", b"/v1/chat/completions"):
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
                if path == b"/v1/responses":
                    piece(_event("response.created") + _event("response.in_progress"))
                await writer.drain()
                end = time.monotonic() + WEDGED_S
                while time.monotonic() < end:
                    try:
                        async with asyncio.timeout(keepalive_s or 0.05):
                            if not await reader.read(1):
                                break  # the gateway closed the connection
                    except TimeoutError:
                        pass
                    if keepalive_s is not None and path == b"/v1/responses":
                        piece(b": keepalive\n\n")
                        await writer.drain()
                return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def _cut(path: str, body: dict[str, Any], keepalive_s: float | None) -> dict[str, Any]:
    """One stream through a real gateway to a wedged engine: its content, how long it took,
    the replica's failure count and its mid-stream error count."""
    async with wedged_engine(keepalive_s) as url:
        gs = GatewaySettings(
            replicas=[url], port=free_port(), open_access=True,
            salt_secrets=[SecretStr(SECRET)],
            first_byte_timeout_s=FIRST_BYTE_S, read_timeout_s=READ_S,
        )  # fmt: skip
        gw = build_gateway(gs)
        async with serve_in_loop(gw) as gw_url, httpx.AsyncClient(base_url=gw_url, timeout=30) as h:
            t0 = time.monotonic()
            r = await h.post(path, json=body)
            took = time.monotonic() - t0
            assert r.status_code == 200, r.text
            rid = gw.specs[0].id
            for _ in range(100):  # finish runs after the last write, which the client read
                rep = gw.pool.get(rid) if gw.pool is not None else None
                if rep is not None and rep.consecutive_failures:
                    break
                await asyncio.sleep(0.01)
            assert rep is not None
            return {
                "content": r.content,
                "took": took,
                "failures": rep.consecutive_failures,
                "mid_stream": gw.metrics.upstream_errors.labels(rid, "mid_stream")._value.get(),
            }


def _error_tail(content: bytes) -> None:
    events = [e for e in content.split(b"\n\n") if e]
    err = orjson.loads(events[-2].removeprefix(b"data: "))
    assert err["error"]["message"] == "upstream replica failed mid-stream", content
    assert events[-1] == b"data: [DONE]"


@pytest.mark.parametrize("keepalive_s", [None, 0.05])
async def test_a_wedged_responses_stream_ends_at_its_first_byte_timeout(
    keepalive_s: float | None,
) -> None:
    body = {"model": "m", "input": words(8, 1), "max_output_tokens": 4, "stream": True}
    got = await _cut("/v1/responses", body, keepalive_s)
    # the first-byte bound, not the read bound nor the engine's own end (WEDGED_S, before
    # the read bound): without the fix the stream lasted until the engine closed it, 8 s
    assert FIRST_BYTE_S * 0.9 < got["took"] < FIRST_BYTE_S + 1.5, got
    content = got["content"]
    assert content.startswith(_event("response.created") + _event("response.in_progress"))
    _error_tail(content)
    # counted as a chat stream's first-byte timeout is: a failure of the replica's
    assert got["failures"] == 1 and got["mid_stream"] == 1, got
    chat = {"model": "m", "messages": [{"role": "user", "content": words(8, 2)}],
            "max_tokens": 4, "stream": True}  # fmt: skip
    chat_got = await _cut("/v1/chat/completions", chat, None)
    assert FIRST_BYTE_S * 0.9 < chat_got["took"] < FIRST_BYTE_S + 1.5, chat_got
    _error_tail(chat_got["content"])
    assert (chat_got["failures"], chat_got["mid_stream"]) == (got["failures"], got["mid_stream"])


async def test_a_normal_responses_stream_outlasts_the_first_byte_timeout() -> None:
    """Against the simulated replica (its opening events before the prefill, as vLLM's):
    the deadline ends at the first output event, so a stream whose decode lasts past it
    completes."""
    async with (
        stack(count=1, replica=ReplicaSettings(time_scale=1.0), first_byte_timeout_s=1.0) as st,
        st.http() as h,
    ):
        body = {"model": st.model, "input": words(200, 3), "max_output_tokens": 150,
                "stream": True}  # fmt: skip
        t0 = time.monotonic()
        r = await h.post("/v1/responses", json=body)
        took = time.monotonic() - t0
        assert r.status_code == 200
        assert took > 1.2, (took, r.content[-600:])  # longer than the first-byte timeout
        assert b"response.completed" in r.content, r.content[-600:]
        assert b"failed mid-stream" not in r.content
        rep = st.gw.pool.get(st.replica_id(0)) if st.gw.pool is not None else None
        assert rep is not None and rep.consecutive_failures == 0


_OUT = (
    b': keepalive\nevent: response.output_item.added\ndata: {"type":'
    b'"response.output_item.added","item":{"type":"message"}}\n\n'
)


def test_a_comment_line_before_an_events_type_is_ignored() -> None:
    """SSE comment lines are ignored wherever they stand (a proxy's keepalive may lead an
    event's block): the output event is still one; before, _output skipped it."""
    assert _output(_OUT)
    assert _output(_OUT.replace(b"event: response.output_item.added\n", b""))  # data only
    assert _output(_OUT.replace(b"\n\n", b"\n: another\n\n"))  # a trailing comment
    assert not _output(b": keepalive\n\n" + _event("response.in_progress"))
    # the relay reads [DONE] and usage past a comment line too
    usage = Usage()
    tail = b': ka\ndata: {"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    _, done = filter_events(tail + b": ka\ndata: [DONE]\n\n", usage, True)
    assert done and usage.prompt == 3


def test_the_first_output_is_found_wherever_the_stream_is_split() -> None:
    """The relay's cut (``_event_end``) and test (``_output``) over random splits of a
    stream whose first output event is led by a comment: found at that event, never
    before it (bounded: 2,000 seeded splittings)."""
    head = b": hi\n\n" + _event("response.created") + _event("response.in_progress")
    stream = head + b": keepalive\n\n" + _OUT + _event("response.completed")
    first_at = len(head) + len(b": keepalive\n\n") + len(_OUT)
    rng = random.Random(195)
    for _ in range(2000):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(1, 12)))
        buf, read, found = bytearray(), 0, None
        for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            start = len(buf) - 3
            buf += stream[a:b]
            read = b
            cut = _event_end(buf, start)
            if cut < 0:
                continue
            ready = bytes(buf[:cut])
            del buf[:cut]
            if _output(ready):
                found = read - len(buf)
                break
        assert found is not None and found >= first_at, (cuts, found)
