"""A rerouted request's uncached-token charge (review H157/H158): the tenant is charged the
prediction of the replica that computes the request, not of the one that failed. Replica A
holds a prompt's prefix, so the request is routed there and charged a few tokens; when A
drops it (took it and closed unanswered) or refuses the connection, replica B, which holds
none of it, computes the whole prompt. The charge stayed A's: a tenant whose poison request
made its replicas drop it got whole prompts computed for the price of a cache hit.

Real gateway and simulated replicas on free loopback ports; the failure is injected where
the proxy meets it (the upstream client's post raising what a drop or a refused connect
raises)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.core import Gateway
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(90)

POLICY = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 100000}"


def _ledger(gw: Gateway) -> list[float]:
    """What the tenant budget is charged (+) and given back (-) from now on, in order."""
    moves: list[float] = []
    lim = gw.limiter
    charge, debit, refund = lim.charge_uncached, lim.debit_uncached, lim.refund_uncached

    def on_charge(tenant: str, limits: Any, tokens: float, now: float) -> Any:
        rej = charge(tenant, limits, tokens, now)
        if rej is None:
            moves.append(tokens)
        return rej

    def on_debit(tenant: str, tokens: float, now: float) -> None:
        moves.append(tokens)
        debit(tenant, tokens, now)

    def on_refund(tenant: str, tokens: float, now: float) -> None:
        moves.append(-tokens)
        refund(tenant, tokens, now)

    lim.charge_uncached = on_charge  # type: ignore[method-assign]
    lim.debit_uncached = on_debit  # type: ignore[method-assign]
    lim.refund_uncached = on_refund  # type: ignore[method-assign]
    return moves


def _fail_at(st: Stack, failures: dict[str, list[Exception]]) -> None:
    """Each upstream post to a replica URL in ``failures`` raises the next of its list
    (then posts go through): the exchange as the proxy sees a drop or a refused connect."""
    assert st.gw.upstream is not None
    post = st.gw.upstream.post

    async def failing(url: str, *args: Any, **kw: Any) -> Any:
        pending = failures.get(url)
        if pending:
            raise pending.pop(0)
        return await post(url, *args, **kw)

    st.gw.upstream.post = failing  # type: ignore[method-assign,assignment]


async def _warm(st: Stack, h: httpx.AsyncClient, prompt: str) -> str:
    """Send ``prompt`` once; the replica (its URL) that now holds its prefix."""
    r = await h.post("/v1/completions", json={"model": st.model, "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200, r.text
    rid = r.headers["x-kvgate-replica"]
    return next(rep.url for rep in st.gw.pool.all() if rep.id == rid)  # type: ignore[union-attr]


async def _settled_charge(
    st: Stack, h: httpx.AsyncClient, prompt: str, failures: list[Exception]
) -> tuple[httpx.Response, list[float]]:
    """Warm replica A with ``prompt``'s prefix, then send it with a new tail, A failing as
    ``failures`` say: the answer and the budget moves of that request."""
    a = await _warm(st, h, prompt)
    _fail_at(st, {a: failures})
    moves = _ledger(st.gw)
    body = {"model": st.model, "prompt": prompt + " " + words(20, 99), "max_tokens": 1}
    r = await h.post("/v1/completions", json=body)
    assert moves and moves[0] < 100, moves  # A was chosen for the prefix it holds
    return r, moves


def _computed_whole(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0, usage
    return int(usage["prompt_tokens"])


async def test_a_request_a_replica_dropped_is_charged_both_replicas_work() -> None:
    """A takes the request and closes unanswered (a drop): it may have run its predicted
    few tokens; B computes the whole prompt. The tenant is charged both: A's share then
    B's. It was charged A's predicted few tokens (24 for 920 computed), then the larger
    of the two (920): a drop on a cold prompt made the fleet prefill it twice for once."""
    drop = httpx.RemoteProtocolError("closed unanswered")
    async with stack(count=2, policy=POLICY) as st, st.http() as h:
        r, moves = await _settled_charge(st, h, words(900, 4100), [drop])
        assert sum(moves) == moves[0] + _computed_whole(r), moves


async def test_each_dropping_replica_s_share_is_charged_up_to_the_drop_retries() -> None:
    """With ``drop_retries`` 2, A (holding the prefix) and then B drop the request and C
    computes it: the tenant is charged A's prediction, B's whole prompt and C's (it was
    charged the largest of the three once)."""
    drop = httpx.RemoteProtocolError("closed unanswered")
    async with stack(count=3, policy=POLICY, drop_retries=2) as st, st.http() as h:
        prompt = words(900, 4400)
        a = await _warm(st, h, prompt)
        others = [rep.url for rep in st.gw.pool.all() if rep.url != a]  # type: ignore[union-attr]
        # one drop shared by B and C: whichever is tried first drops it, the other computes it
        second: list[Exception] = [drop]
        _fail_at(st, {a: [drop], others[0]: second, others[1]: second})
        moves = _ledger(st.gw)
        body = {"model": st.model, "prompt": prompt + " " + words(20, 99), "max_tokens": 1}
        r = await h.post("/v1/completions", json=body)
        computed = _computed_whole(r)
        assert not second and len(moves) == 3 and moves[0] < 100, moves  # A's few, then...
        assert moves[1] == moves[2] == computed, moves  # ...B's whole prompt, then C's
        assert sum(moves) == moves[0] + 2 * computed, moves  # it was 921: the largest


async def test_drops_past_the_drop_retries_keep_each_dropping_replica_s_share() -> None:
    """With ``drop_retries`` 1, A and then B drop the request: the 502 keeps both shares
    (A's prediction and B's whole prompt) and C never gets it."""
    drop = httpx.RemoteProtocolError("closed unanswered")
    async with stack(count=3, policy=POLICY, drop_retries=1) as st, st.http() as h:
        prompt = words(900, 4500)
        a = await _warm(st, h, prompt)
        others = [rep.url for rep in st.gw.pool.all() if rep.url != a]  # type: ignore[union-attr]
        _fail_at(st, {a: [drop], others[0]: [drop], others[1]: [drop]})
        moves = _ledger(st.gw)
        body = {"model": st.model, "prompt": prompt + " " + words(20, 99), "max_tokens": 1}
        r = await h.post("/v1/completions", json=body)
        assert r.status_code == 502, r.text
        assert "2 replicas closed" in r.json()["error"]["message"], r.text
        assert len(moves) == 2 and moves[0] < 100 and moves[1] > 900, moves
        assert sum(moves) == moves[0] + moves[1], moves  # nothing given back


async def test_a_request_rerouted_from_a_full_pool_is_charged_the_next_replica_only() -> None:
    """A's connections are all busy (the gateway's own cap: A never gets the request); B
    computes the whole prompt: the charge is B's alone, A's share given back."""
    busy = httpx.PoolTimeout("no connection free")
    async with stack(count=2, policy=POLICY) as st, st.http() as h:
        r, moves = await _settled_charge(st, h, words(900, 4600), [busy])
        assert sum(moves) == _computed_whole(r), moves


async def test_a_request_rerouted_after_a_refused_connect_is_charged_the_next_replicas() -> None:
    """A refuses the connection (it never got the request); B computes the whole prompt:
    the charge becomes B's (it stayed A's)."""
    refused = httpx.ConnectError("connection refused")
    async with stack(count=2, policy=POLICY) as st, st.http() as h:
        r, moves = await _settled_charge(st, h, words(900, 4200), [refused])
        assert sum(moves) == _computed_whole(r), moves


async def test_a_drop_then_nowhere_to_go_keeps_only_what_the_dropping_replica_may_have_run() -> (
    None
):
    """A drops the request, the charge rises to B's prediction, then B refuses the
    connection and no replica is left (the 502): the rise is given back, A's charge kept
    (A may have computed the request; B never got it)."""
    drop = httpx.RemoteProtocolError("closed unanswered")
    refused = httpx.ConnectError("connection refused")
    async with stack(count=2, policy=POLICY) as st, st.http() as h:
        prompt = words(900, 4300)
        a = await _warm(st, h, prompt)
        b = next(rep.url for rep in st.gw.pool.all() if rep.url != a)  # type: ignore[union-attr]
        _fail_at(st, {a: [drop], b: [refused]})
        moves = _ledger(st.gw)
        body = {"model": st.model, "prompt": prompt + " " + words(20, 99), "max_tokens": 1}
        r = await h.post("/v1/completions", json=body)
        assert r.status_code == 502, r.text
        assert len(moves) == 3 and moves[1] > 800, moves  # charged A's, raised to B's...
        assert sum(moves) == moves[0], moves  # ...and back to A's
