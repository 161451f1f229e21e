"""Shared pieces of the agent tests: a rig (event source + engine stub + index + agent) and a
tiny model of what the fake engine holds, so each test states its expectation as blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from cachecore.agent import Agent, AgentSettings
from cachecore.agent.stream import payload_digest
from cachecore.agent.testing import EngineStub, EventSource
from cachecore.index.base import PrefixIndex
from cachecore.keys import BlockKey, BlockKeyer, SaltMinter, Scope, ScopeKind
from cachecore.kvevents import BlockRemoved, BlockStored, Encoding, EventBatch, KVEvent
from cachecore.testing import free_ports

BS = 4
MODEL = "stub-model"
MINTER = SaltMinter([b"agent-test-secret-0123456789"])


def salt(tenant: str) -> str:
    return MINTER.salt(Scope(ScopeKind.TENANT, tenant))


async def until(
    pred: Callable[[], bool | Awaitable[bool]], timeout_s: float = 8.0, step_s: float = 0.02
) -> None:
    """Poll ``pred`` (bounded in time and count) until true; fail with a clear message."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / step_s) + 2):
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(step_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


@dataclass
class EngineModel:
    """What the fake engine holds: engine hash -> our key, so tests can say which keys the
    index must hold after any sequence of published events."""

    keyer: BlockKeyer = field(default_factory=lambda: BlockKeyer(BS))
    model: str = MODEL
    held: dict[int, BlockKey] = field(default_factory=dict)
    next_hash: int = 1000

    def store(
        self,
        tokens: list[int],
        tenant: str | None = "a",
        parent: int | None = None,
        lora: str | None = None,
        medium: str | None = "GPU",
        hash_bytes: bool = False,
    ) -> tuple[BlockStored, list[int]]:
        n = len(tokens) // BS
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        s = salt(tenant) if tenant is not None and parent is None else None
        parent_key = self.held[parent] if parent is not None else None
        if parent is None and s is not None:
            keys = self.keyer.keys(tokens, s, self.model, lora)
        elif parent_key is not None:
            keys = self.keyer.chain(parent_key, tokens, None, self.model, lora)
        else:
            keys = []
        for h, k in zip(hashes, keys, strict=False):
            self.held[h] = k
        extra: list[tuple[Any, ...] | None] | None = None
        if parent is None:
            first: tuple[Any, ...] = ((lora,) if lora else ()) + ((s,) if s else ())
            rest: list[tuple[Any, ...] | None] = [(lora,) if lora else None for _ in hashes[1:]]
            extra = [first or None, *rest]
        elif lora:
            extra = [(lora,) for _ in hashes]
        wire_hashes: list[Any] = [h.to_bytes(32, "big") for h in hashes] if hash_bytes else hashes
        ev = BlockStored(
            block_hashes=wire_hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BS,
            medium=medium,
            lora_name=lora,
            extra_keys=extra,
        )
        return ev, hashes

    def remove(self, hashes: list[int], medium: str | None = "GPU") -> BlockRemoved:
        for h in hashes:
            self.held.pop(h, None)
        return BlockRemoved(block_hashes=hashes, medium=medium)

    def clear(self) -> None:
        self.held.clear()

    def keys(self) -> set[BlockKey]:
        return set(self.held.values())


def counter_total(counter: Any, **labels: str) -> float:
    """Sum of a prometheus Counter's ``_total`` samples matching ``labels``."""
    total = 0.0
    for metric in counter.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total") and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return total


def batch(*events: KVEvent, rank: int | None = None) -> EventBatch:
    return EventBatch(ts=time.time(), events=list(events), data_parallel_rank=rank)


class Rig:
    """Event source + engine stub + agent on one index, all on loopback."""

    def __init__(
        self,
        index: PrefixIndex,
        *,
        buffer_steps: int = 10_000,
        old_replay_format: bool = False,
        with_replay: bool = True,
        **settings: Any,
    ) -> None:
        self.index = index
        self.ctx = zmq.asyncio.Context()
        pub, rep = free_ports(2)
        self.events_ep = f"tcp://127.0.0.1:{pub}"
        self.replay_ep = f"tcp://127.0.0.1:{rep}" if with_replay else None
        self.source = EventSource(
            self.ctx,
            self.events_ep,
            self.replay_ep,
            buffer_steps=buffer_steps,
            old_replay_format=old_replay_format,
        ).start()
        self.stub = EngineStub(model=MODEL, block_size=BS)
        self.engine = EngineModel()
        self.settings_kw: dict[str, Any] = {
            "scrape_interval_s": 0.1,
            "unavailable_after_s": 0.4,
            "index_check_interval_s": 0.2,
            "replay_timeout_s": 0.5,
            "heartbeat_interval_s": 0.2,
            **settings,
        }
        self.agent: Agent | None = None

    def settings(self, **extra: Any) -> AgentSettings:
        return AgentSettings(
            replica_id="r0",
            engine_url=self.stub.url,
            events=self.events_ep,
            replay=self.replay_ep,
            **{**self.settings_kw, **extra},
        )

    async def start(self, **agent_kw: Any) -> Agent:
        if not self.stub._server.started:
            await self.stub.start()
        self.agent = Agent(self.settings(), self.index, **agent_kw)
        await self.agent.start()
        await self.agent.wait_ready(10.0)
        # the SUB connection must be up before anything is published live
        await self.wait_connected()
        return self.agent

    async def wait_connected(self) -> None:
        """Publish nothing until the subscription reached the PUB (ZMQ drops messages for
        subscribers it does not know yet; they would show up as a gap, not a failure)."""
        await asyncio.sleep(0.15)

    async def publish(self, *events: KVEvent, encoding: Encoding = Encoding.MAP,
                      send: bool = True, rank: int | None = None) -> int:  # fmt: skip
        return await self.source.publish(batch(*events, rank=rank), encoding, send=send)

    async def settle(self, timeout_s: float = 8.0) -> None:
        """Until the agent wrote everything the source published."""
        agent = self.agent
        assert agent is not None
        last = self.source.buffer[-1] if self.source.buffer else None

        def done() -> bool:
            syncs = list(agent.syncs.values())
            stream = agent.stream
            caught_up = last is None or (
                stream is not None
                and stream.last_seq == last[0]
                and stream.last_digest in (None, payload_digest(last[1]))
            )
            return caught_up and bool(syncs) and all(s.queued == 0 and not s.dirty for s in syncs)

        await until(done, timeout_s)
        await agent.drain(timeout_s)

    async def index_keys(self, replica: str = "r0") -> set[BlockKey]:
        return set((await self.index.replica_blocks(replica)).keys())

    async def stop_agent(self) -> None:
        if self.agent is not None:
            await self.agent.stop()
            self.agent = None

    async def close(self) -> None:
        await self.stop_agent()
        await self.source.close()
        await self.stub.close()
        self.ctx.destroy(linger=0)


def test_the_timeout_watchdog_shows_where_each_task_waits() -> None:
    """tests/conftest.py's dump, called from another thread while a loop waits."""
    import io

    from tests.conftest import dump_asyncio_tasks

    async def parked_on_an_event_nobody_sets(ev: asyncio.Event) -> None:
        await ev.wait()

    out = io.StringIO()

    async def main() -> int:
        ev = asyncio.Event()
        task = asyncio.create_task(parked_on_an_event_nobody_sets(ev))
        await asyncio.sleep(0.05)
        n = await asyncio.to_thread(dump_asyncio_tasks, out)  # the loop keeps running
        task.cancel()
        return n

    assert asyncio.run(main()) >= 2  # main and the parked task
    text = out.getvalue()
    assert "parked_on_an_event_nobody_sets" in text and "ev.wait()" in text
