"""Requests the HTTP parser refuses, on the gateway's own protocol: the client gets an
OpenAI error object, as for every other refusal."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(60)

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the gateway answers until it closes
    (bounded: 5 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read()
    finally:
        writer.close()


@pytest.mark.parametrize(
    "data",
    [
        HEAD + b"content-length: abc\r\n\r\n{}",
        HEAD + b"content-length: 2\r\ntransfer-encoding: chunked\r\n\r\n{}",
        HEAD + b"transfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # a bad chunk size
        HEAD + b"bad header: 1\r\ncontent-length: 2\r\n\r\n{}",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 with prior knowledge
    ],
)
async def test_a_request_the_parser_refuses_gets_an_openai_error(data: bytes) -> None:
    """uvicorn's own answer to a parser error was ``text/plain`` "Invalid HTTP request
    received.": the one refusal a client got in another shape than OpenAI's."""
    async with stack(count=1) as st:
        got = await exchange(st.gw.settings.port, data)
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0].startswith(b"http/1.1 400"), got
    assert b"content-type: application/json" in lines and b"connection: close" in lines
    err = orjson.loads(body)["error"]
    assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error"
