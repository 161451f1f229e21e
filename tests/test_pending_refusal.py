"""Pending entries of a request the engine did not take: a real gateway, real simulated
replicas, a real Redis index. At dispatch the gateway marks the request's prefix pending on
its replica; an engine refusal before any prefill (a 4xx), a connect failure or a retry on
another replica must undo that mark, or the scope's next requests are steered (and their
cached tokens predicted) to a replica that never computed the prefix, for the whole
``index.pending_ttl_ms``."""

from __future__ import annotations

import time

import openai
import pytest

from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.keys import Scope, ScopeKind
from cachecore.lifecycle import IndexWrite, Tier
from gateway.core import Gateway
from tests.test_gateway_support import kill_replica, stack, words

pytestmark = pytest.mark.timeout(90)

# a long TTL: without the undo the mark outlives the whole test
POLICY = "index: {pending_ttl_ms: 60000}"


def prompt_keys(gw: Gateway, prompt: str, model: str) -> list[bytes]:
    assert gw.tokenizers is not None
    tokens = gw.tokenizers.local(gw.policy.models.default).segments.encode(prompt)
    salt = gw.minter.salt(Scope(ScopeKind.TENANT, "anonymous"))
    return gw.keyer(gw.policy.models.default.block_size).keys(tokens, salt, model)


async def pending(gw: Gateway, index: PrefixIndex, keys: list[bytes]) -> dict[str, int]:
    """Pending blocks per replica, once the background writes have landed."""
    assert gw.index is not None
    await gw.index.settle()
    ids = [sp.id for sp in gw.specs]
    return {r: m.pending_blocks for r, m in (await index.lookup(keys, ids, _now())).items()}


def _now() -> int:
    return int(time.time() * 1000)


async def test_an_engine_refusal_undoes_the_requests_pending_entries(redis_url: str) -> None:
    """n=2 is a 400 from the engine (before any prefill). Its pending mark stayed for the
    TTL: the same prefix's next request was predicted 400+ cached tokens on that replica
    (the header benchmarks read) and sent there, which had none of it."""
    async with stack(count=2, policy=POLICY, redis_url=redis_url) as st:
        gw, c = st.gw, st.client()
        assert gw.index is not None and gw.index.local is not None
        for sp in gw.specs:  # what their agents would report (none run here)
            await gw.index.primary.set_state(sp.id, ReplicaState.LIVE, _now())
        prompt = words(400, 4100)
        keys = prompt_keys(gw, prompt, st.model)
        assert len(keys) >= 20
        with pytest.raises(openai.BadRequestError):
            await c.completions.create(model=st.model, prompt=prompt, max_tokens=1, n=2)
        # neither the shared index nor the gateway's local copy keeps the mark
        assert set((await pending(gw, gw.index.primary, keys)).values()) == {0}
        assert set((await pending(gw, gw.index.local, keys)).values()) == {0}
        raw = await c.completions.with_raw_response.create(
            model=st.model, prompt=prompt + " more", max_tokens=1
        )
        assert raw.headers["x-kvgate-predicted-cached-tokens"] == "0"
        # an accepted request's mark stays (until its TTL, or its blocks are reported)
        chosen = raw.headers["x-kvgate-replica"]
        for index in (gw.index.primary, gw.index.local):
            marks = await pending(gw, index, keys)
            assert marks[chosen] == len(keys)


async def test_a_refusal_leaves_a_concurrent_requests_entries_alone() -> None:
    """Two requests of one prefix in flight on one replica: the second one's write raised
    the first one's expiry (ZADD GT). When the second is refused, the first (still running
    there) keeps its mark, at its own expiry."""
    async with stack(count=1, policy=POLICY) as st:
        gw = st.gw
        assert gw.index is not None
        rid = st.replica_id(0)
        keys = prompt_keys(gw, words(200, 4200), st.model)
        now = _now()
        first = gw.index.add_pending(rid, keys, 5_000, now)
        second = gw.index.add_pending(rid, keys[:8], 60_000, now + 1)
        assert first is not None and second is not None
        gw.index.withdraw(second, now + 2)
        ids = [rid]
        m = (await gw.index.primary.lookup(keys, ids, now + 3))[rid]
        assert m.pending_blocks == len(keys)  # back to the first request's expiry
        m = (await gw.index.primary.lookup(keys, ids, now + 5_001))[rid]
        assert m.pending_blocks == 0  # not the refused one's
        gw.index.done(first)


async def test_a_retry_on_another_replica_undoes_the_failed_attempts_entries() -> None:
    """The replica the index prefers is dead: the request is retried on the other one and
    answered. The dead one's mark was kept for the TTL, so the prefix kept pointing there
    (predicted cached tokens it does not have) after its engine came back empty."""
    async with stack(count=2, policy=POLICY) as st:
        gw, c = st.gw, st.client()
        assert gw.index is not None
        dead, alive = st.replica_id(0), st.replica_id(1)
        prompt = words(400, 4300)
        keys = prompt_keys(gw, prompt, st.model)
        # the first blocks stored on `dead` (as its agent would report): the request goes
        # there
        index = gw.index.primary
        epoch = (await index.meta(dead)).epoch
        await index.apply(dead, epoch, IndexWrite({k: int(Tier.GPU) for k in keys[:4]}), _now())
        await kill_replica(st.fleet, 0)
        raw = await c.completions.with_raw_response.create(
            model=st.model, prompt=prompt, max_tokens=1
        )
        assert raw.headers["x-kvgate-replica"] == alive
        assert gw.metrics.retries._value.get() >= 1
        marks = await pending(gw, index, keys)
        assert marks[dead] == 4  # its stored blocks only: no pending beyond them
        assert marks[alive] == len(keys) - 1  # its last block holds the last token: unkeyed
