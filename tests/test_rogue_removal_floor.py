"""docs/security.md (quarantine), D22: a rogue agent's removal-log floor is no alibi.
The removal log's floor, rm_floor, sits in the agent's own meta, which its ACL lets it
write: raised, every removal-log read of its replica answers "cannot tell". Those checks
used to be skipped, so the rogue was never judged false. Now a floor no honest log can have
counts as no removal (``tampered``, a false claim) and a possible one as ``unverifiable``
(``quarantine.max_unverifiable`` in a row quarantine). Real redis-server, real ACL users,
real gateway and simulated engines."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from cachecore.index.base import RemovalFloor, ReplicaState
from cachecore.index.layout import (
    KeyLayout,
    acl_setuser_args,
    agent_acl_rules,
    gateway_acl_rules,
)
from cachecore.index.redis import RedisIndex
from cachecore.lifecycle import IndexWrite, Tier
from cachecore.testing import PATIENT_TIMEOUT_S
from gateway.quarantine import LogAnswer, judge_floor
from tests.test_gateway_faults import checked, prompt_keys
from tests.test_gateway_support import stack, words

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]
USERS = ("agent-rf", "gw-rf")
LAYOUT = KeyLayout()


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    left = [k async for k in client.scan_iter("kvg:*")]
    if left:
        await client.delete(*left)
    for user in await client.acl_users():
        if user != "default":
            await client.execute_command("ACL", "DELUSER", user)  # type: ignore[no-untyped-call]
    await client.aclose()


def _as(redis_url: str, user: str) -> str:
    return redis_url.replace("redis://", f"redis://{user}:pw-{user}-1@")


def _index_as(redis_url: str, user: str | None = None) -> RedisIndex:
    """The index as ACL user ``user`` (None: the default user), with patient timeouts."""
    url = redis_url if user is None else _as(redis_url, user)
    return RedisIndex.from_url(
        url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )


async def _user(admin: aioredis.Redis, user: str, rules: list[str]) -> None:
    await admin.execute_command(*acl_setuser_args(user, f"pw-{user}-1", rules))  # type: ignore[no-untyped-call]


def _now() -> int:
    return int(time.time() * 1000)


async def test_a_raised_floor_is_read_back_and_judged(
    admin: aioredis.Redis, redis_url: str
) -> None:
    """The index side: the log still says "cannot tell" (it cannot), but the gateway can
    read the floor it rests on, and a floor past the agent's own latest write is tampered."""
    for user, rules in zip(USERS, (agent_acl_rules("rf"), gateway_acl_rules()), strict=True):
        await _user(admin, user, rules)
    agent = _index_as(redis_url, "agent-rf")
    gateway = _index_as(redis_url, "gw-rf")
    raw_agent = aioredis.Redis.from_url(_as(redis_url, "agent-rf"))
    key = b"r" * 16
    meta = LAYOUT.meta("rf")
    try:
        epoch = await agent.clear_replica("rf", ReplicaState.LIVE, 1_000)
        await agent.apply("rf", epoch, IndexWrite({key: 1}, seq=1), 2_000)
        await agent.apply("rf", epoch, IndexWrite({key: 0}, seq=2, removed={key}), 3_000)
        # an honest log answers: removed at 3000, after 2500
        assert await gateway.removed_since("rf", [key], 2_500) == [True]
        assert await gateway.removal_floor("rf") == RemovalFloor(1_000, 3_000)  # the clear's
        # the agent raises its own floor (its ACL allows it): "cannot tell", every time...
        await raw_agent.hset(meta, "rm_floor", 10**15)
        assert await gateway.removed_since("rf", [key], 2_500) is None
        # ...at a floor later than anything the agent ever wrote: no honest log's
        floor = await gateway.removal_floor("rf")
        assert floor == RemovalFloor(10**15, 3_000)
        assert judge_floor(floor, _now(), 250) is LogAnswer.TAMPERED
        # updated_ms raised with it: still later than the gateway's clock
        await raw_agent.hset(meta, "updated_ms", 10**15)
        assert judge_floor(await gateway.removal_floor("rf"), _now(), 250) is LogAnswer.TAMPERED
        # a floor at the agent's "now" is one an honest log trimmed that fast could have
        now = _now()
        await raw_agent.hset(meta, mapping={"rm_floor": now, "updated_ms": now})
        assert await gateway.removed_since("rf", [key], now - 250) is None
        got = judge_floor(await gateway.removal_floor("rf"), now, 250)
        assert got is LogAnswer.UNVERIFIABLE
        # what no agent writes: "cannot tell" (not a script error the gateway would take for
        # its own failure), and the floor reads as tampered
        for junk in (b"x", b"inf", b"1e20"):
            await raw_agent.hset(meta, "rm_floor", junk)
            assert await gateway.removed_since("rf", [key], 2_500) is None
            assert judge_floor(await gateway.removal_floor("rf"), _now(), 250) is LogAnswer.TAMPERED
        await raw_agent.hset(meta, mapping={"rm_floor": -1, "updated_ms": b"soon"})
        assert judge_floor(await gateway.removal_floor("rf"), _now(), 250) is LogAnswer.TAMPERED
        # a removal log that is no sorted set: "cannot tell", not an error
        await raw_agent.hset(meta, mapping={"rm_floor": -1, "updated_ms": 3_000})
        await raw_agent.delete(LAYOUT.removals("rf", epoch))
        await raw_agent.hset(LAYOUT.removals("rf", epoch), "x", 1)
        assert await gateway.removed_since("rf", [key], 2_500) is None
    finally:
        await raw_agent.aclose()
        await agent.close()
        await gateway.close()


