"""HTTP edges of a real gateway on loopback, spoken to over raw sockets: CORS on the hot
path's parser refusals (431, 400 ``invalid_http_request``) when the request's Origin was
read before the refusal; an unhandled error in a FastAPI route as an OpenAI 500 that carries
the CORS headers (it was Starlette's bare text/plain 500, outside the CORS middleware, which
a browser reports as a CORS failure); ``Expect: 100-continue`` on the admin routes; and
Chromium's Private Network Access preflight (KVGATE_CORS_ALLOW_PRIVATE_NETWORK)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from gateway.app import ExpectContinueMiddleware, InternalErrorMiddleware
from gateway.hotpath import MAX_HEADER_BYTES
from gateway.settings import GatewaySettings
from tests.test_gateway_support import Stack, stack
from tests.test_h24_cors import (
    APP,
    CHAT,
    OTHER,
    assert_allowed,
    assert_no_cors,
    exchange,
    get,
    post,
    preflight,
)
from tests.test_hotpath import port_of, read_response

pytestmark = pytest.mark.timeout(60)

BIG = "x" * (MAX_HEADER_BYTES + 1024)


def big_head(path: str, origin: str | None, method: str = "POST") -> bytes:
    """A head with Origin early (as browsers send it) and a header over the limit after it."""
    head = f"{method} {path} HTTP/1.1\r\nhost: t\r\n"
    if origin is not None:
        head += f"origin: {origin}\r\n"
    return (head + f"cookie: {BIG}\r\ncontent-length: 2\r\n\r\n{{}}").encode()


async def test_a_431_after_the_origin_carries_the_cors_headers() -> None:
    """A header over the limit after Origin (browsers send a credentialed fetch's Cookie
    after it): the page reads the 431 only with the allow headers, and its Origin, read by
    the parser before the refusal, is known. One before Origin (a huge header the page set)
    cannot be: the Origin is never parsed."""
    async with stack(count=1, cors_allowed_origins=APP) as st:
        for path in (CHAT, "/v1/models"):
            status, headers, body = await exchange(st, big_head(path, APP))
            assert status == 431, body
            assert orjson.loads(body)["error"]["code"] == "request_header_fields_too_large"
            assert_allowed(headers)
            assert headers["connection"] == "close"
        # the big header still arriving (no end of line yet): refused on the bytes received
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        try:
            writer.write(f"POST {CHAT} HTTP/1.1\r\nhost: t\r\norigin: {APP}\r\ncookie: ".encode())
            writer.write(BIG.encode())
            status, headers, _ = await read_response(reader)
            assert status == 431
            assert_allowed(headers)
        finally:
            writer.close()
        # another origin, no origin, the origin after the refused line, or an admin path:
        # nothing but the Vary a list gives
        late = big_head(CHAT, None).replace(b"\r\n\r\n", f"\r\norigin: {APP}\r\n\r\n".encode())
        for raw in (big_head(CHAT, OTHER), big_head(CHAT, None), late):
            status, headers, _ = await exchange(st, raw)
            assert status == 431
            assert_no_cors(headers)
            assert headers["vary"] == "Origin"
        for path in ("/admin/replicas", "/metrics", "/%61dmin/replicas"):
            status, headers, _ = await exchange(st, big_head(path, APP, "GET"))
            assert status == 431
            assert_no_cors(headers)
            assert "vary" not in headers


async def test_a_400_parse_refusal_after_the_origin_carries_the_cors_headers() -> None:
    async with stack(count=1, cors_allowed_origins=APP) as st:
        head = f"POST {CHAT} HTTP/1.1\r\nhost: t\r\norigin: {APP}\r\n"
        status, headers, body = await exchange(
            st, f"{head}x-a: 1\r\nbad header: 1\r\n\r\n".encode()
        )
        assert status == 400
        assert orjson.loads(body)["error"]["code"] == "invalid_http_request"
        assert_allowed(headers)
        # the line just before the bad one: httptools hands a header over when the next
        # one begins, and it never began; not known, so no allow headers (not a guess)
        status, headers, body = await exchange(st, f"{head}bad header: 1\r\n\r\n".encode())
        assert status == 400
        assert_no_cors(headers)
        # a bad chunk in a hot request's body: the request's own headers are known
        chunked = f"POST {CHAT} HTTP/1.1\r\nhost: t\r\norigin: {APP}\r\n"
        chunked += "authorization: Bearer none\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
        status, headers, body = await exchange(st, chunked.encode())
        assert status == 400, body
        assert_allowed(headers)


async def test_a_refusal_after_a_served_request_does_not_take_its_origin() -> None:
    """Garbage where the next request should begin: the previous request's Origin is not
    this one's."""
    async with stack(count=1, cors_allowed_origins=APP) as st:
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        try:
            writer.write(get("/health", APP))
            status, headers, _ = await read_response(reader)
            assert status == 200
            assert_allowed(headers)
            writer.write(b"\x01\x02 not http\r\n\r\n")
            status, headers, body = await read_response(reader)
            assert status == 400, body
            assert_no_cors(headers)
        finally:
            writer.close()


