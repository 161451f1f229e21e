"""The cache agent against a vLLM-format event source it drives byte for byte: decoding,
ordering, replay, clears, restarts, reachability, load, registration, trace."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from cachecore.agent.frames import parse_live, parse_replay
from cachecore.agent.scrape import parse_metrics
from cachecore.agent.testing import EngineStub
from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.kvevents import (
    END_SEQ_BYTES,
    AllBlocksCleared,
    BlockStored,
    Encoding,
    MalformedEventError,
    seq_to_bytes,
)
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.loadstate import MemoryLoadStore
from cachecore.registry import MemoryRegistry
from cachecore.traceanalysis import analyze_events, read_jsonl
from tests.test_agent_helpers import BS, MODEL, Rig, batch, counter_total, salt, until


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex())
    yield r
    await r.close()


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


# ------------------------------------------------------------------------ pure pieces


def test_frames_live_reasons() -> None:
    ok = parse_live([b"kv-events", seq_to_bytes(5), b"x"], b"kv-events", 10)
    assert (ok.seq, ok.payload) == (5, b"x")
    assert parse_live([b"any-topic", seq_to_bytes(5), b"x"], b"", 10).seq == 5
    cases = [
        ([b"kv-events", seq_to_bytes(1)], "bad_frames"),
        ([b"kv-events", seq_to_bytes(1), b"x", b"y"], "bad_frames"),
        ([b"kv-events-other", seq_to_bytes(1), b"x"], "bad_topic"),
        ([b"kv-events", b"\x00" * 7, b"x"], "bad_seq"),
        ([b"kv-events", seq_to_bytes(-3), b"x"], "bad_seq"),
        ([b"kv-events", seq_to_bytes(1), b"x" * 11], "oversized"),
    ]
    for frames, reason in cases:
        with pytest.raises(MalformedEventError) as info:
            parse_live(frames, b"kv-events", 10)
        assert info.value.reason == reason


def test_frames_replay_both_shapes_and_end_marker() -> None:
    assert parse_replay([b"", b"t", seq_to_bytes(3), b"p"], 10).seq == 3
    assert parse_replay([b"", seq_to_bytes(3), b"p"], 10).payload == b"p"
    assert parse_replay([b"", END_SEQ_BYTES, b""], 10).seq == -1
    assert parse_replay([b"", b"t", END_SEQ_BYTES, b""], 10).seq == -1
    with pytest.raises(MalformedEventError):
        parse_replay([b"x", seq_to_bytes(3), b"p"], 10)
    with pytest.raises(MalformedEventError):
        parse_replay([b"", seq_to_bytes(3)], 10)


def test_parse_metrics_reads_vllm_names() -> None:
    stub = EngineStub(block_size=32, num_gpu_blocks=777)
    stub.running, stub.waiting, stub.kv_usage = 3, 4, 0.25
    snap = parse_metrics(stub.metrics_text())
    stub._sock.close()
    assert (snap.running, snap.waiting, snap.kv_usage) == (3, 4, 0.25)
    assert (snap.block_size, snap.num_gpu_blocks) == (32, 777)
    assert snap.start_time == pytest.approx(stub.start_time)
    assert snap.model_name == "stub-model"


# ------------------------------------------------------------------------ event flow


@pytest.mark.parametrize("encoding", [Encoding.MAP, Encoding.ARRAY, Encoding.MIXED])
async def test_stores_and_removes_in_every_encoding(rig: Rig, encoding: Encoding) -> None:
    await rig.start()
    eng = rig.engine
    ev_a, ha = eng.store(toks(0, 3), tenant="a", hash_bytes=True)
    ev_b, hb = eng.store(toks(100, 2), tenant=None, parent=ha[-1])
    ev_lora, _ = eng.store(toks(0, 2), tenant="b", lora="adapter-1")
    await rig.publish(ev_a, ev_b, encoding=encoding)
    await rig.publish(ev_lora, encoding=encoding)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    assert len(eng.keys()) == 7
    await rig.publish(eng.remove(hb[-1:]), encoding=encoding)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    assert rig.agent is not None
    for sync in rig.agent.syncs.values():
        await sync.check_invariants()


async def test_same_tokens_different_salt_are_different_keys(rig: Rig) -> None:
    await rig.start()
    ev_a, _ = rig.engine.store(toks(0, 2), tenant="a")
    ev_b, _ = rig.engine.store(toks(0, 2), tenant="b")
    await rig.publish(ev_a, ev_b)
    await rig.settle()
    keys = await rig.index_keys()
    assert len(keys) == 4 and keys == rig.engine.keys()


async def test_unscoped_and_ephemeral_blocks_are_not_indexed(rig: Rig) -> None:
    await rig.start()
    eph = "kvg1:e:" + "0" * 64
    ev = BlockStored([1, 2], None, toks(0, 2), BS, extra_keys=[(eph,), None])
    ev_plain = BlockStored([3], None, toks(50, 1), BS)
    ev_child = BlockStored([4], 1, toks(60, 1), BS)  # inherits the ephemeral parent's fate
    await rig.publish(ev, ev_plain, ev_child)
    await rig.settle()
    assert await rig.index_keys() == set()
    assert rig.agent is not None
    exp = rig.agent.metrics.exposition().decode()
    assert 'reason="ephemeral"' in exp and 'reason="unscoped"' in exp


async def test_blocks_holding_a_multimodal_item_and_after_it_are_not_indexed(rig: Rig) -> None:
    """vLLM keys a block that overlaps an image with the image's hash (in its extra keys);
    our token-only key cannot, so two prompts with different images would share it. The
    text blocks before the item are indexed; the item's block and every later one are not,
    in the same event or a later one."""
    from cachecore.keys import BlockKeyer

    await rig.start()
    s = salt("t")
    extra = [(s,), None, ("mm-hash-abc",), ("mm-hash-abc",), None]
    ev = BlockStored([1, 2, 3, 4, 5], None, toks(0, 5), BS, extra_keys=extra)
    later = BlockStored([6], 5, toks(500, 1), BS)  # chained after the image
    lora = BlockStored([7, 8], None, toks(700, 2), BS, lora_name="ad",
                       extra_keys=[("ad", s), ("ad",)])  # LoRA name only: indexed  # fmt: skip
    await rig.publish(ev, later, lora)
    await rig.settle()
    want = BlockKeyer(BS).keys(toks(0, 2), s, MODEL)
    want += BlockKeyer(BS).keys(toks(700, 2), s, MODEL, "ad")
    assert await rig.index_keys() == set(want)
    assert rig.agent is not None
    exp = rig.agent.metrics.exposition().decode()
    assert 'reason="unkeyable"' in exp


async def test_an_unknown_event_type_costs_only_itself_and_a_bad_time_only_the_timing(
    rig: Rig,
) -> None:
    """A newer engine's event type is skipped and counted; the rest of its batch applies
    (dropping the batch made a gap the replay could not fill: the replica went cold). A
    batch time of -inf, inf or NaN indexes its blocks and leaves the latency metrics and
    /health's JSON finite."""
    import math

    import msgpack

    from cachecore.kvevents import encode_batch

    agent = await rig.start()
    clears_at_start = counter_total(agent.metrics.clears)
    ev, _ = rig.engine.store(toks(0, 2))
    body = msgpack.unpackb(encode_batch(batch(ev), Encoding.MAP), raw=False)
    body["events"].append({"type": "BlockPinned", "block_hashes": [1]})
    await rig.source.publish_payload(msgpack.packb(body))
    for bad in (-math.inf, math.inf, math.nan):
        ev2, _ = rig.engine.store(toks(100 + len(rig.engine.keys()) * 40, 1))
        body = msgpack.unpackb(encode_batch(batch(ev2), Encoding.MAP), raw=False)
        body["ts"] = bad
        await rig.source.publish_payload(msgpack.packb(body))
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys()
    assert counter_total(agent.metrics.events_skipped) == 1
    assert counter_total(agent.metrics.clears) == clears_at_start  # no gap, no cold clear
    json.dumps(agent.health(), allow_nan=False)  # what /health serialises
    exp = agent.metrics.exposition().decode()
    assert (
        "kvgate_agent_event_to_index_seconds_sum" in exp
        and "inf" not in exp.split("kvgate_agent_event_to_index_seconds_sum")[1].split("\n")[0]
    )


