"""The gateway's health probe and model read have a deadline for the whole answer (four
per-read timeouts, 2 s at the default 0.5 s; the 300-byte answer here dribbles 60 s): httpx's
timeout is per read, so a replica that sends its answer a byte at a time under it held
``ReplicaPool.check_once``, which gathers every replica, for as long as it dribbled, and
froze the health state (recoveries, unhealthy marks, model refreshes) of the whole pool."""

from __future__ import annotations

import asyncio
import time

import httpx

from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy
from tests.test_h23_f1_startup_reads import engine  # a loopback engine that can dribble


async def test_a_dribbling_health_answer_fails_within_the_timeout() -> None:
    policy = HealthPolicy(timeout_s=0.5, unhealthy_after=1)
    async with (
        engine(dribbles="/health") as slow,
        engine() as fine,
        httpx.AsyncClient() as client,
    ):
        pool = ReplicaPool(client, policy)
        bad = pool.add(ReplicaSpec("slow", slow["url"]))
        good = pool.add(ReplicaSpec("fine", fine["url"]))
        t0 = time.monotonic()
        await asyncio.wait_for(pool.check_once(refresh_models=True), 10)
        took = time.monotonic() - t0
    assert not bad.healthy and good.healthy and good.models == {"m"}
    assert took < 5.0, f"one round took {took:.1f} s with a 0.5 s probe timeout (2 s whole)"


async def test_a_dribbling_models_answer_is_given_up_within_the_timeout() -> None:
    policy = HealthPolicy(timeout_s=0.5)
    async with engine(dribbles="/v1/models") as slow, httpx.AsyncClient() as client:
        pool = ReplicaPool(client, policy)
        rep = pool.add(ReplicaSpec("slow", slow["url"]))
        t0 = time.monotonic()
        await asyncio.wait_for(pool.check_once(refresh_models=True), 10)
        took = time.monotonic() - t0
    assert rep.healthy and rep.models is None  # no model list read: none made up
    assert took < 5.0, f"one round took {took:.1f} s with a 0.5 s probe timeout (2 s whole)"
