"""CORS for browser apps (gateway/cors.py) on a real gateway: preflights and answers on
both serving paths (the completion endpoints' own HTTP/1.1 code, spoken to over raw
sockets, and the FastAPI routes), for allowed and refused origins, with and without
credentials, and the start-up refusals. Before gateway/cors.py the gateway answered no
CORS at all: a preflight got 405, and no answer carried Access-Control-Allow-Origin."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from gateway.cors import CorsPolicy
from gateway.hotpath import HotCycle
from gateway.settings import GatewaySettings
from tests.test_gateway_support import Stack, stack, words
from tests.test_hotpath import port_of, read_response

pytestmark = pytest.mark.timeout(60)

APP = "https://chat.example.com"
OTHER = "https://evil.example.net"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
Answer = tuple[int, dict[str, str], bytes]


async def exchange(st: Stack, raw: bytes) -> Answer:
    """One request on its own connection, its answer read whole (bounded waits)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port_of(st))
    try:
        writer.write(raw)
        return await read_response(reader)
    finally:
        writer.close()


def post(st: Stack, path: str, origin: str | None, stream: bool = False, body: Any = None) -> bytes:
    if body is None:
        if path == CHAT:
            msgs = [{"role": "user", "content": words(12, 5)}]
            body = {"model": st.model, "messages": msgs, "max_tokens": 2, "stream": stream}
        else:
            body = {"model": st.model, "prompt": words(12, 6), "max_tokens": 2, "stream": stream}
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    head += f"authorization: Bearer none\r\ncontent-length: {len(data)}\r\n"
    if origin is not None:
        head += f"origin: {origin}\r\n"
    return (head + "\r\n").encode() + data


def get(path: str, origin: str | None) -> bytes:
    head = f"GET {path} HTTP/1.1\r\nhost: t\r\nauthorization: Bearer none\r\n"
    if origin is not None:
        head += f"origin: {origin}\r\n"
    return (head + "\r\n").encode()


def preflight(path: str, origin: str, method: str = "POST", asked: str | None = None) -> bytes:
    head = f"OPTIONS {path} HTTP/1.1\r\nhost: t\r\norigin: {origin}\r\n"
    head += f"access-control-request-method: {method}\r\n"
    if asked is not None:
        head += f"access-control-request-headers: {asked}\r\n"
    return (head + "\r\n").encode()