async def test_a_replayed_backlog_is_not_counted_as_event_to_index_latency(rig: Rig) -> None:
    """Batches an agent catches up on by replay are as old as the backlog (minutes after a
    restart): they are indexed, but /health's and the histogram's event-to-index latency
    is the live flow's. They swamped it (a reviewer saw p50 715 s, p99 1,121 s with a live
    lag of 2 ms) until 20,000 new batches had come in."""
    import time

    import msgpack

    from cachecore.kvevents import encode_batch

    for i in range(3):  # published while no agent listens, an hour ago
        ev, _ = rig.engine.store(toks(40 * i, 1))
        body = msgpack.unpackb(encode_batch(batch(ev), Encoding.MAP), raw=False)
        body["ts"] = time.time() - 3600
        await rig.source.publish_payload(msgpack.packb(body), send=False)
    agent = await rig.start()
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys()  # the backlog is indexed
    assert agent.health()["event_to_index_ms"]["samples"] == 0
    ev, _ = rig.engine.store(toks(500, 1))  # a live one counts
    await rig.publish(ev)
    await rig.settle()
    e2i = agent.health()["event_to_index_ms"]
    assert e2i["samples"] == 1 and e2i["p99"] < 60_000, e2i


async def test_vllm_033_stores_with_nothing_to_key_cost_only_themselves(rig: Rig) -> None:
    """vLLM 0.33 batches hold, beside ordinary stores: a hybrid model's sliding-window group
    store whose ``block_hashes`` leave masked blocks out while ``token_ids`` covers them,
    one with every block masked (no hashes), a CPU-offload tier placeholder (no tokens,
    block size 0), and an empty removal. Each is skipped and counted; the batch's other
    events apply, with no gap and no cold clear (the batch used to be dropped as malformed,
    then the replay failed the same way and the replica's index was cleared)."""
    import msgpack

    from cachecore.kvevents import encode_batch

    agent = await rig.start()
    clears_at_start = counter_total(agent.metrics.clears)
    ev, _ = rig.engine.store(toks(0, 3))
    body = msgpack.unpackb(encode_batch(batch(ev), Encoding.MAP), raw=False)
    (full,) = body["events"]
    body["events"] += [
        {**full, "block_hashes": full["block_hashes"][2:], "group_idx": 1},  # 2 masked
        {**full, "block_hashes": [], "group_idx": 1},  # all masked
        {**full, "token_ids": [], "block_size": 0, "medium": "CPU", "extra_keys": None},
        {"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"},
    ]
    await rig.source.publish_payload(msgpack.packb(body))
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys() and len(rig.engine.keys()) == 3
    assert counter_total(agent.metrics.events_skipped) == 4
    assert counter_total(agent.metrics.clears) == clears_at_start
    assert (await rig.index.meta("r0")).state is ReplicaState.LIVE