def crash_models(st: Stack) -> None:
    """Fault injection: the model list raises inside the /v1/models route."""
    assert st.gw.pool is not None

    def boom() -> list[dict[str, object]]:
        raise RuntimeError("injected fault")

    st.gw.pool.model_cards = boom  # type: ignore[method-assign]


async def test_a_crash_in_a_fastapi_route_is_an_openai_500_with_cors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with stack(count=1, cors_allowed_origins=APP) as st:
        crash_models(st)
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        try:
            writer.write(get("/v1/models", APP)[:-2] + b"x-request-id: req-crash-1\r\n\r\n")
            status, headers, body = await read_response(reader)
        finally:
            writer.close()
        assert status == 500, body
        assert headers["content-type"] == "application/json"
        err = orjson.loads(body)["error"]
        assert err["type"] == "server_error" and err["message"] == "internal gateway error"
        assert headers["x-request-id"] == "req-crash-1"
        assert_allowed(headers)
        assert "injected fault" in caplog.text  # logged with its traceback, not swallowed
        # a preflight for it is answered as before, and other routes still serve
        status, _, _ = await exchange(st, preflight("/v1/models", APP, "GET"))
        assert status == 204
        status, headers, _ = await exchange(st, get("/health", APP))
        assert status == 200


async def test_a_crash_without_cors_and_on_admin_is_an_openai_500() -> None:
    async with stack(count=1) as st:
        crash_models(st)
        status, headers, body = await exchange(st, get("/v1/models", APP))
        assert status == 500 and headers["content-type"] == "application/json"
        assert orjson.loads(body)["error"]["type"] == "server_error"
        assert_no_cors(headers)
        assert st.gw.pool is not None

        def broken() -> list[dict[str, object]]:
            raise RuntimeError("injected fault")

        st.gw.replicas_state = broken  # type: ignore[method-assign]
        key = st.admin_headers()["x-admin-key"]
        raw = get("/admin/replicas", None)[:-2] + f"x-admin-key: {key}\r\n\r\n".encode()
        status, headers, body = await exchange(st, raw)
        assert status == 500 and orjson.loads(body)["error"]["type"] == "server_error"


POLICY = b"routing: {strategy: least_loaded}\n" + b"# padding past curl's 1 KiB\n" * 60