def assert_allowed(headers: dict[str, str], origin: str = APP, vary: bool = True) -> None:
    assert headers.get("access-control-allow-origin") == origin, headers
    exposed = {h.strip() for h in headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-kvgate-replica"} <= exposed
    assert ("origin" in headers.get("vary", "").lower()) == vary


def assert_no_cors(headers: dict[str, str]) -> None:
    assert not [h for h in headers if h.startswith("access-control-")], headers


@pytest.fixture
def hot_served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The endpoints the gateway's own HTTP/1.1 code served (not FastAPI)."""
    served: list[str] = []
    run = HotCycle.run_asgi

    async def counted(self: HotCycle, app: Any) -> None:
        served.append(self.endpoint)
        await run(self, app)

    monkeypatch.setattr(HotCycle, "run_asgi", counted)
    return served


async def test_completions_and_chats_preflight_and_answers_from_an_allowed_origin(
    hot_served: list[str],
) -> None:
    async with stack(count=1, cors_allowed_origins=f"{APP}, https://other.example") as st:
        for path in (CHAT, COMPLETIONS):
            # the preflight a browser sends before a JSON POST with an API key
            status, headers, body = await exchange(
                st, preflight(path, APP, asked="authorization,content-type,x-request-id")
            )
            assert status == 204 and body == b"", (status, body)
            assert headers["access-control-allow-origin"] == APP
            assert "POST" in headers["access-control-allow-methods"]
            assert headers["access-control-allow-headers"] == (
                "authorization, content-type, x-request-id"
            )
            assert headers["access-control-max-age"] == "600"
            assert "origin" in headers["vary"].lower()
            assert "access-control-allow-credentials" not in headers
            for stream in (False, True):
                status, headers, body = await exchange(st, post(st, path, APP, stream=stream))
                assert status == 200, body
                assert_allowed(headers)
                assert "access-control-allow-credentials" not in headers
                if stream:
                    assert headers["content-type"].startswith("text/event-stream")
                    assert body.rstrip().endswith(b"data: [DONE]")
                else:
                    assert orjson.loads(body)["usage"]["completion_tokens"] >= 1
        # the headers the OpenAI JS SDK sends from a browser pass with the defaults
        sdk = "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
        sdk += "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
        sdk += "x-stainless-runtime-version,x-stainless-timeout"
        status, headers, _ = await exchange(st, preflight(CHAT, APP, asked=sdk))
        assert status == 204 and headers["access-control-allow-headers"] == sdk.replace(",", ", ")
        # an OpenAI error answer on the hot path (400, not JSON) is readable by the page too
        status, headers, body = await exchange(st, post(st, CHAT, APP, body=b"{not json"))
        assert status == 400 and orjson.loads(body)["error"]["code"] == "invalid_json"
        assert_allowed(headers)
    assert hot_served == ["chat", "chat", "completion", "completion", "chat"]


async def test_models_and_fastapi_errors_from_an_allowed_origin() -> None:
    async with stack(count=1, cors_allowed_origins=APP) as st:
        status, headers, _ = await exchange(
            st, preflight("/v1/models", APP, "GET", "authorization")
        )
        assert status == 204 and headers["access-control-allow-origin"] == APP
        status, headers, body = await exchange(st, get("/v1/models", APP))
        assert status == 200 and orjson.loads(body)["data"][0]["id"] == st.model
        assert_allowed(headers)
        status, headers, body = await exchange(st, get("/v1/models/no-such-model", APP))
        assert status == 404 and orjson.loads(body)["error"]["code"] == "model_not_found"
        assert_allowed(headers)
        status, headers, _ = await exchange(st, get("/health", APP))
        assert status == 200
        assert_allowed(headers)
        # no Origin (curl, the SDKs): nothing added but Vary, the answer depends on Origin
        status, headers, _ = await exchange(st, get("/v1/models", None))
        assert status == 200 and "access-control-allow-origin" not in headers
        assert headers["vary"] == "Origin"


async def test_a_refused_api_key_is_readable_by_the_page(tmp_path: Path) -> None:
    """The 401 (hot path and FastAPI) carries the allow headers: the page can tell its user
    the key is wrong, not a bare "network error"."""
    keys = tmp_path / "keys.yaml"
    good = hashlib.sha256(b"sk-good").hexdigest()
    keys.write_text(f"keys:\n  - sha256: {good}\n    tenant: acme\n")
    async with stack(count=1, cors_allowed_origins=APP, api_keys_file=keys) as st:
        for raw in (post(st, CHAT, APP), post(st, COMPLETIONS, APP, stream=True)):
            status, headers, body = await exchange(st, raw)  # "Bearer none"
            assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
            assert_allowed(headers)
        status, headers, _ = await exchange(st, get("/v1/models", APP))
        assert status == 401
        assert_allowed(headers)


async def test_a_refused_origin_method_or_header_gets_no_cors() -> None:
    async with stack(count=1, cors_allowed_origins=APP) as st:
        for raw in (
            preflight(CHAT, OTHER, asked="authorization,content-type"),
            preflight(CHAT, APP, method="DELETE"),
            preflight(CHAT, APP, asked="authorization,x-not-read-by-kvgate"),
            preflight("/v1/models", "null", "GET"),
        ):
            status, headers, body = await exchange(st, raw)
            assert status == 403, (raw, status, body)
            assert orjson.loads(body)["error"]["code"] == "cors_refused"
            assert_no_cors(headers)
        # the request itself, were it sent anyway (curl, a non-browser client), is served,
        # without the header that would let a page on that origin read the answer
        for path in (CHAT, COMPLETIONS):
            status, headers, _ = await exchange(st, post(st, path, OTHER))
            assert status == 200
            assert_no_cors(headers)
            assert headers["vary"] == "Origin"
        status, headers, _ = await exchange(st, get("/v1/models", OTHER))
        assert status == 200
        assert_no_cors(headers)


async def test_admin_and_metrics_never_answer_cors() -> None:
    """They take the admin key, an operator's credential: no page may use it."""
    async with stack(count=1, cors_allowed_origins=APP, metrics_public=True) as st:
        status, headers, _ = await exchange(st, preflight("/admin/replicas", APP, "GET"))
        assert status == 405
        assert_no_cors(headers)
        key = st.admin_headers()["x-admin-key"]
        raw = get("/admin/replicas", APP)[:-2] + f"x-admin-key: {key}\r\n\r\n".encode()
        status, headers, _ = await exchange(st, raw)
        assert status == 200
        assert_no_cors(headers)
        status, headers, _ = await exchange(st, get("/metrics", APP))
        assert status == 200
        assert_no_cors(headers)


async def test_credentials_on_and_any_origin() -> None:
    async with stack(count=1, cors_allowed_origins=APP, cors_allow_credentials=True) as st:
        status, headers, _ = await exchange(st, preflight(CHAT, APP, asked="content-type"))
        assert status == 204 and headers["access-control-allow-credentials"] == "true"
        assert headers["access-control-allow-origin"] == APP  # never * with credentials
        for raw in (post(st, CHAT, APP), post(st, COMPLETIONS, APP, stream=True)):
            status, headers, _ = await exchange(st, raw)
            assert status == 200
            assert_allowed(headers)
            assert headers["access-control-allow-credentials"] == "true"
    async with stack(count=1, cors_allowed_origins="*") as st:
        status, headers, _ = await exchange(st, preflight(CHAT, OTHER, asked="authorization"))
        assert status == 204 and headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in headers
        for raw in (post(st, CHAT, OTHER, stream=True), get("/v1/models", OTHER)):
            status, headers, _ = await exchange(st, raw)
            assert status == 200
            assert_allowed(headers, "*", vary=False)  # the same answer for every origin


async def test_cors_off_by_default_answers_as_before() -> None:
    async with stack(count=1) as st:
        status, headers, _ = await exchange(st, preflight(CHAT, APP))
        assert status == 405
        assert_no_cors(headers)
        status, headers, _ = await exchange(st, post(st, CHAT, APP))
        assert status == 200
        assert_no_cors(headers)
        assert "vary" not in headers


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"KVGATE_CORS_ALLOWED_ORIGINS": "*", "KVGATE_CORS_ALLOW_CREDENTIALS": "true"},
            "CORS: allowed origins '*' with credentials (KVGATE_CORS_ALLOW_CREDENTIALS): "
            "browsers refuse Access-Control-Allow-Origin: * on a request with credentials; "
            "list the origins (KVGATE_CORS_ALLOWED_ORIGINS)",
        ),
        (
            {"KVGATE_CORS_ALLOWED_ORIGINS": "https://chat.example.com/"},
            "cors_allowed_origins (KVGATE_CORS_ALLOWED_ORIGINS): 'https://chat.example.com/' "
            "is not an origin: give scheme://host[:port], no path or trailing slash",
        ),
        (
            {"KVGATE_CORS_ALLOWED_ORIGINS": APP, "KVGATE_CORS_ALLOWED_HEADERS": "x a"},
            "cors_allowed_headers (KVGATE_CORS_ALLOWED_HEADERS): 'x a' is not an HTTP header name",
        ),
    ],
)
def test_a_bad_cors_setting_is_one_line_and_exit_2(env: dict[str, str], message: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--open", "--port", "1"]
    argv += ["--replica", "http://127.0.0.1:9"]
    out = subprocess.run(argv, env=clean | env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [f"kvgate serve: {message}"], out.stderr


def test_settings_normalise_and_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the environment gives them: comma-separated, any case."""
    monkeypatch.setenv("KVGATE_CORS_ALLOWED_ORIGINS", "HTTPS://Chat.Example.com:8443 , *")
    monkeypatch.setenv("KVGATE_CORS_ALLOWED_METHODS", "get,post")
    monkeypatch.setenv("KVGATE_CORS_ALLOWED_HEADERS", "Authorization, X-Stainless-*")
    s = GatewaySettings()
    assert s.cors_allowed_origins == ["https://chat.example.com:8443", "*"]
    assert s.cors_allowed_methods == ["GET", "POST"]
    assert s.cors_allowed_headers == ["authorization", "x-stainless-*"]
    monkeypatch.delenv("KVGATE_CORS_ALLOWED_METHODS")
    for name, bad in [
        ("ORIGINS", "null"),
        ("ORIGINS", "chat.example.com"),
        ("ORIGINS", "https://chat.example.com/app"),
        ("ORIGINS", "ftp://chat.example.com"),
        ("ORIGINS", "https://chat.example.com:99999"),
        ("HEADERS", "x-*-y"),
        ("HEADERS", "**"),
    ]:
        monkeypatch.setenv(f"KVGATE_CORS_ALLOWED_{name}", bad)
        with pytest.raises(ValidationError):
            GatewaySettings()
        monkeypatch.delenv(f"KVGATE_CORS_ALLOWED_{name}")


def test_a_custom_header_list_still_takes_content_type() -> None:
    """A browser lists Content-Type in its preflight for application/json (not a safelisted
    value): a list without it refused every JSON POST."""
    policy = CorsPolicy([APP], headers=["authorization"])
    status, headers, _ = policy.preflight(APP, "POST", "authorization,content-type")
    assert status == 204
    assert (b"access-control-allow-headers", b"authorization, content-type") in headers
    assert policy.preflight(APP, "POST", "x-stainless-os")[0] == 403