async def test_all_blocks_cleared_empties_the_replica_and_keeps_it_live(rig: Rig) -> None:
    await rig.start()
    ev, _ = rig.engine.store(toks(0, 3))
    await rig.publish(ev)
    await rig.settle()
    epoch_before = (await rig.index.meta("r0")).epoch
    rig.engine.clear()
    ev2, _ = rig.engine.store(toks(200, 1))
    await rig.publish(AllBlocksCleared(), ev2)
    await rig.settle()
    meta = await rig.index.meta("r0")
    assert meta.epoch == epoch_before + 1 and meta.state is ReplicaState.LIVE
    assert await rig.index_keys() == rig.engine.keys() and len(rig.engine.keys()) == 1


async def test_unknown_parent_is_counted_and_dropped(rig: Rig) -> None:
    await rig.start()
    await rig.publish(BlockStored([77], 123456, toks(0, 1), BS))
    await rig.settle()
    assert await rig.index_keys() == set()
    assert rig.agent is not None
    assert 'reason="unknown_parent"' in rig.agent.metrics.exposition().decode()


async def test_hybrid_model_indexes_only_the_full_attention_group(rig: Rig) -> None:
    await rig.start()
    eng = rig.engine
    ev, hashes = eng.store(toks(0, 2))
    full = replace(ev, group_idx=0, kv_cache_spec_kind="full_attention")
    swa = replace(
        ev, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128
    )
    await rig.publish(full, swa)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    # the sliding-window group evicting the same engine hashes must not remove anything
    from cachecore.kvevents import BlockRemoved

    await rig.publish(BlockRemoved(hashes, "GPU", group_idx=1))
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    await rig.publish(BlockRemoved(hashes, "GPU", group_idx=0))
    await rig.settle()
    assert await rig.index_keys() == set()


