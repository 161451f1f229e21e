"""Malformed-event flood: random frames, random bytes, truncated payloads and structurally
plausible but wrong msgpack. The agent must keep running, count every drop by reason, and
leave the index exactly as the valid traffic made it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cachecore.agent.frames import parse_live
from cachecore.index.memory import MemoryIndex
from cachecore.kvevents import MalformedEventError, decode_batch, seq_to_bytes
from tests.test_agent_helpers import BS, Rig, salt

MAX_PAYLOAD = 64 * 1024


def _valid_event_dicts() -> list[dict[str, Any]]:
    return [
        {
            "type": "BlockStored",
            "block_hashes": [11, 12],
            "parent_block_hash": None,
            "token_ids": list(range(2 * BS)),
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [[salt("fuzz")], None],
        },
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"},
        {"type": "AllBlocksCleared"},
    ]


_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_WRONG = st.one_of(
    st.none(),
    st.booleans(),
    _INT,
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(_INT, max_size=3),
    st.dictionaries(st.text(max_size=3), _INT, max_size=2),
)


@st.composite
def broken_event(draw: st.DrawFn) -> Any:
    ev = dict(draw(st.sampled_from(_valid_event_dicts())))
    how = draw(st.sampled_from(["drop", "wrong", "tag", "array", "tokens", "extra"]))
    fields = [k for k in ev if k != "type"] or ["type"]
    if how == "drop" and fields != ["type"]:
        del ev[draw(st.sampled_from(fields))]
    elif how == "wrong":
        ev[draw(st.sampled_from([*fields, "type"]))] = draw(_WRONG)
    elif how == "tag":
        ev["type"] = draw(st.text(max_size=12))
    elif how == "array":
        return [ev.get("type"), *draw(st.lists(_WRONG, max_size=6))]
    elif how == "tokens" and "token_ids" in ev:
        ev["token_ids"] = draw(st.lists(st.integers(min_value=-5, max_value=2**33), max_size=12))
    elif how == "extra" and "extra_keys" in ev:
        ev["extra_keys"] = draw(st.lists(st.one_of(st.none(), st.lists(_WRONG)), max_size=4))
    return ev


@st.composite
def plausible_payload(draw: st.DrawFn) -> bytes:
    events = draw(st.lists(st.one_of(broken_event(), st.sampled_from(_valid_event_dicts()))))
    shape = draw(st.sampled_from(["array", "map", "short", "scalar"]))
    ts: Any = draw(st.one_of(st.floats(allow_nan=False, allow_infinity=False), _WRONG))
    rank: Any = draw(st.one_of(st.none(), st.integers(min_value=-3, max_value=5000), _WRONG))
    body: Any
    if shape == "array":
        body = [ts, events, rank]
    elif shape == "map":
        body = {"ts": ts, "events": events, "data_parallel_rank": rank}
    elif shape == "short":
        body = [ts]
    else:
        body = draw(_WRONG)
    return _pack(body)


def _pack(body: Any) -> bytes:
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


@st.composite
def truncated_payload(draw: st.DrawFn) -> bytes:
    good = _pack([1.0, [_valid_event_dicts()[0]]])
    cut = draw(st.integers(min_value=0, max_value=len(good) - 1))
    return good[:cut]


_SEQ = st.one_of(
    st.integers(min_value=0, max_value=2**62).map(seq_to_bytes),
    st.binary(max_size=12),
)
_PAYLOAD = st.one_of(st.binary(max_size=256), plausible_payload(), truncated_payload())


@st.composite
def message(draw: st.DrawFn) -> list[bytes]:
    kind = draw(st.sampled_from(["frames", "shaped"]))
    if kind == "frames":
        return draw(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
    topic = draw(st.sampled_from([b"", b"", b"x"]))
    return [topic, draw(_SEQ), draw(_PAYLOAD)]


def _would_be_accepted(frames: list[bytes]) -> bool:
    """Messages the agent must accept are not the subject here (the recovery tests cover
    valid but unexpected batches); the codec is the judge of validity."""
    if not frames:
        return False
    try:
        frame = parse_live(frames, b"", MAX_PAYLOAD)
        b = decode_batch(frame.payload, MAX_PAYLOAD)
    except MalformedEventError:
        return False
    rank = b.data_parallel_rank
    return rank is None or 0 <= rank < 1024


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fuzz_rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex(), max_payload_bytes=MAX_PAYLOAD)
    await r.start()
    ev, _ = r.engine.store(list(range(3 * BS)), tenant="base")
    await r.publish(ev)
    await r.settle()
    yield r
    await r.close()


@pytest.mark.asyncio(loop_scope="module")
@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(messages=st.lists(message(), min_size=1, max_size=8))
async def test_flood_of_malformed_messages(fuzz_rig: Rig, messages: list[list[bytes]]) -> None:
    r = fuzz_rig
    assume(not any(_would_be_accepted(m) for m in messages))
    assert r.agent is not None and r.agent.stream is not None
    before = await r.index_keys()
    for m in messages:
        if m:  # ZMQ cannot send an empty multipart
            await r.source.send_raw(m)
    # a valid batch after the flood is still applied, in order, with nothing else changed
    ev, _ = r.engine.store(list(range(1000, 1000 + BS)), tenant=f"probe{r.source.next_seq}")
    await r.publish(ev)
    await r.settle(10.0)
    after = await r.index_keys()
    assert after == r.engine.keys()
    assert before <= after and len(after - before) == 1
    assert all(not t.done() for t in r.agent._tasks), "an agent task died"
    assert (await r.index.meta("r0")).state.value == "live"


@pytest.mark.asyncio(loop_scope="module")
async def test_flood_drops_are_counted_by_reason(fuzz_rig: Rig) -> None:
    r = fuzz_rig
    assert r.agent is not None
    for frames in (
        [b"only-one"],
        [b"", b"short", b"x"],
        [b"", seq_to_bytes(10**6), b"\xc1"],  # 0xc1 is never valid msgpack
        [b"", seq_to_bytes(10**6), _pack({"ts": "x", "events": []})],
    ):
        await r.source.send_raw(frames)
    ev, _ = r.engine.store(list(range(2000, 2000 + BS)), tenant="counted")
    await r.publish(ev)
    await r.settle()
    text = r.agent.metrics.exposition().decode()
    for reason in ("bad_frames", "bad_seq", "bad_msgpack", "bad_batch"):
        assert f'kvgate_agent_messages_dropped_total{{reason="{reason}"}}' in text, reason
    assert await r.index_keys() == r.engine.keys()


async def test_oversized_payload_is_refused_and_the_stream_recovers() -> None:
    r = Rig(MemoryIndex(), max_payload_bytes=MAX_PAYLOAD)
    try:
        await r.start()
        ev, _ = r.engine.store(list(range(2 * BS)), tenant="a")
        await r.publish(ev)
        await r.settle()
        await r.source.send_raw([b"", seq_to_bytes(99), b"\x00" * (4 * MAX_PAYLOAD)])
        await asyncio.sleep(0.3)  # ZMQ dropped the connection; it reconnects by itself
        ev2, _ = r.engine.store(list(range(500, 500 + BS)), tenant="b")
        await r.publish(ev2)
        ev3, _ = r.engine.store(list(range(700, 700 + BS)), tenant="c")
        await asyncio.sleep(0.3)
        await r.publish(ev3)
        await r.settle()
        assert await r.index_keys() == r.engine.keys()
    finally:
        await r.close()