POLICY = (
    "quarantine: {missing_fraction: 0.5, k: 2, m: 3, min_claimed_blocks: 2, recover_after: 2,"
    " settle_s: 0.3, max_unverifiable: 3}\n"
    # the lookups must answer for the lie to attract the request and the check to judge:
    # the default 5 ms budget ran out on a busy 2-core host (routed by load: the test read
    # the request going elsewhere, about twice in eight runs there)
    "index: {lookup_timeout_ms: 1000}"
)


async def _rogue_is_quarantined(
    admin: aioredis.Redis,
    redis_url: str,
    cover: Callable[[aioredis.Redis, str, int, list[bytes]], Awaitable[None]],
    outcome: str,
    lies: int,
) -> None:
    """A rogue agent with its own ACL user lies about its replica before each request and
    ``cover``s the lie with what its ACL lets it write (its meta, its removal log); the
    gateway reads the index as its own ACL user."""
    await _user(admin, "gw-rf", gateway_acl_rules())
    gw_index = _index_as(redis_url, "gw-rf")
    async with stack(count=2, policy=POLICY, build={"index": gw_index}) as st:
        gw, c = st.gw, st.client()
        liar, other = st.replica_id(0), st.replica_id(1)
        await _user(admin, "agent-rf", agent_acl_rules(liar))
        rogue = _index_as(redis_url, "agent-rf")
        rogue_raw = aioredis.Redis.from_url(_as(redis_url, "agent-rf"))
        honest = _index_as(redis_url)
        try:
            # cleared a second ago: a clear is its log's floor (R5), and one within
            # clock_skew_ms of a lookup leaves it "cannot tell"
            epoch = await rogue.clear_replica(liar, ReplicaState.LIVE, _now() - 1_000)
            await honest.clear_replica(other, ReplicaState.LIVE, _now() - 1_000)
            for i in range(lies):
                assert not gw.quarantine.is_quarantined(liar)
                prompt = words(400, 7000 + i)
                keys = prompt_keys(gw, prompt, st.model)
                await rogue.apply(liar, epoch, IndexWrite({k: int(Tier.GPU) for k in keys}), _now())
                await cover(rogue_raw, liar, epoch, keys)
                raw = await c.completions.with_raw_response.create(
                    model=st.model, prompt=prompt, max_tokens=1
                )
                assert raw.headers["x-kvgate-replica"] == liar  # the lie attracts it
                got = await checked(gw, liar, i + 1)
                assert got[outcome] == i + 1, got  # was "skipped": judged nothing
            assert gw.quarantine.is_quarantined(liar)
            # while quarantined the lies steer nothing (route by load only): unchanged
            body = {"model": st.model, "prompt": words(400, 7000), "max_tokens": 1}
            d = await gw.prepare("completion", "anonymous", body, {}, "explain", explain_only=True)
            score = next(s for s in d.decision.scores if s.replica == liar)
            assert score.note == "quarantined" and score.matched_blocks == 0
        finally:
            await rogue_raw.aclose()
            await rogue.close()
            await honest.close()


async def _raise_floor(raw: aioredis.Redis, replica: str, epoch: int, keys: list[bytes]) -> None:
    await raw.hset(LAYOUT.meta(replica), "rm_floor", 10**15)


async def _floor_at_now(raw: aioredis.Redis, replica: str, epoch: int, keys: list[bytes]) -> None:
    # the cleverer rogue: a floor an honest log could have, kept just ahead of each lookup
    now = _now() + 200
    await raw.hset(LAYOUT.meta(replica), mapping={"rm_floor": now, "updated_ms": now})


async def _removed_in_the_future(
    raw: aioredis.Redis, replica: str, epoch: int, keys: list[bytes]
) -> None:
    # R1: rm_floor left alone; each lied-about key "removed" far ahead, one ZADD, good
    # forever (every check read evicted_restored, and never quarantined)
    await raw.zadd(LAYOUT.removals(replica, epoch), dict.fromkeys(keys, 10**15))


async def test_a_rogue_agent_that_raises_its_floor_is_quarantined(
    admin: aioredis.Redis, redis_url: str
) -> None:
    """A floor past anything the agent wrote is no honest log's: each such check is a
    false claim (``tampered``), and K of them quarantine as any false claims do."""
    await _rogue_is_quarantined(admin, redis_url, _raise_floor, "tampered", lies=2)


async def test_a_rogue_agent_that_keeps_a_plausible_floor_is_quarantined(
    admin: aioredis.Redis, redis_url: str
) -> None:
    """A floor kept at the agent's "now" is possible for an honest log trimmed that fast:
    the checks are ``unverifiable``, and max_unverifiable of them in a row quarantine."""
    await _rogue_is_quarantined(admin, redis_url, _floor_at_now, "unverifiable", lies=3)


async def test_a_rogue_agent_that_dates_its_removals_in_the_future_is_quarantined(
    admin: aioredis.Redis, redis_url: str
) -> None:
    """R1: the removal log's times are the agent's as its floor is; a removal later than
    the gateway's clock (beyond tamper_margin_ms) excuses nothing: ``tampered``."""
    await _rogue_is_quarantined(admin, redis_url, _removed_in_the_future, "tampered", lies=2)