async def test_tiers_from_medium(rig: Rig) -> None:
    await rig.start()
    ev, hashes = rig.engine.store(toks(0, 1), medium="GPU")
    cpu = replace(ev, medium="CPU")
    await rig.publish(ev, cpu)
    await rig.settle()
    blocks = await rig.index.replica_blocks("r0")
    assert set(blocks.values()) == {1 | 2}
    from cachecore.kvevents import BlockRemoved

    await rig.publish(BlockRemoved(hashes, "GPU"))
    await rig.settle()
    assert set((await rig.index.replica_blocks("r0")).values()) == {2}
    # vLLM 0.33's STORAGE medium: local disk with locality LOCAL, remote otherwise
    for locality, tier in (("LOCAL", int(Tier.DISK)), ("REMOTE", int(Tier.REMOTE))):
        await rig.publish(replace(ev, medium="STORAGE", locality=locality))
        await rig.settle()
        assert set((await rig.index.replica_blocks("r0")).values()) == {2 | tier}
        await rig.publish(BlockRemoved(hashes, "STORAGE", locality=locality))
        await rig.settle()
        assert set((await rig.index.replica_blocks("r0")).values()) == {2}


async def test_batches_are_coalesced_into_fewer_index_writes(rig: Rig) -> None:
    await rig.start()
    for i in range(300):
        ev, _ = rig.engine.store(toks(i * 10, 1), tenant=f"t{i}")
        await rig.source.publish_payload(rig.source.next_payload(batch(ev)))
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys()
    assert rig.agent is not None
    writes = rig.agent.metrics.index_writes.labels("r0")._value.get()
    assert writes < 300


# ------------------------------------------------------------------------ recovery


async def test_gap_is_recovered_by_replay(rig: Rig) -> None:
    await rig.start()
    eng = rig.engine
    ev, h = eng.store(toks(0, 2))
    await rig.publish(ev)
    lost, _ = eng.store(toks(100, 2), parent=None, tenant="b")
    await rig.publish(lost, send=False)  # buffered for replay, lost on the wire
    await rig.publish(eng.remove(h[-1:]), send=False)
    ev3, _ = eng.store(toks(200, 1), tenant="c")
    await rig.publish(ev3)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    assert rig.source.replay_requests, "no replay was requested"
    meta = await rig.index.meta("r0")
    assert meta.state is ReplicaState.LIVE


async def test_gap_with_old_replay_format(rig: Rig) -> None:
    rig.source.old_replay_format = True
    await rig.start()
    ev, _ = rig.engine.store(toks(0, 2))
    await rig.publish(ev, send=False)
    ev2, _ = rig.engine.store(toks(50, 1), tenant="z")
    await rig.publish(ev2)
    await rig.settle()
    assert await rig.index_keys() == rig.engine.keys()


async def test_gap_older_than_the_buffer_clears_and_marks_cold() -> None:
    r = Rig(MemoryIndex(), buffer_steps=3)
    try:
        await r.start()
        eng = r.engine
        ev, _ = eng.store(toks(0, 2))
        await r.publish(ev)
        await r.settle()
        for i in range(6):  # more than the buffer holds, all lost on the wire
            lost, _ = eng.store(toks(1000 + 10 * i, 1), tenant=f"x{i}")
            await r.publish(lost, send=False)
        fresh, _ = eng.store(toks(5000, 1), tenant="y")
        await r.publish(fresh)
        await r.settle()
        meta = await r.index.meta("r0")
        assert meta.state is ReplicaState.COLD
        held = await r.index_keys()
        # what survives is exactly what the replay buffer and the live stream still showed
        assert held <= eng.keys()
        assert r.engine.held[max(r.engine.held)] in held  # the newest block is known
        assert len(held) < len(eng.keys())
    finally:
        await r.close()


async def test_gap_with_dead_replay_endpoint_clears_cold(rig: Rig) -> None:
    await rig.start()
    rig.source.replay_enabled = False
    ev, _ = rig.engine.store(toks(0, 1))
    await rig.publish(ev, send=False)
    ev2, _ = rig.engine.store(toks(40, 1), tenant="q")
    await rig.publish(ev2)
    await rig.settle()
    assert (await rig.index.meta("r0")).state is ReplicaState.COLD
    assert await rig.index_keys() == {rig.engine.held[max(rig.engine.held)]}


async def test_engine_restart_by_sequence_reset(rig: Rig) -> None:
    await rig.start()
    eng = rig.engine
    for i in range(3):
        ev, _ = eng.store(toks(i * 100, 2), tenant=f"t{i}")
        await rig.publish(ev)
    await rig.settle()
    epoch = (await rig.index.meta("r0")).epoch
    rig.source.restart()  # new process: seq 0, empty buffer; same start time on purpose
    eng.clear()
    ev, _ = eng.store(toks(900, 1), tenant="new")
    await rig.publish(ev)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    meta = await rig.index.meta("r0")
    assert meta.epoch > epoch and meta.state is ReplicaState.LIVE


