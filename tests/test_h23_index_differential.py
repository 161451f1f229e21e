"""The differential test of tests/test_index_property.py, extended to what it leaves out:
pending withdrawals (``remove_pending`` with and without ``restore``), the removal log
(``removal_times``, ``removed_since``, ``removal_floor``) with a log short enough to be
trimmed, the agent's clock stepping back (its ``now_ms`` is wall-clock time), and meta.
MemoryIndex and RedisIndex (a real redis-server) must answer alike after every step."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.testing import PATIENT_TIMEOUT_S
from tests.test_index_property import REPLICAS, Driver, op, replica_i

pytestmark = pytest.mark.redis

LOG = 4  # removal log entries per replica: trimmed within a few steps

# engine events that store indexed chains (scoped salts) and evict what was stored, often:
# the removal log fills and is trimmed within a run
store_evict = st.tuples(
    st.just("ev"),
    replica_i,
    st.lists(
        st.one_of(
            st.tuples(
                st.just("s"),
                st.integers(-1, 30),
                st.integers(1, 4),
                st.integers(0, 2**16),
                st.integers(0, 1),
                st.integers(0, 1),
            ),
            st.tuples(st.just("x"), st.integers(0, 30), st.integers(0, 4)),
            st.tuples(st.just("x"), st.integers(0, 30), st.integers(0, 4)),
        ),
        min_size=1,
        max_size=6,
    ),
)
extra_op = st.one_of(
    store_evict,
    store_evict,
    # undo the i-th latest pending write, with or without restore expiries
    st.tuples(st.just("unpend"), st.integers(0, 5), st.lists(st.integers(0, 3), max_size=8)),
    st.tuples(st.just("times"), replica_i, st.integers(-4000, 1000)),
    st.tuples(st.just("times"), replica_i, st.integers(-4000, 1000)),
    st.tuples(st.just("adv"), st.sampled_from([1, 250])),
    st.tuples(st.just("floor"), replica_i),
    st.tuples(st.just("meta"), replica_i),
    # the agent's clock steps back against the gateways' (its writes' now_ms)
    st.tuples(st.just("back"), st.sampled_from([1, 250, 1000])),
)


class LogDriver(Driver):
    def __init__(self, backends: Any) -> None:
        super().__init__(backends)
        self.pends: list[tuple[str, list[bytes], int]] = []
        self.lag = 0  # how far the agent's clock is behind self.now
        self.ever: dict[bytes, None] = {}  # every key written, in order (removals to ask of)

    async def write(self, r: str, w: Any) -> None:
        now, self.now = self.now, self.now - self.lag
        self.ever.update(dict.fromkeys(w.blocks))
        try:
            await super().write(r, w)
        finally:
            self.now = now

    async def step(self, o: tuple[Any, ...]) -> None:
        kind = o[0]
        if kind == "pend":
            r = REPLICAS[o[1]]
            self.pends.append((r, self.chain(o[2], o[3]), self.now + o[4]))
            await super().step(o)
            # both backends trim every expired entry on an add (ZREMRANGEBYSCORE -inf now)
            p = self.model.pending[r]
            for k in [k for k, e in p.items() if e <= self.now]:
                del p[k]
        elif kind == "unpend":
            if not self.pends:
                return
            r, keys, expiry = self.pends[-1 - o[1] % len(self.pends)]
            picks = o[2]
            # a gateway restores only for a write still live (an in-flight one's expiry is
            # later than now, and ZADD GT put its keys at least there)
            restore = (
                [self.now + 250 * picks[i % len(picks)] for i in range(len(keys))]
                if picks and expiry > self.now
                else None
            )
            for b in self.backends:
                await b.remove_pending(r, keys, expiry, self.now, restore)
            # an undo can leave a hole in a chain's pending keys (another write's keys
            # after it): the search is then the backends' shared one, not exact
            self.raw_dirty[r] = True
            p = self.model.pending.setdefault(r, {})
            for i, k in enumerate(keys):
                if p.get(k) == expiry:
                    to = restore[i] if restore else 0
                    if to > self.now:
                        p[k] = to
                    else:
                        del p[k]
        elif kind == "times":
            r = REPLICAS[o[1]]
            keys = list(self.ever)[-8:] or self.known_keys()
            await self.all_equal("removal_times", r, keys, self.now + o[2])
            await self.all_equal("removed_since", r, keys, self.now + o[2])
        elif kind == "floor":
            await self.all_equal("removal_floor", REPLICAS[o[1]])
        elif kind == "meta":
            await self.all_equal("meta", REPLICAS[o[1]])
        elif kind == "back":
            self.lag += o[1]
        else:
            await super().step(o)


async def _run(redis_url: str, ops: list[tuple[Any, ...]]) -> LogDriver:
    admin = aioredis.Redis.from_url(redis_url)
    await admin.flushdb()
    await admin.aclose()
    red = RedisIndex.from_url(
        redis_url,
        socket_timeout_s=PATIENT_TIMEOUT_S,
        connect_timeout_s=PATIENT_TIMEOUT_S,
        removal_log=LOG,
    )
    mem = MemoryIndex(removal_log=LOG)
    try:
        d = LogDriver([mem, red])
        for o in [("state", i, 0) for i in range(len(REPLICAS))] + ops:
            await d.step(o)
        await d.finish()
        for r in REPLICAS:
            await d.all_equal("removal_floor", r)
            await d.all_equal("removal_times", r, [*d.ever, *d.known_keys()], d.now - 10_000)
        mem.check_invariants()
        return d
    finally:
        await red.close()


# the removal log's own program: stores and evictions, time going on and the agent's clock
# stepping back, log reads; rarely a clear
log_op = st.one_of(
    store_evict,
    store_evict,
    store_evict,
    st.tuples(st.just("times"), replica_i, st.integers(-4000, 1000)),
    st.tuples(st.just("floor"), replica_i),
    st.tuples(st.just("adv"), st.sampled_from([1, 250, 1000])),
    st.tuples(st.just("back"), st.sampled_from([1, 250, 1000])),
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.one_of(log_op, op), min_size=10, max_size=50))
def test_memory_and_redis_agree_on_a_trimmed_removal_log(
    redis_url: str, ops: list[tuple[Any, ...]]
) -> None:
    asyncio.run(_run(redis_url, ops))


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.one_of(op, extra_op, extra_op), min_size=1, max_size=50))
def test_memory_and_redis_agree_on_withdrawals_and_the_removal_log(
    redis_url: str, ops: list[tuple[Any, ...]]
) -> None:
    asyncio.run(_run(redis_url, ops))
