"""The peer routers (vllm-router and sglang-router from PyPI, each in its own venv under
.peers/, see docs/peers.md) in front of two replicas: chat and completions, streamed and
not, and engine-reported prefix hits through them. Skipped where .peers/ is not installed
(CI installs no peers)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from cachecore.replica import Fleet, ReplicaSettings, run_fleet
from cachecore.testing import free_ports
from cachecore.tokenizer import builtin_tokenizer, export_builtin
from loadtest.peers import PEERS_DIR, router_command, running_router

VLLM_ROUTER = PEERS_DIR / "vllm-router/bin/vllm-router"
SGLANG_PY = PEERS_DIR / "sglang-router/bin/python"
MODEL = "kvgate-sim-8b"


async def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1) as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "router exited"
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(f"{url}/readiness")).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    pytest.fail(f"router at {url} not ready")


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    async with run_fleet(ReplicaSettings(time_scale=0.05), count=2) as f:
        yield f


@pytest.mark.parametrize("kind", ["vllm-router", "sglang-router"])
async def test_peer_router_in_front_of_two_replicas(
    kind: str, fleet: Fleet, tmp_path: Path
) -> None:
    exe = VLLM_ROUTER if kind == "vllm-router" else SGLANG_PY
    if not exe.exists():
        pytest.skip(f"{kind} is not installed under .peers/ (see docs/peers.md)")
    tok_dir = tmp_path / "tokenizer"
    export_builtin(tok_dir)
    port, prom = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    # the same command line and process handling as `kvgate bench routers`
    cmd, env = router_command(
        kind, "cache_aware", PEERS_DIR / kind, port, prom, fleet.endpoints, tok_dir, MODEL
    )
    with running_router(cmd, env, tmp_path / "router.log") as proc:
        await _wait_ready(url, proc)
        async with AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            msgs: Any = [{"role": "user", "content": "say something"}]
            chat = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
            assert chat.choices[0].message.content and chat.usage is not None
            pieces = [
                c.choices[0].delta.content or ""
                async for c in await client.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=4, stream=True
                )
                if c.choices
            ]
            assert "".join(pieces) == chat.choices[0].message.content
            comp = await client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
            texts = [
                c.choices[0].text
                async for c in await client.completions.create(
                    model=MODEL, prompt="hello", max_tokens=4, stream=True
                )
                if c.choices
            ]
            assert "".join(texts) == comp.choices[0].text
            # a shared prefix routed by cache_aware gets engine-reported hits
            system = builtin_tokenizer().word_vocabulary.text_from_ids(range(3, 603))
            cached = []
            for q in ("one", "two", "three", "four"):
                turn: Any = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                r = await client.chat.completions.create(model=MODEL, max_tokens=2, messages=turn)
                assert r.usage is not None and r.usage.prompt_tokens_details is not None
                cached.append(r.usage.prompt_tokens_details.cached_tokens or 0)
            assert cached[0] == 0 and max(cached[1:]) >= 592, cached