async def test_engine_restart_by_start_time_when_seq_passed_the_old_one(rig: Rig) -> None:
    await rig.start()
    eng = rig.engine
    ev, _ = eng.store(toks(0, 2))
    await rig.publish(ev)
    await rig.settle()
    # the new process publishes more batches than the old one did before we notice
    rig.source.restart()
    rig.stub.restart()
    eng.clear()
    for i in range(4):
        ev, _ = eng.store(toks(100 + i * 10, 1), tenant=f"n{i}")
        await rig.publish(ev, send=i >= 2)
    await rig.settle()
    await until(lambda: _restarts(rig) >= 1)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()


def _restarts(rig: Rig) -> float:
    assert rig.agent is not None
    return counter_total(rig.agent.metrics.engine_restarts)


async def test_stale_replayed_batch_cannot_resurrect_an_evicted_block(rig: Rig) -> None:
    await rig.start()
    eng = rig.engine
    ev, h = eng.store(toks(0, 2))
    seq_stored = await rig.publish(ev)
    await rig.publish(eng.remove(h))
    await rig.settle()
    assert await rig.index_keys() == set()
    old_payload = next(p for s, p in rig.source.buffer if s == seq_stored)
    # someone re-sends the old BlockStored with its old seq
    await rig.source.send_raw([b"", seq_to_bytes(seq_stored), old_payload])
    await asyncio.sleep(0.3)
    ev2, _ = eng.store(toks(300, 1), tenant="later")
    await rig.publish(ev2)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    assert rig.agent is not None
    assert rig.agent.metrics.stale_batches._value.get() >= 1
    assert _restarts(rig) == 0


async def test_agent_restart_restores_the_mirror_and_replays(rig: Rig) -> None:
    await rig.start()
    eng = rig.engine
    ev, h = eng.store(toks(0, 3))
    await rig.publish(ev)
    await rig.settle()
    await rig.stop_agent()
    # while the agent is down: a child block, an eviction, a new prefix
    child, _ = eng.store(toks(500, 1), parent=h[-1], tenant=None)
    await rig.publish(child)
    await rig.publish(eng.remove(h[:1]))
    ev3, _ = eng.store(toks(700, 2), tenant="c")
    await rig.publish(ev3)
    await rig.start()
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    assert rig.agent is not None
    for sync in rig.agent.syncs.values():
        await sync.check_invariants()


@pytest.mark.parametrize("record", [b"\x01", b"\x01" * 10], ids=["short", "odd_length"])
async def test_a_corrupt_persisted_mirror_is_dropped_not_retried_forever(
    rig: Rig, record: bytes
) -> None:
    """An agent restarting on mirror records it cannot restore (a corrupt index) retried
    the load forever, logging "index not reachable": the replica never came back. It must
    drop the replica's entries (a clear, counted by cause) and rebuild them from the
    engine's events (its replay, then the live stream)."""
    await rig.start()
    eng = rig.engine
    ev, _ = eng.store(toks(0, 3))
    await rig.publish(ev)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    await rig.stop_agent()
    meta = await rig.index.meta("r0")
    await rig.index.apply("r0", meta.epoch, IndexWrite(mirror={12345: record}), 1)
    agent = await rig.start()  # ready within wait_ready's 10 s, or this fails
    await rig.settle()
    assert counter_total(agent.metrics.clears, cause="corrupt_mirror") == 1
    assert (await rig.index.meta("r0")).epoch > meta.epoch
    # the entries were rebuilt from the engine's replay of its events, and new ones follow
    assert await rig.index_keys() == eng.keys()
    ev2, _ = eng.store(toks(900, 2), tenant="z")
    await rig.publish(ev2)
    await rig.settle()
    assert await rig.index_keys() == eng.keys()
    assert rig.agent is not None
    for sync in rig.agent.syncs.values():
        await sync.check_invariants()


async def test_engine_unavailable_then_back(rig: Rig) -> None:
    await rig.start()
    ev, _ = rig.engine.store(toks(0, 2))
    await rig.publish(ev)
    await rig.settle()
    rig.stub.up = False

    async def state() -> ReplicaState:
        return (await rig.index.meta("r0")).state

    async def is_(s: ReplicaState) -> bool:
        return await state() is s

    await until(lambda: is_(ReplicaState.UNAVAILABLE), 5.0)
    match = await rig.index.lookup(list(rig.engine.keys()), ["r0"], 0)
    assert match["r0"].stored_blocks == 0  # entries kept but not routable
    assert await rig.index_keys() == rig.engine.keys()
    rig.stub.up = True
    await until(lambda: is_(ReplicaState.LIVE), 5.0)
    assert await rig.index_keys() == rig.engine.keys()


