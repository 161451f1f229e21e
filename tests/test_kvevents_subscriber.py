"""KV events from running replicas, read by a subscriber written from the reference facts
sheet alone (pyzmq + msgpack; deliberately NOT cachecore.kvevents.decode_batch, so the
codec is checked independently), in both encodings, with a forced gap recovered through
replay, salts in block 0's extra keys, and BlockRemoved under cache pressure."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from cachecore.kvevents import BlockStored, decode_batch
from cachecore.replica import Fleet, ReplicaSettings, run_fleet
from cachecore.tokenizer import HFTokenizer, builtin_tokenizer

# ---------------------------------------------------------------- the standalone subscriber

STORED_FIELDS = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
]  # fmt: skip
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx"]


def norm_hash(h: Any) -> int:
    """Facts §1: hashes are ints, or bytes of which the last 8 are big-endian."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    assert isinstance(h, int)
    return h


def decode_event(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        ev = dict(raw)
        tag = ev.pop("type")
    else:
        tag, values = raw[0], list(raw[1:])
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, [])
        ev = dict(zip(names, values, strict=False))
    ev["type"] = tag
    if "block_hashes" in ev:
        ev["raw_hashes"] = ev["block_hashes"]
        ev["block_hashes"] = [norm_hash(h) for h in ev["block_hashes"]]
    if ev.get("parent_block_hash") is not None:
        ev["parent_block_hash"] = norm_hash(ev["parent_block_hash"])
    return ev


def decode_payload(payload: bytes) -> tuple[float, list[dict[str, Any]]]:
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(body, dict):
        ts, events = body["ts"], body["events"]
    else:
        ts, events = body[0], body[1]
    return float(ts), [decode_event(e) for e in events]


@dataclass
class Batch:
    seq: int
    ts: float
    events: list[dict[str, Any]]
    payload: bytes


class FactsSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str) -> None:
        self.ctx = ctx
        self.replay_endpoint = replay_endpoint
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.last_seq: int | None = None
        self.gaps: list[tuple[int, int]] = []

    async def recv(self, timeout_s: float = 5.0) -> Batch:
        frames = await asyncio.wait_for(self.sub.recv_multipart(), timeout_s)
        _topic, seq_raw, payload = frames
        seq = int.from_bytes(seq_raw, "big", signed=True)
        ts, events = decode_payload(payload)
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps.append((self.last_seq + 1, seq))
        self.last_seq = seq  # unlike vLLM's example subscriber, advance it
        return Batch(seq, ts, events, payload)

    async def replay(self, start_seq: int, timeout_s: float = 5.0) -> list[Batch]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[Batch] = []
        try:
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            for _ in range(100_000):  # bounded: each receive has its timeout too
                frames = await asyncio.wait_for(dealer.recv_multipart(), timeout_s)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # recent: [topic, seq, payload]
                    frames = frames[1:]
                seq_raw, payload = frames
                seq = int.from_bytes(seq_raw, "big", signed=True)
                if seq == -1:
                    assert payload == b""
                    return out
                ts, events = decode_payload(payload)
                out.append(Batch(seq, ts, events, payload))
            raise AssertionError("the replay did not end")
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[HFTokenizer]:
    yield builtin_tokenizer()


@contextlib.asynccontextmanager
async def fleet_and_subscriber(
    tokenizer: HFTokenizer, **settings: Any
) -> AsyncIterator[tuple[Fleet, FactsSubscriber, httpx.AsyncClient]]:
    s = ReplicaSettings(**{"time_scale": 0.01, **settings})
    async with run_fleet(s, count=1, tokenizer=tokenizer) as fleet:
        ep = fleet.endpoints[0]
        ctx = zmq.asyncio.Context()
        sub = FactsSubscriber(ctx, ep.events_endpoint, ep.replay_endpoint)
        async with httpx.AsyncClient(base_url=ep.url, timeout=10) as client:
            try:
                # the PUB/SUB slow joiner: probe until the subscription is live
                for i in range(100):
                    await complete(client, tokenizer, 16, seed=10_000 + i)
                    with contextlib.suppress(TimeoutError):
                        await sub.recv(0.1)
                        break
                else:
                    pytest.fail("no event reached the subscriber")
                with contextlib.suppress(TimeoutError):
                    for _ in range(10_000):  # drain the probes (bounded)
                        await sub.recv(0.1)
                sub.gaps.clear()
                yield fleet, sub, client
            finally:
                sub.close()
                ctx.term()


