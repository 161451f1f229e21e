"""The gateway's view of the index (GatewayIndex over a real redis-server, with its local
copy of its own pending writes)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import IndexWrite
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway.indexing import GatewayIndex
from gateway.metrics import GatewayMetrics

pytestmark = pytest.mark.redis

KEYS = BlockKeyer(4).keys(list(range(4 * 8)), "kvg1:t", "m")
NOW = 1_000_000


async def test_read_your_writes_gives_no_match_to_a_replica_the_index_says_is_not_routable(
    redis_url: str,
) -> None:
    """A replica whose agent reports its engine unreachable (UNAVAILABLE) answers zeros
    from the index, pending entries included (base.py: "a replica whose state is not live
    or cold answers zeros"). The local copy of this gateway's own pending writes raised its
    pending length anyway, so the gateway kept predicting hits there (and steering the
    prefix's requests to an engine its agent cannot reach) for the pending TTL. A replica
    no agent has reported (unknown) is still routed by the gateway's own decisions."""
    primary = RedisIndex.from_url(
        redis_url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    gi = GatewayIndex(primary, GatewayMetrics(), MemoryIndex())
    try:
        for r in ("up", "down"):
            await primary.set_state(r, ReplicaState.LIVE, NOW)
        await primary.apply("up", 0, IndexWrite({KEYS[0]: 1}), NOW)
        for r in ("up", "down"):
            gi.add_pending(r, KEYS, 10_000, NOW)
        await gi.settle()
        await primary.set_state("down", ReplicaState.UNAVAILABLE, NOW + 1)
        got = await gi.lookup(KEYS, ["up", "down"], NOW + 2, timeout_s=PATIENT_TIMEOUT_S)
        assert got.source == "primary"
        assert (got.matches["up"].stored_blocks, got.matches["up"].pending_blocks) == (1, 8)
        down = got.matches["down"]
        assert down.state is ReplicaState.UNAVAILABLE
        assert (down.stored_blocks, down.pending_blocks) == (0, 0)
        # as the shared index alone answers it
        alone = await primary.lookup(KEYS, ["down"], NOW + 2)
        assert alone["down"] == down
        # the shared index lost its data (a Redis restart): until the agents rewrite it,
        # every replica reads unknown there, and our own decisions still count (runbook)
        admin = aioredis.Redis.from_url(redis_url)
        await admin.flushall()
        await admin.aclose()
        got = await gi.lookup(KEYS, ["up"], NOW + 3, timeout_s=PATIENT_TIMEOUT_S)
        assert got.source == "primary" and got.matches["up"].state is ReplicaState.UNKNOWN
        assert got.matches["up"].pending_blocks == 8
    finally:
        await gi.close()