async def test_an_engine_whose_metrics_fail_but_which_serves_stays_routable(rig: Rig) -> None:
    """A slow or broken /metrics with /health answering: the engine serves and its events
    keep the index current, so it stays LIVE (a slow /metrics made the agent call it
    unreachable and hid a healthy replica's cache from routing); once /health fails too it
    is UNAVAILABLE as before."""
    # the timeout bounds the /health probes too: 1 s, so that a busy host's stall of the
    # loop serving them is no outage (at 0.2 s, one of ~10 probes late made it UNAVAILABLE)
    rig.settings_kw["scrape_timeout_s"] = 1.0
    await rig.start()
    ev, _ = rig.engine.store(toks(0, 2))
    await rig.publish(ev)
    await rig.settle()
    assert rig.agent is not None
    errors0 = counter_total(rig.agent.metrics.scrape_errors)
    # slow (past the timeout), then broken; each long enough for two failed scrapes past
    # unavailable_after_s (0.4 s), either of which made it UNAVAILABLE before
    for delay, status, window_s in ((2.0, 200, 2.5), (0.0, 500, 1.2)):
        rig.stub.metrics_delay_s, rig.stub.metrics_status = delay, status
        await asyncio.sleep(window_s)
        assert await _state_is(rig, ReplicaState.LIVE), (delay, status)
        match = await rig.index.lookup(list(rig.engine.keys()), ["r0"], 0)
        assert match["r0"].stored_blocks == 2
    assert counter_total(rig.agent.metrics.scrape_errors) > errors0
    rig.stub.up = False  # gone: /health fails too
    await until(lambda: _state_is(rig, ReplicaState.UNAVAILABLE), 5.0)
    rig.stub.up, rig.stub.metrics_status = True, 200
    await until(lambda: _state_is(rig, ReplicaState.LIVE), 5.0)


async def test_engine_back_as_a_new_process_is_cleared(rig: Rig) -> None:
    await rig.start()
    ev, _ = rig.engine.store(toks(0, 2))
    await rig.publish(ev)
    await rig.settle()
    rig.stub.up = False
    await until(lambda: _state_is(rig, ReplicaState.UNAVAILABLE), 5.0)
    rig.stub.restart()
    rig.source.restart()
    rig.engine.clear()
    rig.stub.up = True
    await until(lambda: _state_is(rig, ReplicaState.LIVE), 5.0)
    await rig.settle()
    assert await rig.index_keys() == set()


async def _state_is(rig: Rig, state: ReplicaState) -> bool:
    return (await rig.index.meta("r0")).state is state


async def test_data_parallel_ranks_are_separate_replicas(rig: Rig) -> None:
    await rig.start()
    ev0, _ = rig.engine.store(toks(0, 1), tenant="a")
    await rig.publish(ev0, rank=0)
    ev1, _ = rig.engine.store(toks(0, 1), tenant="b")
    await rig.publish(ev1, rank=3)
    await rig.settle()
    k0 = await rig.index_keys("r0")
    k3 = await rig.index_keys("r0@dp3")
    assert len(k0) == 1 and len(k3) == 1 and k0 | k3 == rig.engine.keys()


# ------------------------------------------------------------------------ collaborators


async def test_load_record_and_registration() -> None:
    load, registry = MemoryLoadStore(), MemoryRegistry()
    r = Rig(MemoryIndex())
    try:
        r.stub.running, r.stub.waiting, r.stub.kv_usage = 2, 5, 0.5
        await r.start(load_store=load, registry=registry)

        async def have_load() -> bool:
            rec = (await load.snapshot(["r0"], _now()))["r0"]
            return rec.has_engine and rec.num_waiting == 5

        await until(have_load)
        rec = (await load.snapshot(["r0"], _now()))["r0"]
        assert (rec.num_running, rec.kv_usage) == (2, 0.5)

        async def registered() -> bool:
            return bool(await registry.discover(_now()))

        await until(registered)
        reg = (await registry.discover(_now()))[0]
        assert (reg.replica_id, reg.model, reg.block_size, reg.capacity_blocks) == (
            "r0", MODEL, BS, 4096)  # fmt: skip
        assert reg.url == r.stub.url
        # its engine gone, a clean stop deregisters (one that still serves hands the
        # registration over to the next agent: tests/test_agent_handover.py)
        r.stub.up = False
        await r.stop_agent()
        assert await registry.discover(_now()) == []
    finally:
        await r.close()


