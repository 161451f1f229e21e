"""Review R5: a clear of a replica's index (an engine's prefix-cache reset, vLLM's
AllBlocksCleared from /reset_prefix_cache; an engine restart) between a request's lookup and
its check was judged a false claim. The clear started a new epoch with ``rm_floor`` -1 (the
removal log "complete since ever") and logged no removal; the request stored the same blocks
again, so the check found them claimed and never removed: ``false``, and three such
requests quarantined an honest replica. Now a clear sets the floor to its own time (the old
epoch's log is gone with it): a check whose lookup predates the clear reads "cannot tell",
judged by the floor (``unverifiable``), on both backends alike. A rogue agent that clears at
will gains what raising its floor gave it (D22), no more: it is still quarantined."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import cast

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import PrefixIndex, PrefixMatch, RemovalFloor, ReplicaState
from cachecore.index.layout import agent_acl_rules, gateway_acl_rules
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex
from cachecore.keys import BlockKey
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway.quarantine import LogAnswer, judge_floor, judge_removal
from tests.test_gateway_faults import checked, prompt_keys
from tests.test_gateway_support import stack, words
from tests.test_rogue_removal_floor import _as, _index_as, _user, admin  # noqa: F401

pytestmark = pytest.mark.timeout(120)
G = int(Tier.GPU)
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


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
    try:
        yield idx
    finally:
        await idx.close()


async def test_a_clear_after_the_lookup_leaves_the_log_unable_to_tell(index: PrefixIndex) -> None:
    """Both backends: stored, looked up at 1,010, cleared at 1,020 (the engine's reset),
    stored again at 1,030 by the request itself: the log cannot tell of the lookup (it was
    "never removed" -> ``false``), and the floor it rests on is the clear's, a possible one
    (``unverifiable``). After the clear the log is complete again."""
    epoch = await index.clear_replica("a", ReplicaState.LIVE, 1_000)
    await index.apply("a", epoch, IndexWrite(dict.fromkeys(KEYS, G)), 1_001)
    lookup_ms = 1_010
    epoch = await index.clear_replica("a", ReplicaState.LIVE, 1_020)
    await index.apply("a", epoch, IndexWrite(dict.fromkeys(KEYS, G)), 1_030)
    assert await index.removal_times("a", KEYS[:1], lookup_ms - 250) is None
    assert await index.removed_since("a", KEYS[:1], lookup_ms) is None
    floor = await index.removal_floor("a")
    assert floor == RemovalFloor(1_020, 1_030)
    assert judge_floor(floor, 1_040, 10_000) is LogAnswer.UNVERIFIABLE
    # the new epoch's log is complete after the clear: a later removal is read as ever
    await index.apply("a", epoch, IndexWrite({KEYS[1]: 0}), 1_050)
    assert await index.removal_times("a", KEYS[:2], 1_021) == [None, 1_050.0]
    assert judge_removal(None, 1_060, 10_000) is LogAnswer.NOT_REMOVED  # no clear: a lie


async def test_a_cache_reset_after_the_lookup_is_no_false_claim() -> None:
    """The reviewer's repro: a real simulated replica whose /reset_prefix_cache is vLLM's,
    its embedded agent, the memory index: three requests looked up before a reset, served
    with 0 cached tokens after it (was Counter({'false': 3, 'agree': 2}))."""
    policy = "quarantine: {settle_s: 0.3}"
    async with stack(count=1, agents=True, policy=policy) as st, st.http() as h:
        gw, c, rep = st.gw, st.client(), st.replica_id(0)
        engine = st.fleet.endpoints[0].url
        system = words(300, 11)
        for i in range(3):
            await c.completions.create(model=st.model, prompt=system + f" w{i}", max_tokens=1)
            await asyncio.sleep(0.5)  # indexed
            # the engine is between requests; the request is looked up, then waits
            assert (await h.post(engine + "/debug/pause", json={"seconds": 0.6})).status_code == 200
            req = asyncio.create_task(
                c.completions.create(model=st.model, prompt=system + f" q{i}", max_tokens=40)
            )
            await asyncio.sleep(0.2)
            r = await h.post(engine + "/reset_prefix_cache")
            assert r.json() == {"success": True}, r.text
            got = await req
            assert got.usage is not None and got.usage.prompt_tokens_details is not None
            assert got.usage.prompt_tokens_details.cached_tokens == 0
        checks = await checked(gw, rep, 6, timeout_s=10.0)
        assert checks["false"] == 0, checks
        assert checks["unverifiable"] == 3, checks
        assert not gw.quarantine.is_quarantined(rep)


class _SeesLookups(RedisIndex):
    """The gateway's index, calling ``after_lookup`` (once, then cleared) after a lookup:
    a rogue agent timing its clear to land between a request's lookup and its check."""

    after_lookup: Callable[[], Awaitable[None]] | None = None

    async def lookup(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int
    ) -> dict[str, PrefixMatch]:
        got = await super().lookup(keys, replicas, now_ms)
        hook, self.after_lookup = self.after_lookup, None
        if hook is not None:
            await hook()
        return got


@pytest.mark.redis
async def test_a_rogue_agent_that_clears_at_will_is_still_quarantined(
    admin: aioredis.Redis,  # noqa: F811
    redis_url: str,
) -> None:
    """D22's bound holds: a rogue (its own ACL user) lies, and after each lookup clears its
    index and writes the lie again, so every check's lookup predates a clear. A clear
    raises its floor to the clear's time, as the rogue could with an HSET: each check is
    ``unverifiable`` and ``max_unverifiable`` of them quarantine it."""
    policy = (
        "quarantine: {missing_fraction: 0.5, k: 2, m: 3, min_claimed_blocks: 2,"
        " recover_after: 2, settle_s: 0.3, max_unverifiable: 3}\n"
        "index: {lookup_timeout_ms: 1000}"  # a busy host's slow first lookup routes by load
    )
    await _user(admin, "gw-rf", gateway_acl_rules())
    gw_index = cast(
        _SeesLookups,
        _SeesLookups.from_url(
            _as(redis_url, "gw-rf"),
            socket_timeout_s=PATIENT_TIMEOUT_S,
            connect_timeout_s=PATIENT_TIMEOUT_S,
        ),
    )  # cls(...)
    async with stack(count=2, policy=policy, build={"index": gw_index}) as st:
        gw, c = st.gw, st.client()
        liar, other = st.replica_id(0), st.replica_id(1)
        await _user(admin, "agent-rf", agent_acl_rules(liar))
        rogue = _index_as(redis_url, "agent-rf")
        honest = _index_as(redis_url)
        try:
            epoch = await rogue.clear_replica(liar, ReplicaState.LIVE, _now())
            await honest.clear_replica(other, ReplicaState.LIVE, _now())
            for i in range(3):
                assert not gw.quarantine.is_quarantined(liar)
                prompt = words(400, 7100 + i)
                lie = IndexWrite({k: G for k in prompt_keys(gw, prompt, st.model)})
                await rogue.apply(liar, epoch, lie, _now())

                async def clear_and_lie_again(lie: IndexWrite = lie) -> None:
                    await asyncio.sleep(0.002)  # the clear's time is after the lookup's
                    new = await rogue.clear_replica(liar, ReplicaState.LIVE, _now())
                    await rogue.apply(liar, new, lie, _now())

                gw_index.after_lookup = clear_and_lie_again
                raw = await c.completions.with_raw_response.create(
                    model=st.model, prompt=prompt, max_tokens=1
                )
                assert raw.headers["x-kvgate-replica"] == liar  # the lie attracts it
                got = await checked(gw, liar, i + 1)
                assert got["unverifiable"] == i + 1, got
                epoch = (await rogue.meta(liar)).epoch
            assert gw.quarantine.is_quarantined(liar)
        finally:
            await rogue.close()
            await honest.close()


def _now() -> int:
    return int(time.time() * 1000)
