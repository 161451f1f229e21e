"""Replicas at ``https://`` URLs: a real simulated replica served over TLS (uvicorn with a
certificate made by ``openssl`` for this test), the real gateway in front of it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from pydantic import SecretStr

from cachecore.replica.fleet import run_fleet
from cachecore.testing import free_port, serve_asgi
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from tests.test_gateway_support import FAST

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@contextlib.asynccontextmanager
async def tls_replica(cert: Path, key: Path) -> AsyncIterator[str]:
    """One simulated replica, served over TLS only; yields its https:// URL."""
    async with (
        run_fleet(FAST, count=1) as fleet,
        serve_asgi(
            fleet.fronts[0],
            ssl_certfile=str(cert),
            ssl_keyfile=str(key),
            log_config=None,
            timeout_graceful_shutdown=1,
        ) as url,
    ):
        yield url


async def test_a_replica_at_an_https_url_serves_completions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: an https:// replica was accepted, passed its health checks (httpx speaks
    TLS), and then every completion was a 500 "internal gateway error": the upstream
    transport raised UnsupportedProtocol for anything but http://."""
    cert, key = self_signed(tmp_path)
    # the CA bundle httpx (health checks) and the upstream transport both trust
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with tls_replica(cert, key) as url:
        gs = GatewaySettings(
            replicas=[url],
            port=free_port(),
            open_access=True,
            salt_secrets=[SecretStr("s" * 32)],
            seed=7,
        )
        gw = build_gateway(gs)
        async with serve_in_loop(gw) as gw_url:
            client = AsyncOpenAI(base_url=gw_url + "/v1", api_key="x", max_retries=0)
            models = await client.models.list()
            model = models.data[0].id
            raw = await client.completions.with_raw_response.create(
                model=model, prompt="hello over tls", max_tokens=3
            )
            out = raw.parse()
            assert raw.headers["x-kvgate-replica"] == "127.0.0.1-" + url.rsplit(":", 1)[1]
            assert out.usage is not None and out.usage.completion_tokens == 3
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi over tls"}],
                max_tokens=3,
                stream=True,
            )
            texts = [c.choices[0].delta.content async for c in stream if c.choices]
            assert "".join(t or "" for t in texts).strip()
            await client.close()