async def test_a_second_agent_for_the_same_replica_id_is_reported() -> None:
    """Two agents with one --replica-id take turns rewriting that replica's index entries;
    each heartbeat finds the other's registration: counted, logged, /health degraded."""
    from cachecore.agent.agent import Agent

    registry = MemoryRegistry()
    r = Rig(MemoryIndex())
    second: Agent | None = None
    try:
        first = await r.start(registry=registry)
        await until(lambda: first.health()["status"] == "ok")
        second = Agent(r.settings(), r.index, registry=registry)
        await second.start()
        await second.wait_ready(10.0)
        agents = (first, second)
        await until(lambda: all(a.health()["status"] == "degraded" for a in agents), 8.0)
        assert all(a.health()["registration_conflict"] for a in agents)
        assert all(counter_total(a.metrics.conflicts) >= 1 for a in agents)
    finally:
        if second is not None:
            await second.stop()
        await r.close()


def _now() -> int:
    import time

    return int(time.time() * 1000)


async def test_trace_out_feeds_trace_analysis(tmp_path: Path) -> None:
    out = tmp_path / "agent.jsonl"
    r = Rig(MemoryIndex(), trace_out=out)
    try:
        await r.start()
        ev, h = r.engine.store(toks(0, 3))
        await r.publish(ev)
        await r.publish(r.engine.remove(h[-1:]))
        await r.publish(AllBlocksCleared())
        await r.settle()
        await r.stop_agent()
        events, _, bad = read_jsonl([out])
        assert bad == 0
        ops = [e["op"] for e in events]
        assert ops.count("store") == 3 and ops.count("remove") == 1 and "clear" in ops
        assert all(len(e["key"]) == 32 for e in events if e["op"] != "clear")
        report = analyze_events(events)
        assert report.occupancy["r0"].stores == 3
        assert len(report.lifetimes_s) == 3  # one removed, two cleared
    finally:
        await r.close()


async def test_health_and_metrics_endpoints(rig: Rig) -> None:
    import httpx

    from cachecore.agent.http import AgentHTTPServer

    agent = await rig.start()
    ev, _ = rig.engine.store(toks(0, 2))
    await rig.publish(ev)
    await rig.settle()
    server = AgentHTTPServer([agent], "127.0.0.1", 0)
    await server.start()
    try:
        async with httpx.AsyncClient() as client:
            h = (await client.get(f"http://127.0.0.1:{server.port}/health")).json()
            m = (await client.get(f"http://127.0.0.1:{server.port}/metrics")).text
        assert h["status"] == "ok" and h["replicas"]["r0"]["mirror_blocks"] == 2
        assert h["replicas"]["r0"]["last_seq"] == rig.source.next_seq - 1
        assert "kvgate_agent_blocks_stored_total" in m
        assert "kvgate_agent_event_to_index_seconds_bucket" in m
    finally:
        await server.stop()


def test_cli_requires_redis() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "agent", "--replica-id", "r0",
         "--engine-url", "http://127.0.0.1:1", "--events", "tcp://127.0.0.1:2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--redis is required" in proc.stderr


def test_trace_record_shape(tmp_path: Path) -> None:
    from cachecore.agent.trace import TraceWriter

    w = TraceWriter(tmp_path / "t.jsonl")
    w.blocks(1.5, "r0", {b"\x01" * 16: 3, b"\x02" * 16: 0})
    w.clear(2.0, "r0")
    w.close()
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lines[0] == {"ts": 1.5, "replica": "r0", "op": "store", "key": "01" * 16,
                        "tier": "GPU|CPU"}  # fmt: skip
    assert lines[1]["op"] == "remove" and lines[2] == {"ts": 2.0, "replica": "r0", "op": "clear"}


async def test_salt_is_recognised_after_lora_items(rig: Rig) -> None:
    """The salt comes last in block 0's extra keys; with a multimodal item before it the
    block is found but not indexed (test above)."""
    await rig.start()
    s = salt("a")
    ev = BlockStored([1], None, toks(0, 1), BS, lora_name="l1", extra_keys=[("l1", s)])
    mm = BlockStored([2], None, toks(90, 1), BS, lora_name="l1", extra_keys=[("l1", "mm-1", s)])
    await rig.publish(ev, mm)
    await rig.settle()
    from cachecore.keys import BlockKeyer

    assert await rig.index_keys() == set(BlockKeyer(BS).keys(toks(0, 1), s, MODEL, "l1"))


