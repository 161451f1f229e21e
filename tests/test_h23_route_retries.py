"""Retries (Gateway.reroute) against a fleet that changed since the request was routed."""

from __future__ import annotations

import pytest

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