def words(tokenizer: HFTokenizer, n: int, seed: int) -> str:
    vocab = tokenizer.word_vocabulary
    return vocab.text_from_ids((seed * 7919 + i * 104729) % 1_000_003 for i in range(n))


async def complete(
    client: httpx.AsyncClient,
    tokenizer: HFTokenizer,
    n_tokens: int,
    seed: int,
    salt: str | None = None,
    max_tokens: int = 1,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "kvgate-sim-8b",
        "prompt": words(tokenizer, n_tokens, seed),
        "max_tokens": max_tokens,
    }
    if salt is not None:
        body["cache_salt"] = salt
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


ENCODINGS = [
    pytest.param({"event_encoding": "map", "event_hash_format": "int"}, id="map-int"),
    pytest.param(
        {"event_encoding": "array", "event_hash_format": "bytes", "legacy_replay_reply": True},
        id="array-bytes-legacy-replay",
    ),
    pytest.param({"event_encoding": "mixed", "event_hash_format": "int"}, id="mixed-int"),
]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("opts", ENCODINGS)
async def test_block_stored_with_tokens_and_salt(
    tokenizer: HFTokenizer, opts: dict[str, Any]
) -> None:
    async with fleet_and_subscriber(tokenizer, **opts) as (_, sub, client):
        salt = "kvg1:" + "ab" * 32
        await complete(client, tokenizer, 40, seed=1, salt=salt)
        batch = await sub.recv()
        (ev,) = batch.events
        assert ev["type"] == "BlockStored"
        prompt_ids = tokenizer.encode(words(tokenizer, 40, 1))
        assert ev["token_ids"] == prompt_ids[:32] and ev["block_size"] == 16
        assert ev["parent_block_hash"] is None and ev["medium"] == "GPU"
        assert len(ev["block_hashes"]) == 2
        assert list(ev["extra_keys"][0]) == [salt] and ev["extra_keys"][1] is None
        if opts["event_hash_format"] == "bytes":
            assert all(isinstance(h, bytes) and len(h) == 32 for h in ev["raw_hashes"])
        # the shared codec reads the same thing
        (codec_ev,) = decode_batch(batch.payload).events
        assert isinstance(codec_ev, BlockStored)
        assert codec_ev.block_hashes == ev["block_hashes"]
        assert codec_ev.extra_keys == [(salt,), None] and codec_ev.token_ids == ev["token_ids"]
        # the replica's block dump agrees with what the events said
        dump = (await client.get("/debug/blocks")).json()
        by_hash = {b["block_hash"]: b for b in dump["blocks"]}
        first = by_hash[ev["block_hashes"][0]]
        assert first["token_ids"] == prompt_ids[:16] and first["extra_keys"] == [salt]
        assert first["parent_block_hash"] is None and not first["in_use"]
        assert by_hash[ev["block_hashes"][1]]["parent_block_hash"] == ev["block_hashes"][0]
        # an unsalted request over the same text shares nothing: a new root block
        await complete(client, tokenizer, 40, seed=1)
        (ev2,) = (await sub.recv()).events
        assert ev2["parent_block_hash"] is None
        assert not set(ev2["block_hashes"]) & set(ev["block_hashes"])


@pytest.mark.parametrize("opts", ENCODINGS[:2])
async def test_forced_gap_is_recovered_through_replay(
    tokenizer: HFTokenizer, opts: dict[str, Any]
) -> None:
    async with fleet_and_subscriber(tokenizer, **opts) as (_, sub, client):
        await complete(client, tokenizer, 20, seed=2)
        base = (await sub.recv()).seq
        r = await client.post("/debug/drop_events", json={"n": 2})
        assert r.status_code == 200
        for seed in (3, 4, 5):
            await complete(client, tokenizer, 20 + seed, seed=seed)
        got = await sub.recv()
        assert got.seq == base + 3 and sub.gaps == [(base + 1, base + 3)]
        replayed = await sub.replay(base + 1)
        assert [b.seq for b in replayed] == [base + 1, base + 2, base + 3]
        for b, seed in zip(replayed, (3, 4, 5), strict=True):
            (ev,) = b.events
            ids = tokenizer.encode(words(tokenizer, 20 + seed, seed))
            assert ev["type"] == "BlockStored" and ev["token_ids"] == ids[:16]
        assert replayed[-1].payload == got.payload
        # a replay from before the buffer start returns what is buffered, then the end marker
        everything = await sub.replay(0)
        assert everything[0].seq == 0 and everything[-1].seq == base + 3