def _vllm_like_payloads(s: str, tokens: list[int]) -> list[bytes]:
    """Batches as vLLM's own msgspec encoder writes them (built here by hand, not with our
    encoder): sha256-digest bytes hashes, the salt after the LoRA name in block 0's extra
    keys, the LoRA name in every block, fields we do not know, omitted defaults."""
    import hashlib

    import msgpack

    digests = [hashlib.sha256(f"blk{i}".encode()).digest() for i in range(4)]
    first = {
        "type": "BlockStored",
        "block_hashes": digests[:2],
        "parent_block_hash": None,
        "token_ids": tokens[: 2 * BS],
        "block_size": BS,
        "lora_id": 7,
        "medium": "GPU",
        "lora_name": "sql-lora",
        "extra_keys": [["sql-lora", s], ["sql-lora"]],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "local",  # a newer field: ignored
    }
    second_array = [
        "BlockStored", digests[2:], digests[1], tokens[2 * BS :], BS, 7, "GPU", "sql-lora",
        [["sql-lora"], ["sql-lora"]],
    ]  # fmt: skip
    removed_map = {"type": "BlockRemoved", "block_hashes": [digests[3]], "medium": "GPU"}
    return [
        msgpack.packb({"ts": 1.0, "events": [first]}, use_bin_type=True),  # newest: all maps
        msgpack.packb([2.0, [second_array], None], use_bin_type=True),  # array_like
        msgpack.packb([3.0, [removed_map]], use_bin_type=True),  # 0.2x: array batch, map events
    ]


async def test_real_vllm_shaped_batches(rig: Rig) -> None:
    from cachecore.keys import BlockKeyer

    await rig.start()
    s = salt("acme")
    tokens = toks(0, 4)
    p1, p2, p3 = _vllm_like_payloads(s, tokens)
    await rig.source.publish_payload(p1)
    await rig.source.publish_payload(p2)
    await rig.settle()
    want = BlockKeyer(BS).keys(tokens, s, MODEL, "sql-lora")
    assert await rig.index_keys() == set(want)
    await rig.source.publish_payload(p3)
    await rig.settle()
    assert await rig.index_keys() == set(want[:3])
    assert rig.agent is not None
    assert counter_total(rig.agent.metrics.messages_dropped) == 0


async def test_fresh_agent_trace_keeps_the_replayed_blocks(tmp_path: Path) -> None:
    """A fresh agent against a running engine: its start-up clear (agent clock) is followed
    in the trace by the engine's replayed batches (older engine times); the analysis must
    not let the clear wipe them."""
    import time

    from cachecore.kvevents import EventBatch

    out = tmp_path / "agent.jsonl"
    r = Rig(MemoryIndex(), trace_out=out)
    try:
        for i in range(2):  # published before the agent exists: reach it only by replay
            ev, _ = r.engine.store(toks(100 * i, 3))
            await r.source.publish(EventBatch(ts=time.time() - 60, events=[ev]), send=False)
        await r.start()
        ev, _ = r.engine.store(toks(900, 1))
        await r.publish(ev)  # seq 2 after nothing: a gap, replayed from the start
        await r.settle()
        mirrored = len(await r.index_keys())
        await r.stop_agent()
        events, _, bad = read_jsonl([out])
        assert bad == 0 and events[0]["op"] == "clear"
        assert events[0]["ts"] > events[1]["ts"]  # the clock mismatch this is about
        report = analyze_events(events)
        assert mirrored == 7 and len(report.censored_lifetimes_s) == mirrored
        assert report.lifetimes_s == []
    finally:
        await r.close()


async def test_a_cancellation_as_the_agent_becomes_ready_reaches_the_waiter() -> None:
    """``wait_ready`` under 3.11's ``wait_for`` returned normally when its caller was
    cancelled in the tick the agent became ready: a gateway shut down while starting its
    embedded agents went on starting. The deterministic form: ready and cancel in one tick."""
    from cachecore.agent.agent import Agent

    r = Rig(MemoryIndex())
    agent = Agent(r.settings(), r.index)
    try:
        waiter = asyncio.ensure_future(agent.wait_ready(5.0))
        await asyncio.sleep(0)  # the waiter is parked on the ready event
        agent.ready.set()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, 5.0)
    finally:
        await agent.stop()
        await r.close()
