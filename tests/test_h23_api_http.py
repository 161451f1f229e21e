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


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 response: status, headers (lower-case names), body (length-delimited
    or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(b":", 1) for ln in lines[1:])}
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        for _ in range(100_000):  # bounded: a chunk per event
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
        return status, headers, body
    return status, headers, await reader.readexactly(int(headers.get(b"content-length", b"0")))


UPGRADE = (
    b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
    b"http2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
async def test_an_h2c_upgrade_offer_is_ignored_and_the_body_served(
    chunked: bool, split: bool
) -> None:
    """``Upgrade: h2c`` on a POST (curl --http2, Java's HttpClient and RestClient, Ktor):
    the parser took the request for bodiless, uvicorn logged "Unsupported upgrade
    request." and the completion went on with an empty body, a 400 "request body is not
    valid JSON" for a valid request; the connection's parser was left stuck in the
    upgrade. The offer is ignored (RFC 9110 s7.8): the request is answered with its body,
    a stream as a stream, and the connection serves the requests after it, an ordinary
    one and another offer, pipelined."""
    async with stack(count=1) as st:
        chat = {"model": st.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        payloads = [orjson.dumps(chat), orjson.dumps({**chat, "stream": True})]
        reader, writer = await asyncio.open_connection("127.0.0.1", st.gw.settings.port)
        try:
            for payload in payloads:
                if chunked:
                    framing = b"transfer-encoding: chunked\r\n\r\n"
                    body = b"%x\r\n%b\r\n0\r\n\r\n" % (len(payload), payload)
                else:
                    framing, body = b"content-length: %d\r\n\r\n" % len(payload), payload
                writer.write(HEAD + UPGRADE + framing)
                if split:  # the head alone first, as Ktor writes it
                    await writer.drain()
                    await asyncio.sleep(0.05)
                writer.write(body)
            # pipelined behind them: a GET with the offer (ASGI), then an ordinary POST
            writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + UPGRADE + b"\r\n")
            writer.write(HEAD + b"content-length: %d\r\n\r\n%b" % (len(payloads[0]), payloads[0]))
            await writer.drain()
            async with asyncio.timeout(20):
                answers = [await read_response(reader) for _ in range(4)]
        finally:
            writer.close()
    (s1, _, b1), (s2, h2, b2), (s3, _, b3), (s4, _, b4) = answers
    assert s1 == 200 and orjson.loads(b1)["object"] == "chat.completion", b1
    assert s2 == 200 and h2[b"content-type"].startswith(b"text/event-stream"), b2
    assert b2.rstrip().endswith(b"data: [DONE]")
    assert s3 == 200 and orjson.loads(b3)["object"] == "list", b3
    assert s4 == 200 and orjson.loads(b4)["object"] == "chat.completion", b4


@pytest.mark.timeout(30)
@pytest.mark.parametrize("target", [b"/health", b"/v1/chat/completions"])
async def test_a_connect_request_is_no_upgrade_offer_to_ignore(target: bytes) -> None:
    """CONNECT is an upgrade to the parser with no Upgrade header to strip: taken for an
    h2c offer (c2509ee), its head went to a new parser that raised the upgrade again, for
    ever, and the gateway's event loop spun in that loop. It is refused as uvicorn refuses
    it, and the gateway goes on serving."""
    async with stack(count=1) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.gw.settings.port)
        try:
            writer.write(b"CONNECT %b HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" % target)
            async with asyncio.timeout(5):
                status, _, _ = await read_response(reader)
        finally:
            writer.close()
        assert status == 405
        async with st.http() as h:
            assert (await h.get("/health")).status_code == 200


async def test_an_answer_before_an_expected_body_closes_the_connection() -> None:
    """``Expect: 100-continue`` with a body over the limit was answered 413 without the
    100, so the client never sent its body, yet the connection stayed open with the parser
    waiting for that body: the client's next request on it was read as the old body and
    got no answer. The answer now says ``connection: close`` and the connection closes."""
    async with stack(count=1, max_body_bytes=1000) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", st.gw.settings.port)
        try:
            writer.write(HEAD + b"expect: 100-continue\r\ncontent-length: 5000\r\n\r\n")
            async with asyncio.timeout(5):
                status, headers, _ = await read_response(reader)
                assert status == 413 and headers.get(b"connection") == b"close", headers
                assert await reader.read() == b""  # closed by the gateway
        finally:
            writer.close()
