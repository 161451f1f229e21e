"""H23/H3: the cache agent under real-world faults (a real redis-server, a hand-driven
vLLM-format publisher and engine stub): what each fault must not cost the index."""

from __future__ import annotations

import pytest

from cachecore.index.layout import KeyLayout
from cachecore.index.redis import RedisIndex
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from tests.test_agent_helpers import BS, Rig, until


def toks(start: int, n_blocks: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def _index(url: str) -> RedisIndex:
    return RedisIndex.from_url(
        url,
        KeyLayout("kvgt"),
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
    )


@pytest.mark.redis
async def test_engine_restart_during_redis_outage_keeps_the_new_streams_seq(
    redis_own: RedisServer,
) -> None:
    """The engine restarts (seq back to 0) while Redis is down: the agent's clear fails.
    The rewrite after the outage carried the OLD process's last seq (4) as the index's
    last_seq; an agent restarted later then replayed from 5 and never applied the new
    process's batches 2..4 (their blocks were missing from the index for good)."""
    index = _index(redis_own.url)
    r = Rig(index)
    try:
        await r.start()
        eng = r.engine
        for i in range(5):  # seq 0..4 of the first engine process
            ev, _ = eng.store(toks(100 * i, 2), tenant=f"t{i}")
            await r.publish(ev)
        await r.settle()
        redis_own.stop()
        # a new engine process: seq from 0, cache empty, a later start time
        r.source.restart()
        r.stub.restart()
        eng.clear()
        for i in range(2):  # seq 0..1 of the new process
            ev, _ = eng.store(toks(1000 + 100 * i, 2), tenant=f"n{i}")
            await r.publish(ev)
        assert r.agent is not None
        agent = r.agent
        await until(lambda: agent.stream is not None and agent.stream.last_seq == 1, 10.0)
        redis_own.start()

        async def back() -> bool:
            try:
                return await r.index_keys() == eng.keys()
            except Exception:
                return False

        await until(back, 15.0)
        await r.settle()
        assert (await index.meta("r0")).last_seq == 1
        # the agent restarts while the engine goes on: it must replay from seq 2
        await r.stop_agent()
        for i in range(3):  # seq 2..4 of the new process, published while no agent runs
            ev, _ = eng.store(toks(5000 + 100 * i, 2), tenant=f"m{i}")
            await r.publish(ev)
        await r.start()
        await r.settle()
        assert await r.index_keys() == eng.keys()
        for sync in r.agent.syncs.values():
            await sync.check_invariants()
    finally:
        await r.close()
        await index.close()
