"""A ``models.pools`` entry no replica serves is told at start-up and at a reload (review
R2, O9): the reviewer's `models: {pools: {kvgate-sim-8B: {block_size: 32}}}` (a typo of
kvgate-sim-8b) was applied without a word, while the same block size on `models.default`
was refused: the block-size check skips pools no replica serves, so the pool's settings
(block size, tokenizer, hit_drop_blocks) silently never applied. Real pieces: a gateway on
loopback with two simulated replicas."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(60)


def _told(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(r, "field", ""))
        for r in caplog.records
        if r.name == "gateway.core" and "applies to no model" in r.getMessage()
    ]


async def test_a_pool_no_replica_serves_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.core")
    policy = "models: {pools: {kvgate-sim-8B: {block_size: 16}}}"
    async with stack(count=2, policy=policy) as st, st.http() as h:
        for _ in range(100):  # the start-up checks read the replicas' models: at most 5 s
            if _told(caplog):
                break
            await asyncio.sleep(0.05)
        assert _told(caplog) == ["models.pools.kvgate-sim-8B"]
        record = next(r for r in caplog.records if "applies to no model" in r.getMessage())
        assert st.model in str(getattr(record, "served", ""))
        caplog.clear()
        # a reload: the typo fixed, another one added; the served model's pool is not told
        text = f"models: {{pools: {{{st.model}: {{block_size: 16}}, other-model: {{}}}}}}"
        r = await h.post("/admin/policy", content=text, headers=st.admin_headers())
        assert r.status_code == 200, r.text
        assert _told(caplog) == ["models.pools.other-model"]
        # the same policy's later checks tell nothing again
        await st.gw._check_replica(str(st.gw.replicas_state()[0]["id"]))
        assert _told(caplog) == ["models.pools.other-model"]


async def test_a_policy_whose_pools_are_served_is_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="gateway.core")
    async with stack(count=1, policy="models: {pools: {kvgate-sim-8b: {block_size: 16}}}") as st:
        for _ in range(40):  # the start-up check has run: at most 2 s
            if st.gw._verified:
                break
            await asyncio.sleep(0.05)
        assert st.gw._verified and _told(caplog) == []
