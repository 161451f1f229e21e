"""Review R-B of c6bc78f, e1eb266, 3baea9f and 093fec5 (Responses first-byte deadline,
background watches): what the review found, each a test that failed before its fix.

Real gateway against a loopback engine on a free port; a raw-socket client where the
client's own reading matters."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from pydantic import SecretStr

from cachecore.testing import free_port
from gateway.metrics import GatewayMetrics
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET, words
from tests.test_h24_query_of_death import MODELS, read_request

pytestmark = pytest.mark.timeout(60)

FIRST_BYTE_S = 0.5
OUTPUT_AT_S = 0.1  # the engine's first output: well inside the first-byte timeout
CLIENT_PAUSE_S = 1.5  # the client reads nothing this long: past the first-byte timeout
PAD = 16 << 20  # response.created this big: more than the loopback buffers hold


def _event(kind: str, pad: int = 0) -> bytes:
    extra = f',"pad":"{"x" * pad}"' if pad else ""
    data = f'{{"type":"{kind}","response":{{"id":"resp_x","status":"in_progress"{extra}}}}}'
    return f"event: {kind}\ndata: {data}\n\n".encode()


_COMPLETED = (
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":'
    b'"resp_x","status":"completed","usage":{"input_tokens":8,"output_tokens":1,'
    b'"input_tokens_details":{"cached_tokens":0}}}}\n\n'
)
_DELTA = (
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
    b'"delta":"hi"}\n\n'
)


@contextlib.asynccontextmanager
async def prompt_engine() -> AsyncIterator[str]:
    """A loopback engine whose Responses stream opens with a ``PAD``-byte
    ``response.created`` and ``response.in_progress``, sends its first output at
    ``OUTPUT_AT_S`` and completes ``CLIENT_PAUSE_S`` later: a healthy engine. Yields its URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def piece(data: bytes) -> None:
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        try:
            for _ in range(20):  # bounded: a test sends a few requests
                path, _body = await read_request(reader)
                if path != b"/v1/responses":
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
                piece(_event("response.created", PAD))
                await writer.drain()
                await asyncio.sleep(0.02)  # its own write: the relay blocks on the client
                piece(_event("response.in_progress"))
                await writer.drain()
                await asyncio.sleep(OUTPUT_AT_S)
                piece(_DELTA)
                await writer.drain()
                await asyncio.sleep(CLIENT_PAUSE_S)  # decoding on: the body not yet whole
                piece(_COMPLETED)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
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


async def _slow_client_post(url: str, body: bytes) -> bytes:
    """POST ``body`` to ``url``'s /v1/responses over a socket with a small receive buffer,
    read nothing for ``CLIENT_PAUSE_S``, then the whole answer (bounded by the test's
    timeout)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
    writer.write(
        b"POST /v1/responses HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await asyncio.sleep(CLIENT_PAUSE_S)
    out = bytearray()
    while chunk := await reader.read(1 << 20):
        out += chunk
    writer.close()
    return bytes(out)


async def test_output_that_arrived_in_time_is_not_cut_by_a_slow_client() -> None:
    """c6bc78f checked the Responses first-output deadline when the relay took the next
    chunk, not when it arrived: a client reading slowly (the relay blocked writing the
    opening events to it) made an engine's output that came at 0.1 s of a 0.5 s deadline
    late, and the stream was cut with the mid-stream error and counted as the replica's
    failure (ejection) - the client's slowness blamed on a healthy replica. A chat
    stream's first-byte timer runs only while the relay waits on the engine."""
    async with prompt_engine() as url:
        gs = GatewaySettings(
            replicas=[url], port=free_port(), open_access=True,
            salt_secrets=[SecretStr(SECRET)],
            first_byte_timeout_s=FIRST_BYTE_S, read_timeout_s=20.0,
        )  # fmt: skip
        gw = build_gateway(gs)
        async with serve_in_loop(gw) as gw_url:
            body = {"model": "m", "input": words(8, 1), "max_output_tokens": 4, "stream": True}
            t0 = time.monotonic()
            raw = await _slow_client_post(gw_url, orjson.dumps(body))
            assert time.monotonic() - t0 >= CLIENT_PAUSE_S
            assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
            assert b"failed mid-stream" not in raw, raw[-400:]
            assert b"response.completed" in raw and b"output_text.delta" in raw
            rid = gw.specs[0].id
            rep = gw.pool.get(rid) if gw.pool is not None else None
            assert rep is not None and rep.consecutive_failures == 0
            assert gw.metrics.upstream_errors.labels(rid, "mid_stream")._value.get() == 0


def test_the_background_outcome_metric_names_every_outcome_it_counts() -> None:
    """093fec5 counted ``stream_failed`` but the metric's help (what /metrics shows an
    operator) listed the others only."""
    src = Path("gateway/core.py").read_text()
    counted = set(re.findall(r'background_responses\.labels\("(\w+)"\)', src))
    assert "stream_failed" in counted
    help_text = GatewayMetrics().background_responses._documentation
    assert {o for o in counted if o not in help_text} == set(), help_text
