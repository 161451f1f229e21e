"""A cancellation that arrives as an awaited index call completes must reach the caller.

``asyncio.wait_for`` on Python 3.11 returns the inner result when the outer task is
cancelled in the tick the inner call finishes, and the cancellation is lost: a request whose
client left during the index lookup was routed and sent upstream all the same, a claim check
cancelled by shutdown went on to judge the replica, and a shutdown during start-up or the
drain went on as if nothing had happened. Each test parks the call at a gate on a real
:class:`MemoryIndex`, then opens the gate and cancels the caller in the same tick: the
deterministic form of the race."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import pytest
from pydantic import SecretStr

from cachecore.index.base import PrefixMatch
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKey
from gateway.core import Gateway
from gateway.indexing import GatewayIndex
from gateway.settings import GatewaySettings
from tests.test_gateway_support import SECRET, stack, words

pytestmark = pytest.mark.timeout(60)


class GatedIndex(MemoryIndex):
    """A real in-process index whose lookup and removal-log reads wait at a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.entered = asyncio.Event()

    async def _wait(self) -> None:
        self.entered.set()
        await self.gate

    async def lookup(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int
    ) -> dict[str, PrefixMatch]:
        await self._wait()
        return await super().lookup(keys, replicas, now_ms)

    async def removal_times(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[float | None] | None:
        await self._wait()
        return await super().removal_times(replica, keys, since_ms)


async def cancelled_as_it_completes(gated: GatedIndex, call: Awaitable[Any]) -> None:
    """Run ``call`` until it waits at the gate, then open the gate and cancel it in one
    tick: the cancellation must come out of it."""
    task = asyncio.ensure_future(call)
    await asyncio.wait_for(gated.entered.wait(), 5.0)
    gated.gate.set_result(None)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5.0)


def bare_gateway() -> Gateway:
    return Gateway(GatewaySettings(salt_secrets=[SecretStr(SECRET)]))


async def test_a_client_leaving_during_the_index_lookup_stops_the_request() -> None:
    gated = GatedIndex()
    index = GatewayIndex(gated, bare_gateway().metrics, MemoryIndex())
    await cancelled_as_it_completes(gated, index.lookup([bytes(16)], ["r0"], 1, 5.0))


async def test_the_lookup_timeout_still_falls_back_to_local_decisions() -> None:
    gated = GatedIndex()  # never opened: the lookup overruns its budget
    index = GatewayIndex(gated, bare_gateway().metrics, MemoryIndex())
    res = await index.lookup([bytes(16)], ["r0"], 1, 0.05)
    assert res.source == "local" and index.fallbacks == 1


async def test_a_shutdown_during_the_index_warm_up_stops_the_start() -> None:
    gated = GatedIndex()
    await cancelled_as_it_completes(gated, bare_gateway()._warm_index(gated))


async def test_a_shutdown_during_a_claim_checks_index_read_stops_it() -> None:
    async with stack(count=1) as st:
        gw = st.gw
        body = {"model": st.model, "prompt": words(100, 5100), "max_tokens": 1}
        d = await gw.prepare("completion", "anonymous", body, {}, "r1", explain_only=True)
        gated = GatedIndex()
        assert gw.index is not None
        real, gw.index = gw.index, GatewayIndex(gated, gw.metrics)
        try:
            await cancelled_as_it_completes(gated, gw._restored_since_lookup(d, 0))
        finally:
            gw.index = real


async def test_a_cancelled_drain_does_not_go_on_to_close_the_gateway() -> None:
    gw = bare_gateway()
    gw.begin()  # one request in flight: stop() waits for it
    task = asyncio.ensure_future(gw.stop())
    for _ in range(3):
        await asyncio.sleep(0)  # stop() is waiting for the drain
    assert not task.done()
    gw.end()  # the last request ends...
    task.cancel()  # ...as the stop is cancelled
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5.0)