async def test_block_removed_under_cache_pressure(tokenizer: HFTokenizer) -> None:
    async with fleet_and_subscriber(tokenizer, num_blocks=48) as (_, sub, client):
        # the warm-up probes cached a few blocks; flush so the arithmetic below is exact
        assert (await client.post("/flush_cache")).status_code == 200
        assert (await sub.recv()).events == [{"type": "AllBlocksCleared"}]
        stored: list[list[int]] = []
        for seed in (20, 21):
            await complete(client, tokenizer, 300, seed=seed)  # 18 full blocks each
            (ev,) = (await sub.recv()).events
            stored.append(ev["block_hashes"])
        # 36 cached + 12 uncached free blocks (never used, or partial tails, which are reused
        # first); 310 tokens need 20 blocks: the 12, then 8 evictions of the first request's
        # blocks, tail first (a finished request frees its last blocks first)
        await complete(client, tokenizer, 310, seed=22)
        batch = await sub.recv()
        removed = [
            h for e in batch.events if e["type"] == "BlockRemoved" for h in e["block_hashes"]
        ]
        assert removed == list(reversed(stored[0]))[:8]
        assert batch.events[-1]["type"] == "BlockStored"  # evictions precede the new blocks
        dump = (await client.get("/debug/blocks")).json()
        assert dump["num_cached_blocks"] == 36 - 8 + 19 and not set(removed) & {
            b["block_hash"] for b in dump["blocks"]
        }


async def test_restart_resets_seq_and_hashes(tokenizer: HFTokenizer) -> None:
    async with fleet_and_subscriber(tokenizer) as (_, sub, client):
        await complete(client, tokenizer, 32, seed=30)
        before = await sub.recv()
        assert before.seq > 0
        info0 = (await client.get("/debug/blocks")).json()
        r = await client.post("/debug/restart")
        assert r.status_code == 200
        info1 = (await client.get("/debug/blocks")).json()
        assert info1["blocks"] == [] and info1["next_event_seq"] == 0
        assert info1["process_start_time"] > info0["process_start_time"]
        await complete(client, tokenizer, 32, seed=30)
        after = await sub.recv()
        assert after.seq == 0  # a lower seq: the subscriber must treat the engine as new
        # random seed per process: the same content hashes differently after the restart
        assert after.events[0]["block_hashes"] != before.events[0]["block_hashes"]
        metrics = text_string_to_metric_families((await client.get("/metrics")).text)
        (start,) = [m.samples[0].value for m in metrics if m.name == "process_start_time_seconds"]
        assert start == pytest.approx(info1["process_start_time"])


async def test_flush_during_a_step_is_ordered_after_that_steps_events(
    tokenizer: HFTokenizer,
) -> None:
    """vLLM resets the prefix cache between steps: a flush that arrives while the last
    request's step runs waits for it, so its BlockStored comes before AllBlocksCleared."""
    async with fleet_and_subscriber(tokenizer, time_scale=1.0) as (fleet, sub, client):
        core = fleet.replicas[0].core
        done = core.stats().num_finished
        task = asyncio.create_task(complete(client, tokenizer, 400, seed=40))  # ~130 ms step
        for _ in range(500):
            if core.stats().num_finished > done:
                break  # stepped: blocks already free, the step's time not yet elapsed
            await asyncio.sleep(0.002)
        r = await client.post("/flush_cache")
        assert r.status_code == 200
        await task
        first, second = await sub.recv(), await sub.recv()
        assert [e["type"] for e in first.events] == ["BlockStored"]
        assert second.events == [{"type": "AllBlocksCleared"}] and second.seq == first.seq + 1
        assert (await client.get("/debug/blocks")).json()["blocks"] == []
