"""The peer routers (vllm-router and sglang-router from PyPI, each in its own venv under
.peers/, see docs/peers.md) in front of two replicas: chat and completions, streamed and
not, and engine-reported prefix hits through them. Skipped where .peers/ does not hold the
pinned release (CI installs no peers; another release's flags were never verified)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from cachecore.kvevents import BlockStored, decode_batch
from cachecore.replica import Fleet, ReplicaSettings, run_fleet
from cachecore.testing import free_ports
from cachecore.tokenizer import builtin_tokenizer, export_builtin
from loadtest.peers import (
    BLOCK_SIZE,
    EVENTS_TOPIC,
    PEERS_DIR,
    ensure_peer,
    router_command,
    running_router,
)

MODEL = "kvgate-sim-8b"


def _peer_or_skip(kind: str) -> None:
    """Skip unless .peers/ holds ``kind``'s pinned release, as `kvgate bench routers`
    would run it (the harness's own check, without installing)."""
    st = ensure_peer(kind, PEERS_DIR, install=False)
    if not st.ok:
        pytest.skip(f"{kind}: {st.message} (see docs/peers.md)")


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
    _peer_or_skip(kind)
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


# ------------------------------------------- vllm-router kv_aware: its contract, then live


def router_local_hashes(token_ids: list[int], lora_name: str | None = None) -> list[bytes]:
    """vllm-router's per-block "local hash" (0.1.17 src/kv_index/mod.rs): sha256 of the
    adapter name then each token id as u32 little-endian, per block, unchained. kv_aware keys
    its index by these (hashed from BlockStored.token_ids) and queries with the same hash
    of the tokens the worker's render endpoint returns; engine block hashes are opaque."""
    out = []
    for i in range(0, len(token_ids), BLOCK_SIZE):
        h = hashlib.sha256(lora_name.encode() if lora_name else b"")
        for t in token_ids[i : i + BLOCK_SIZE]:
            h.update(t.to_bytes(4, "little"))
        out.append(h.digest())
    return out


def test_router_local_hash_layout() -> None:
    # token ids 1..16 then 258: u32 little-endian, one digest per 16-token block (the last
    # one partial), the adapter name first
    raw = bytes.fromhex("".join(f"{t:02x}000000" for t in range(1, 17)))
    tail = bytes.fromhex("02010000")
    ids = [*range(1, 17), 258]
    assert router_local_hashes(ids) == [hashlib.sha256(raw).digest(), hashlib.sha256(tail).digest()]
    assert router_local_hashes(ids, "lx")[0] == hashlib.sha256(b"lx" + raw).digest()


async def test_replica_events_meet_the_vllm_router_kv_aware_contract() -> None:
    """What vllm-router kv_aware needs to credit a prefix (0.1.17, src/kv_index/subscriber.rs,
    admit.rs): live frames under exactly the topic its static --kv-event-source subscribes
    with (""); full-attention GPU stores with whole blocks of the configured size and no
    adapter; parent_block_hash chaining each store to the previous one; and the stored
    token ids equal to what the replica renders for the prompt."""
    ctx = zmq.asyncio.Context()
    settings = ReplicaSettings(time_scale=0.05, events_topic=EVENTS_TOPIC)
    async with run_fleet(settings, count=1) as f:
        ep = f.endpoints[0]
        sub = ctx.socket(zmq.SUB)
        sub.connect(ep.events_endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await asyncio.sleep(0.3)  # ZMQ slow joiner
        system = builtin_tokenizer().word_vocabulary.text_from_ids(range(3, 203))
        body = {"model": MODEL, "prompt": system, "max_tokens": 2}
        async with httpx.AsyncClient(timeout=30) as http:
            rendered = (await http.post(f"{ep.url}/v1/completions/render", json=body)).json()
            (await http.post(f"{ep.url}/v1/completions", json=body)).raise_for_status()
        stores: list[BlockStored] = []
        full = len(rendered["token_ids"]) // BLOCK_SIZE
        while sum(len(s.block_hashes) for s in stores) < full:
            topic, _, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            assert topic == EVENTS_TOPIC.encode()  # exact, not a prefix
            stores += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
        sub.close(linger=0)
    ctx.term()
    parent = None
    for s in stores:
        assert s.block_size == BLOCK_SIZE and s.medium == "GPU"
        assert len(s.token_ids) == len(s.block_hashes) * BLOCK_SIZE
        assert s.lora_id is None and s.lora_name is None and s.group_idx in (None, 0)
        assert s.kv_cache_spec_kind in (None, "full_attention") and not any(s.extra_keys or [])
        assert s.parent_block_hash == parent
        parent = s.block_hashes[-1]
    stored = [t for s in stores for t in s.token_ids]
    query = router_local_hashes(rendered["token_ids"])
    assert router_local_hashes(stored) == query[:full]


def prom_counter(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_vllm_router_kv_aware_credits_the_replicas_cached_prefix(tmp_path: Path) -> None:
    _peer_or_skip("vllm-router")
    tok_dir = tmp_path / "tokenizer"
    export_builtin(tok_dir)
    port, prom = free_ports(2)
    url = f"http://127.0.0.1:{port}"
    settings = ReplicaSettings(time_scale=0.05, events_topic=EVENTS_TOPIC)
    async with run_fleet(settings, count=2) as fleet:
        cmd, env = router_command(
            "vllm-router", "kv_aware", PEERS_DIR / "vllm-router", port, prom,
            fleet.endpoints, tok_dir, MODEL,
        )  # fmt: skip
        with running_router(cmd, env, tmp_path / "router.log") as proc:
            await _wait_ready(url, proc)
            system = builtin_tokenizer().word_vocabulary.text_from_ids(range(3, 603))
            async with httpx.AsyncClient(timeout=30) as http:
                for q in ("one", "two", "three", "four"):
                    msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
                    body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
                    r = await http.post(f"{url}/v1/chat/completions", json=body)
                    r.raise_for_status()
                    await asyncio.sleep(0.3)  # the stores reach the router's index
                metrics = (await http.get(f"http://127.0.0.1:{prom}/metrics")).text
    name = "vllm_router_kv_placement_lookups"
    assert prom_counter(metrics, name + "_total", result="hit") >= 3, metrics
