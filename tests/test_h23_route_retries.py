"""Retries (Gateway.reroute) against a fleet that changed since the request was routed."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import GatewayError
from tests.test_upstream_faults import FakeReplica, completion, gateway

pytestmark = pytest.mark.timeout(60)


async def test_a_retry_goes_to_no_replica_taken_out_of_service() -> None:
    """The request's replica fails to connect, and the only other one was cordoned,
    drained or removed since the request was routed: the retry used to go there anyway
    (any candidate when none was routable), against the cordon's "no new requests"; it
    now ends with the failed connect's 502."""
    for out_of_service in ("cordon", "drain", "remove"):
        reps = [FakeReplica() for _ in range(2)]
        async with gateway(reps) as (gw, _):
            assert gw.pool is not None
            d = await gw.prepare("completion", "anonymous", completion(), {}, "r", True)
            other = next(r.id for r in gw.pool.all() if r.id != d.replica)
            getattr(gw.pool, out_of_service)(other)
            assert not gw.reroute(d, d.replica), (out_of_service, d.replica)


@pytest.mark.parametrize("out_of_service", ["cordon", "drain", "remove"])
@pytest.mark.parametrize("victim", [0, 1])
async def test_a_replica_taken_out_during_the_lookup_is_not_routed_to(
    out_of_service: str, victim: int
) -> None:
    """The operator cordons (or drains, or removes) a replica while a request's prompt is
    being looked up in the index: the request was routed over the replicas read before
    that await, so the cordoned one could still get it; the fleet is read again after.
    (Round robin's first pick is the first replica: one of the two victims is it.)"""
    reps = [FakeReplica() for _ in range(2)]
    async with gateway(reps, "routing: {strategy: round_robin}") as (gw, _):
        assert gw.pool is not None and gw.index is not None
        pool, index = gw.pool, gw.index
        gone = [r.id for r in pool.all()][victim]
        real = index.lookup

        async def lookup_while_taken_out(*args: Any, **kw: Any) -> Any:
            getattr(pool, out_of_service)(gone)  # while the lookup is in flight
            return await real(*args, **kw)

        index.lookup = lookup_while_taken_out  # type: ignore[method-assign]
        body = completion("a prompt long enough to have block keys " * 10)
        d = await gw.prepare("completion", "anonymous", body, {}, "r", True)
        assert d.index_source != "none"  # the lookup ran
        assert d.replica != gone


async def test_the_only_replica_cordoned_during_the_lookup_is_a_503() -> None:
    """With nothing routable left after the lookup the request is refused as it would
    have been had the cordon come first (503 no_replica), not sent to the cordoned one."""
    async with gateway([FakeReplica()]) as (gw, _):
        assert gw.pool is not None and gw.index is not None
        pool, index = gw.pool, gw.index
        only = pool.all()[0].id
        real = index.lookup

        async def lookup_while_cordoning(*args: Any, **kw: Any) -> Any:
            pool.cordon(only)
            return await real(*args, **kw)

        index.lookup = lookup_while_cordoning  # type: ignore[method-assign]
        body = completion("a prompt long enough to have block keys " * 10)
        with pytest.raises(GatewayError) as err:
            await gw.prepare("completion", "anonymous", body, {}, "r", True)
        assert (err.value.status, err.value.code) == (503, "no_replica")
