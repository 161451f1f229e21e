"""H23/H3: the agent's event stream under engine faults (a hand-driven vLLM-format publisher
with its replay ROUTER, the engine stub, a real ZMQ SUB): what a restart must not leave."""

from __future__ import annotations

import asyncio

from cachecore.index.memory import MemoryIndex
from tests.test_agent_helpers import BS, Rig, counter_total, until


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


async def test_batches_of_a_dead_engine_process_queued_at_its_restart_are_not_applied() -> None:
    """The agent lags (here: its stream lock held) while the engine publishes 4 (lost), 5
    and 6, then restarts (seq from 0, cache empty, a later start time). Batch 5, read after
    the restart, looked like a gap: the new engine's replay held nothing, the replica was
    cleared COLD and the dead process's 5 and 6 were applied, so the index claimed blocks
    the new engine never had, for as long as it published nothing. The replay completed
    below 5: the engine does not hold 5, so 5 and 6 are dropped as stale."""
    r = Rig(MemoryIndex())
    try:
        agent = await r.start()
        eng = r.engine
        for i in range(4):  # seq 0..3
            ev, _ = eng.store(toks(100 * i, 2), tenant=f"t{i}")
            await r.publish(ev)
        await r.settle()
        stream = agent.stream
        assert stream is not None
        stale0 = counter_total(agent.metrics.stale_batches)
        async with stream.lock:  # the agent is busy elsewhere: live batches queue up
            lost, _ = eng.store(toks(1000, 2), tenant="x")
            await r.publish(lost, send=False)  # seq 4
            for i in range(2):  # seq 5, 6: queued in the agent's SUB socket
                ev, _ = eng.store(toks(2000 + 100 * i, 2), tenant=f"q{i}")
                await r.publish(ev)
            await asyncio.sleep(0.3)
            r.source.restart()  # a new engine process: nothing published yet
            r.stub.restart()
            eng.clear()
        await until(
            lambda: (
                counter_total(agent.metrics.stale_batches) >= stale0 + 2 or stream.last_seq == 6
            ),
            8.0,
        )
        await agent.drain(5.0)
        assert stream.last_seq == -1
        assert await r.index_keys() == eng.keys() == set()
        # the new process's first batch is applied as usual
        ev, _ = eng.store(toks(5000, 2), tenant="n")
        await r.publish(ev)
        await r.settle()
        assert await r.index_keys() == eng.keys()
    finally:
        await r.close()