async def test_expect_100_continue_on_an_admin_post() -> None:
    """curl sends ``Expect: 100-continue`` for a body over 1 KiB and waits for the interim
    answer (1 s) before sending it."""
    async with stack(count=1) as st:
        key = st.admin_headers()["x-admin-key"]
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
        try:
            head = "POST /admin/policy HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\n"
            head += f"x-admin-key: {key}\r\ncontent-length: {len(POLICY)}\r\n\r\n"
            writer.write(head.encode())
            status, _, _ = await read_response(reader)  # bounded: 10 s
            assert status == 100
            writer.write(POLICY)
            status, _, body = await read_response(reader)
            assert status == 200, body
            assert orjson.loads(body)["strategy"] == "least_loaded"
            # a wrong key: answered at once, the body never asked for; the answer says the
            # connection closes, and it does (uvicorn kept it, unsaid: a client sending its
            # next request instead of the body had it read as this body, and waited)
            head = head.replace(key, "wrong")
            writer.write(head.encode())
            status, headers, _ = await read_response(reader)
            assert status == 401 and headers["connection"] == "close"
            assert await asyncio.wait_for(reader.read(), 10) == b""
        finally:
            writer.close()


def pna_preflight(path: str, origin: str, method: str = "POST") -> bytes:
    raw = preflight(path, origin, method, "authorization,content-type")
    return raw[:-2] + b"access-control-request-private-network: true\r\n\r\n"


async def test_private_network_access_preflight() -> None:
    async with stack(count=1, cors_allowed_origins=APP, cors_allow_private_network=True) as st:
        for path, method in ((CHAT, "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET")):
            status, headers, _ = await exchange(st, pna_preflight(path, APP, method))
            assert status == 204
            assert headers["access-control-allow-private-network"] == "true"
            assert headers["access-control-allow-origin"] == APP
            assert "access-control-request-private-network" in headers["vary"].lower()
            # an ordinary preflight is answered as before
            status, headers, _ = await exchange(st, preflight(path, APP, method))
            assert status == 204 and "access-control-allow-private-network" not in headers
        status, headers, _ = await exchange(st, pna_preflight(CHAT, OTHER))
        assert status == 403
        assert_no_cors(headers)
        status, headers, _ = await exchange(st, post(st, CHAT, APP))
        assert status == 200 and "access-control-allow-private-network" not in headers
    async with stack(count=1, cors_allowed_origins=APP) as st:  # off: as before
        status, headers, _ = await exchange(st, pna_preflight(CHAT, APP))
        assert status == 204 and "access-control-allow-private-network" not in headers


def test_the_private_network_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_CORS_ALLOW_PRIVATE_NETWORK", "true")
    assert GatewaySettings().cors_allow_private_network is True
    monkeypatch.delenv("KVGATE_CORS_ALLOW_PRIVATE_NETWORK")
    assert GatewaySettings().cors_allow_private_network is False


async def test_a_crash_after_the_answer_began_is_left_to_the_server() -> None:
    """Direct ASGI calls (no server): an answer already begun cannot become a 500; the error
    goes on, and uvicorn cuts the connection (a cut answer must not look complete)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def streams_then_fails(scope: Any, rcv: Any, snd: Any) -> None:
        await snd({"type": "http.response.start", "status": 200, "headers": []})
        await snd({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("injected fault")

    scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
    with pytest.raises(RuntimeError, match="injected fault"):
        await InternalErrorMiddleware(streams_then_fails)(scope, receive, send)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200


async def test_expect_without_a_body_or_after_reading_it_keeps_the_connection() -> None:
    async def answers(scope: Any, rcv: Any, snd: Any) -> None:
        if scope["path"] == "/reads":
            await rcv()
        await snd({"type": "http.response.start", "status": 200, "headers": []})
        await snd({"type": "http.response.body", "body": b""})

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    for path, length, closes in (("/x", b"2", True), ("/x", b"0", False), ("/reads", b"2", False)):
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any], sent: list[dict[str, Any]] = sent) -> None:
            sent.append(message)

        headers = [(b"expect", b"100-continue"), (b"content-length", length)]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await ExpectContinueMiddleware(answers)(scope, receive, send)
        assert ((b"connection", b"close") in sent[0]["headers"]) == closes, (path, length)
