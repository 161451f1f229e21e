"""The gateway's own HTTP/1.1 handling of the completion endpoints (gateway/hotpath.py),
spoken to over raw sockets: keep-alive, pipelining, bodies in pieces, size limits,
100-continue, HTTP/1.0, mixing with the ASGI endpoints on one connection, back-pressure
on a stream the client does not read, a client leaving mid-body, and a crash inside the
handler. Every wait is bounded."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.core import Gateway
from gateway.hotpath import GatewayHttpProtocol, HotCycle
from gateway.proxy import UpstreamExchange
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(60)

Response = tuple[int, dict[str, str], bytes]


def request(
    body: bytes,
    path: str = "/v1/completions",
    extra: str = "",
    version: str = "1.1",
) -> bytes:
    head = (
        f"POST {path} HTTP/{version}\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def completion(st: Stack, prompt: str, **kw: Any) -> bytes:
    return orjson.dumps({"model": st.model, "prompt": prompt, "max_tokens": 2, **kw})


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One HTTP/1.1 response: status, headers (lower-case names), body (de-chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if status == 100:
        return status, headers, b""
    if headers.get("transfer-encoding") == "chunked":
        parts: list[bytes] = []
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 10))[:-2], 16)
            data = await asyncio.wait_for(reader.readexactly(size + 2), 10)
            if size == 0:
                return status, headers, b"".join(parts)
            parts.append(data[:-2])
    n = int(headers.get("content-length", "0"))
    return status, headers, await asyncio.wait_for(reader.readexactly(n), 10)


async def settled(gw: Gateway) -> None:
    """Wait (bounded) until the gateway has no request in flight."""
    for _ in range(200):
        if gw.in_flight == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{gw.in_flight} requests still in flight")


def port_of(st: Stack) -> int:
    return int(st.url.rsplit(":", 1)[1])


async def test_keep_alive_pipelining_and_asgi_endpoints_on_one_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served: list[str] = []
    run = HotCycle.run_asgi

    async def counted(self: HotCycle, app: Any) -> None:
        served.append(self.endpoint)
        await run(self, app)

    monkeypatch.setattr(HotCycle, "run_asgi", counted)
    async with stack(count=1) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        try:
            writer.write(request(completion(st, words(40, 1))))
            status, headers, body = await read_response(reader)
            assert status == 200 and headers["content-length"] == str(len(body))
            assert orjson.loads(body)["usage"]["prompt_tokens"] >= 40
            assert "connection" not in headers  # kept alive
            # three pipelined in one write: a completion, an ASGI endpoint, a chat
            msgs = [{"role": "user", "content": "hi"}]
            chat = orjson.dumps(
                {"model": st.model, "messages": msgs, "max_tokens": 1, "stream": True}
            )
            writer.write(
                request(completion(st, words(30, 2), max_tokens=3))
                + b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
                + request(chat, path="/v1/chat/completions")
            )
            first = await read_response(reader)
            second = await read_response(reader)
            third = await read_response(reader)
            assert first[0] == 200 and orjson.loads(first[2])["usage"]["completion_tokens"] == 3
            assert second[0] == 200 and orjson.loads(second[2])["status"] == "ok"
            assert third[0] == 200 and third[1]["content-type"].startswith("text/event-stream")
            assert third[2].rstrip().endswith(b"data: [DONE]")
            # x-request-id is echoed when valid, made up otherwise
            writer.write(request(completion(st, words(10, 3)), extra="x-request-id: abc-123\r\n"))
            assert (await read_response(reader))[1]["x-request-id"] == "abc-123"
            # the completions went through the gateway's own protocol, /health through ASGI
            assert served == ["completion", "completion", "chat", "completion"]
        finally:
            writer.close()
        await settled(st.gw)


async def test_body_in_pieces_and_100_continue() -> None:
    async with stack(count=1) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        try:
            raw = request(completion(st, words(300, 4)), extra="expect: 100-continue\r\n")
            cut = raw.index(b"\r\n\r\n") + 4
            writer.write(raw[:cut])
            status, _, _ = await read_response(reader)
            assert status == 100
            body = raw[cut:]
            for i in range(0, len(body), 97):  # the body in small, separate writes
                writer.write(body[i : i + 97])
                await writer.drain()
                await asyncio.sleep(0.002)
            status, _, answer = await read_response(reader)
            assert status == 200 and orjson.loads(answer)["usage"]["prompt_tokens"] >= 300
        finally:
            writer.close()


async def test_oversized_bodies_get_413_and_the_connection_stays_usable() -> None:
    async with stack(count=1, max_body_bytes=4_000) as st:
        # declared too large: answered at once while the client is still uploading; the
        # rest of the body is read and dropped (closing would reset the client before it
        # reads the answer), then the connection serves the next request
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        size = 200_000
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % size
        )
        answer = asyncio.ensure_future(read_response(reader))
        for _ in range(size // 10_000):
            writer.write(b"x" * 10_000)
            await writer.drain()
        status, headers, body = await answer
        assert status == 413 and "connection" not in headers and "date" in headers
        assert orjson.loads(body)["error"]["code"] == "body_too_large"
        writer.write(request(completion(st, words(10, 4))))
        assert (await read_response(reader))[0] == 200
        writer.close()
        # undeclared (chunked upload) and too large: refused once past the limit
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        big = completion(st, words(2000, 5))
        pieces = [big[i : i + 1000] for i in range(0, len(big), 1000)]
        chunks = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunks
            + b"0\r\n\r\n"
        )
        status, _, body = await read_response(reader)
        assert status == 413 and orjson.loads(body)["error"]["type"] == "invalid_request_error"
        writer.write(request(completion(st, words(10, 4))))
        assert (await read_response(reader))[0] == 200
        writer.close()
        # a small request pipelined ahead of a too-large one: each is judged by its own
        # content-length
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        writer.write(
            request(completion(st, words(10, 6)))
            + b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 50000\r\n\r\n"
        )
        assert (await read_response(reader))[0] == 200
        assert (await read_response(reader))[0] == 413
        writer.close()
        await settled(st.gw)


async def test_http_1_0_gets_its_answer_then_close() -> None:
    async with stack(count=1) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        writer.write(request(completion(st, words(20, 6)), version="1.0"))
        status, headers, body = await read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert orjson.loads(body)["object"] == "text_completion"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_a_stream_the_client_does_not_read_is_held_back_then_delivered_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    paused: list[bool] = []
    buffered: list[int] = []  # bytes the gateway holds for the client when it writes more
    made = GatewayHttpProtocol.connection_made
    writable = HotCycle._writable

    def small_buffers(self: GatewayHttpProtocol, transport: Any) -> None:
        # small socket and transport buffers, so that a few KB unread make the gateway wait
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=4096)
        made(self, transport)

    async def watched(self: HotCycle) -> bool:
        paused.append(self.proto.flow.write_paused)
        ok = await writable(self)
        buffered.append(self.transport.get_write_buffer_size())
        return ok

    monkeypatch.setattr(GatewayHttpProtocol, "connection_made", small_buffers)
    monkeypatch.setattr(HotCycle, "_writable", watched)
    async with stack(count=1) as st:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port_of(st)))
        # the reader stops reading from the socket past 2 x limit bytes unread
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        try:
            n = 1500
            writer.write(request(completion(st, words(20, 7), max_tokens=n, stream=True)))
            # the stream fills the buffers, and the gateway must wait: until it does (a busy
            # host's engine may take longer than the 1 s a fixed sleep gave it), 20 s at most
            for _ in range(400):
                if any(paused):
                    break
                await asyncio.sleep(0.05)
            assert any(paused)  # it did wait for the client
            status, _, body = await read_response(reader)
            assert status == 200
            events = [e for e in body.split(b"\n\n") if e.strip()]
            assert events[-1] == b"data: [DONE]"
            assert len(events) - 1 >= n  # one event per token, none lost
            assert max(buffered) <= 4096  # it held the stream back instead of buffering it
        finally:
            writer.close()
        await settled(st.gw)


async def test_a_client_leaving_mid_body_or_mid_stream_leaves_nothing_in_flight() -> None:
    async with stack(count=1) as st:
        url = st.fleet.urls[0]
        # mid-body: headers and half the body, then gone
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        raw = request(completion(st, words(200, 8)))
        writer.write(raw[: len(raw) - 100])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await settled(st.gw)
        # mid-stream, with a request pipelined behind the stream: the engine is told to stop
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        writer.write(
            request(completion(st, words(20, 9), max_tokens=3000, stream=True))
            + request(completion(st, words(20, 12)))
        )
        await asyncio.wait_for(reader.readuntil(b"data:"), 10)
        writer.close()
        await settled(st.gw)
        async with st.http() as h:
            for _ in range(100):  # bounded: 5 s
                if (await h.get(url + "/get_load")).json()[0]["num_reqs"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await h.get(url + "/get_load")).json()[0]["num_reqs"] == 0
            # the gateway still serves
            ok = await h.post("/v1/completions", content=completion(st, words(10, 10)))
            assert ok.status_code == 200


async def test_a_crash_in_the_handler_is_a_500_error_object(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with stack(count=1) as st:

        async def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

        monkeypatch.setattr(st.gw, "prepare", broken)
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        writer.write(request(completion(st, words(10, 11))))
        status, headers, body = await read_response(reader)
        assert status == 500 and headers["connection"] == "close"
        assert orjson.loads(body)["error"]["type"] == "server_error"
        writer.close()
        await settled(st.gw)


async def test_http_1_0_stream_is_unframed_and_ends_with_the_close() -> None:
    async with stack(count=1) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        body = completion(st, words(20, 8), stream=True, max_tokens=4)
        writer.write(request(body, version="1.0"))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ")
        lines = head.decode("latin-1").lower().split("\r\n")
        assert "connection: close" in lines and not any(
            line.startswith(("transfer-encoding", "content-length")) for line in lines
        )
        payload = await asyncio.wait_for(reader.read(), 10)  # to EOF: the close ends the body
        events = [e for e in payload.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) >= 2
        assert all(e.startswith(b"data: ") for e in events)  # no chunk-size lines
        assert orjson.loads(events[0][len(b"data: ") :])["object"] == "text_completion"
        writer.close()
        await settled(st.gw)


async def test_a_request_head_over_the_limit_gets_431_and_the_connection_closes() -> None:
    from gateway.hotpath import MAX_HEADER_BYTES

    async def refused(data: bytes, pieces: int = 1) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        step = -(-len(data) // pieces)
        for i in range(0, len(data), step):  # the client writes it all before reading
            writer.write(data[i : i + step])
            await writer.drain()
        status, headers, body = await read_response(reader)
        assert status == 431 and headers["connection"] == "close"
        err = orjson.loads(body)["error"]
        assert err["code"] == "request_header_fields_too_large"
        assert err["type"] == "invalid_request_error"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the answer
        writer.close()

    async with stack(count=1) as st:
        body = completion(st, words(10, 9))
        many = "".join(f"x-h{i}: {'v' * 100}\r\n" for i in range(MAX_HEADER_BYTES // 100))
        await refused(request(body, extra=many))  # whole in one read: the parser's count
        # one header still arriving (its end never comes): refused by the bytes received,
        # not buffered until it ends
        huge = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * MAX_HEADER_BYTES * 16
        await refused(huge, pieces=64)
        get = f"GET /v1/models HTTP/1.1\r\nhost: t\r\n{many}\r\n".encode()
        await refused(get)  # the ASGI endpoints too
        # just under the limit: served, and the connection stays for the next request
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        near = f"x-near: {'n' * (MAX_HEADER_BYTES - 1024)}\r\n"
        writer.write(request(body, extra=near) + request(body))
        assert (await read_response(reader))[0] == 200
        assert (await read_response(reader))[0] == 200
        writer.close()
        await settled(st.gw)


async def test_a_finished_exchange_is_freed_by_reference_counting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An answered request leaves no reference cycle behind: its exchange, dispatch and
    parsed body (a prompt of thousands of ids) go as soon as it is over. A cycle kept each
    request's graph until a collector pass, whose young-generation scans then walked every
    such prompt: ~7% of the gateway's CPU per request (docs/benchmarks.md)."""
    refs: list[weakref.ref[UpstreamExchange]] = []
    init = UpstreamExchange.__init__

    def tracked(self: UpstreamExchange, *args: Any) -> None:
        init(self, *args)
        refs.append(weakref.ref(self))

    monkeypatch.setattr(UpstreamExchange, "__init__", tracked)
    async with stack(count=1) as st:
        asgi = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(st.gw)), base_url="http://t"
        )
        gc.collect()
        gc.disable()  # only reference counting may free what the requests leave
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
            writer.write(request(completion(st, words(40, 21))))
            assert (await read_response(reader))[0] == 200
            writer.write(request(completion(st, words(40, 22), stream=True)))
            assert (await read_response(reader))[0] == 200
            writer.close()
            r = await asgi.post("/v1/completions", content=completion(st, words(40, 23)))
            assert r.status_code == 200
            await settled(st.gw)
            for _ in range(100):  # bounded: 1 s for the tasks to finish
                if all(ref() is None for ref in refs):
                    break
                await asyncio.sleep(0.01)
            alive = sum(ref() is not None for ref in refs)
        finally:
            gc.enable()
            await asgi.aclose()
    assert len(refs) == 3 and alive == 0, f"{alive} of {len(refs)} exchanges kept alive"
