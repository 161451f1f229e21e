"""H23/H3: the cache agent against a faulty engine HTTP surface (the engine stub, a real
HTTP server on loopback): what each fault must not cost the event stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from cachecore.agent.scrape import EngineScraper, ScrapeError
from cachecore.agent.testing import EngineStub
from cachecore.index.memory import MemoryIndex
from tests.test_agent_helpers import BS, MODEL, Rig, until


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


async def test_a_dribbling_metrics_endpoint_times_out_as_a_whole() -> None:
    """httpx's timeout bounds each read: an engine (or proxy) whose /metrics sends a line
    every 50 ms held the scrape for as long as it kept sending (minutes here), not 0.3 s."""
    r = Rig(MemoryIndex())
    try:
        await r.stub.start()
        r.stub.metrics_dribble_s = 0.05
        scraper = EngineScraper(r.stub.url, timeout_s=0.3)
        try:
            t0 = time.monotonic()
            with pytest.raises(ScrapeError):
                async with asyncio.timeout(10.0):
                    await scraper.metrics()
            assert time.monotonic() - t0 < 5.0
        finally:
            await scraper.close()
    finally:
        await r.close()


async def test_a_dribbling_metrics_endpoint_does_not_stall_the_event_stream() -> None:
    """Without a replay endpoint a gap asks the engine's /metrics whether it restarted,
    holding the stream's lock. A /metrics that dribbles held every later batch out of the
    index for as long as it dribbled; now the check gives up after scrape_timeout_s."""
    r = Rig(MemoryIndex(), with_replay=False, scrape_timeout_s=0.3)
    try:
        await r.start()
        eng = r.engine
        ev, _ = eng.store(toks(0, 2), tenant="a")
        await r.publish(ev)
        await r.settle()
        r.stub.metrics_dribble_s = 0.05  # ~17 lines x 100 x 50 ms: about 85 s in all
        lost, _ = eng.store(toks(100, 2), tenant="b")
        await r.publish(lost, send=False)  # a gap the agent cannot replay
        eng.clear()  # the unrecoverable gap clears the replica: only what follows counts
        ev, _ = eng.store(toks(200, 2), tenant="c")
        last = await r.publish(ev)
        assert r.agent is not None
        agent = r.agent
        await until(lambda: agent.stream is not None and agent.stream.last_seq == last, 5.0)
        await agent.drain(5.0)
        assert await r.index_keys() == eng.keys()
    finally:
        await r.close()


class _OddStub(EngineStub):
    """An engine (or a proxy before it) whose pool size label reads ``inf``."""

    odd = False

    def metrics_text(self) -> str:
        text = super().metrics_text()
        if self.odd:
            text = text.replace(f'num_gpu_blocks="{self.num_gpu_blocks}"', 'num_gpu_blocks="inf"')
        return text


async def test_an_infinite_label_in_metrics_does_not_end_the_scrape_loop() -> None:
    """``num_gpu_blocks="inf"`` raised OverflowError out of parse_metrics (int(inf)), which
    ended the agent's scrape loop for good, silently: no load published, no restart and no
    unreachable engine detected from then on. The label now reads as absent."""
    r = Rig(MemoryIndex())
    await r.stub.close()
    r.stub = _OddStub(model=MODEL, block_size=BS)
    try:
        agent = await r.start()
        stub = r.stub
        stub.odd = True
        n0 = stub.scrapes
        await until(lambda: stub.scrapes >= n0 + 3, 5.0)
        stub.up = False  # the engine goes away: the scrape loop must notice
        await until(lambda: not agent.engine_reachable, 5.0)
    finally:
        await r.close()
