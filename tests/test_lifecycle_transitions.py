"""Every row of cachecore.lifecycle.TRANSITIONS driven through both index backends.

A harness plays the three writers for one (replica, key): the engine (KV events through the
agent's ReplicaMirror), the agent (epochs, states, resync) and the gateway (pending). Each test
brings the pair into the row's source state with real operations, applies the row's event, and
observes the resulting state through the index (lookups, replica_blocks, meta). ``absent``,
``evicted`` and ``cleared`` are the same to a lookup by design; the harness tells them apart by
what the engine last did and by the replica's epoch.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cachecore.lifecycle import (
    TRANSITIONS,
    BlockEvent,
    BlockState,
    IndexWrite,
    InvalidTransitionError,
    ReplicaMirror,
    Tier,
    transition,
)
from cachecore.testing import PATIENT_TIMEOUT_S

S, E = BlockState, BlockEvent
R = "eng@dp0"
SALT = "kvg1:tenant-a"
TOKENS = [5, 6, 7, 8]
ENGINE_HASH = 0xABCDEF
TTL = 1000
DOC = Path(__file__).resolve().parents[1] / "docs" / "lifecycle.md"


class Harness:
    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.mirror = ReplicaMirror(BlockKeyer(4), "m")
        self.key = BlockKeyer(4).keys(TOKENS, SALT, "m")[0]
        self.now = 10_000
        self.epoch = 0
        self.start_epoch = 0
        self.last_engine: str = ""  # "store" | "remove" | ""
        self.lose_writes = False  # simulates an index that lost what the agent wrote

    async def start(self) -> None:
        self.epoch = await self.index.clear_replica(R, ReplicaState.LIVE, self.now)
        self.start_epoch = self.epoch

    async def engine(self, *events: KVEvent) -> None:
        write, cleared = self.mirror.apply(events)
        if cleared:
            self.epoch = await self.index.clear_replica(R, ReplicaState.LIVE, self.now)
        if write and not self.lose_writes:
            await self.index.apply(R, self.epoch, write, self.now)

    # ---- events
    async def route(self) -> None:
        await self.index.add_pending(R, [self.key], TTL, self.now)

    async def pending_expire(self) -> None:
        self.now += TTL

    async def store(self) -> None:
        tiers = self.mirror.key_tiers(self.key)
        medium = "CPU" if tiers & int(Tier.GPU) else "GPU"  # a new tier if already stored
        await self.engine(
            BlockStored([ENGINE_HASH], None, TOKENS, 4, medium=medium, extra_keys=[(SALT,)])
        )
        self.last_engine = "store"

    async def remove_tier(self) -> None:
        tiers = self.mirror.key_tiers(self.key)
        assert tiers & int(Tier.GPU) and tiers & int(Tier.CPU), "needs two tiers"
        await self.engine(BlockRemoved([ENGINE_HASH], "CPU"))

    async def remove_last(self) -> None:
        while bin(self.mirror.key_tiers(self.key)).count("1") > 1:
            await self.remove_tier()
        medium = "GPU" if self.mirror.key_tiers(self.key) & int(Tier.GPU) else "CPU"
        await self.engine(BlockRemoved([ENGINE_HASH], medium))
        self.last_engine = "remove"

    async def clear(self) -> None:
        await self.engine(AllBlocksCleared())

    async def engine_lost(self) -> None:
        await self.index.set_state(R, ReplicaState.UNAVAILABLE, self.now)

    async def engine_back(self) -> None:
        await self.index.set_state(R, ReplicaState.LIVE, self.now)

    async def resync(self) -> None:
        self.lose_writes = False
        self.epoch = await self.index.clear_replica(R, ReplicaState.LIVE, self.now)
        snapshot: dict[int, bytes | None] = dict(self.mirror.snapshot())
        await self.index.apply(R, self.epoch, IndexWrite(self.mirror.blocks(), snapshot), self.now)

    async def do(self, event: BlockEvent) -> None:
        await getattr(self, event.value)()

    # ---- setup and observation
    async def bring_to(self, state: BlockState) -> None:
        if state == S.ABSENT:
            return
        if state == S.PENDING:
            await self.route()
        elif state == S.STORED:
            await self.store()
            await self.store()  # on GPU and CPU, so remove_tier applies
        elif state == S.EVICTED:
            await self.store()
            await self.remove_last()
        elif state == S.UNAVAILABLE:
            await self.store()
            await self.engine_lost()
        elif state == S.CLEARED:
            await self.store()
            await self.clear()
        assert await self.observe() == state

    async def observe(self) -> BlockState:
        meta = await self.index.meta(R)
        held = (await self.index.replica_blocks(R)).get(self.key, 0)
        m = (await self.index.lookup([self.key], [R], self.now))[R]
        if meta.state == ReplicaState.UNAVAILABLE:
            assert m.stored_blocks == m.pending_blocks == 0  # not routable
            return S.UNAVAILABLE if held else S.ABSENT
        assert meta.state == ReplicaState.LIVE
        if m.stored_blocks:
            assert held and m.tier_blocks[Tier.GPU] + m.tier_blocks[Tier.CPU] >= 1
            return S.STORED
        assert not held
        if m.pending_blocks:
            return S.PENDING
        if meta.epoch != self.start_epoch:
            return S.CLEARED
        if self.last_engine == "remove":
            return S.EVICTED
        return S.ABSENT


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[PrefixIndex]:
    idx: PrefixIndex
    if request.param == "memory":
        idx = MemoryIndex()
    else:
        idx = RedisIndex.from_url(
            request.getfixturevalue("redis_url"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    yield idx
    await idx.close()


ROWS = sorted(TRANSITIONS.items(), key=lambda kv: (kv[0][0].value, kv[0][1].value))


@pytest.mark.parametrize(
    ("src", "event", "dst"),
    [(s, e, d) for (s, e), d in ROWS],
    ids=[f"{s.value}-{e.value}" for (s, e), _ in ROWS],
)
async def test_transition_row(
    index: PrefixIndex, src: BlockState, event: BlockEvent, dst: BlockState
) -> None:
    h = Harness(index)
    await h.start()
    if (src, event) == (S.ABSENT, E.RESYNC):
        h.lose_writes = True  # the engine stored the block but the index lost the write
        await h.store()
        h.last_engine = ""
    await h.bring_to(src)
    await h.do(event)
    assert await h.observe() == dst


async def test_recovery_keeps_tiers_and_replication_is_per_replica() -> None:
    idx = MemoryIndex()
    h = Harness(idx)
    await h.start()
    await h.store()
    await h.store()
    await h.engine_lost()
    await h.engine_back()
    assert (await idx.replica_blocks(R))[h.key] == int(Tier.GPU | Tier.CPU)
    # the same key on a second replica follows its own machine
    await idx.set_state("other", ReplicaState.LIVE, 0)
    await idx.apply("other", 0, IndexWrite({h.key: int(Tier.GPU)}), 0)
    await h.remove_last()
    res = await idx.lookup([h.key], [R, "other"], h.now)
    assert res[R].stored_blocks == 0 and res["other"].stored_blocks == 1


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_evicted_and_stored_again_in_one_batch_reaches_the_removal_log(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """An engine batch (or a coalesced write) that evicts a block and stores it again
    leaves the entry as it was; the write's ``removed`` still tells the index's removal
    log, whichever batches the agent merged."""
    idx: PrefixIndex
    if kind == "memory":
        idx = MemoryIndex()
    else:
        idx = RedisIndex.from_url(
            request.getfixturevalue("redis_url"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        )
    try:
        h = Harness(idx)
        await h.start()
        await h.store()
        stored = BlockStored([ENGINE_HASH], None, TOKENS, 4, extra_keys=[(SALT,)])
        write, _ = h.mirror.apply([BlockRemoved([ENGINE_HASH], "GPU"), stored])
        assert write.blocks == {h.key: int(Tier.GPU)} and write.removed == {h.key}
        merged = IndexWrite()
        merged.merge(write)
        merged.merge(IndexWrite({h.key: int(Tier.GPU)}))  # a later batch keeps the removal
        assert merged.removed == {h.key}
        await idx.apply(R, h.epoch, merged, h.now + 5)
        assert (await idx.replica_blocks(R)) == {h.key: int(Tier.GPU)}
        assert await idx.removed_since(R, [h.key], h.now + 1) == [True]
        assert await idx.removed_since(R, [h.key], h.now + 6) == [False]
    finally:
        await idx.close()


ALL_PAIRS = [(s, e) for s in BlockState for e in BlockEvent]


def test_every_pair_is_a_transition_or_raises() -> None:
    invalid = 0
    for s, e in ALL_PAIRS:
        if (s, e) in TRANSITIONS:
            assert transition(s, e) == TRANSITIONS[(s, e)]
        else:
            invalid += 1
            with pytest.raises(InvalidTransitionError) as info:
                transition(s, e)
            assert (info.value.state, info.value.event) == (s, e)
    assert invalid == len(ALL_PAIRS) - len(TRANSITIONS) > 0


def parse_doc_table(text: str) -> dict[tuple[str, str], str]:
    """The rows of the markdown table whose header starts with | From | Event | To |."""
    rows: dict[tuple[str, str], str] = {}
    in_table = False
    for line in text.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            in_table = False
            continue
        if [c.lower() for c in cells[:3]] == ["from", "event", "to"]:
            in_table = True
            continue
        if in_table and not re.fullmatch(r"-+", cells[0].replace(":", "")):
            key = (cells[0], cells[1])
            assert key not in rows, f"duplicate row {key}"
            rows[key] = cells[2]
    return rows


def test_docs_table_equals_transitions() -> None:
    doc = parse_doc_table(DOC.read_text())
    code = {(s.value, e.value): d.value for (s, e), d in TRANSITIONS.items()}
    assert doc == code
    states = {s.value for s in BlockState}
    events = {e.value for e in BlockEvent}
    text = DOC.read_text()
    assert all(f"`{s}`" in text for s in states) and all(f"`{e}`" in text for e in events)
