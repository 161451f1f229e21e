"""A request's uncached-token charge becomes what its engine computed once it reports its
usage (H207). A Responses follow-up is charged up front its own instructions, tools and
input (the stored chain is the engine's, unseen here, D30); only the engine's prefill
beyond that was debited after, never an excess given back, so an agent repeating a long
system prompt every turn (the OpenAI SDK's agents do), which the engine serves from its
cache, paid the whole instructions each turn and met its budget several times early. Now
the charge is trued to ``prompt - cached`` either way: given back when the engine computed
less (the repeated instructions), debited when it computed more (new instructions
prefill the chain again, H144), in a JSON answer, a stream's terminal event and a
background run's watch end; and as well for any request whose prediction was off.

Real gateway and simulated replicas on free loopback ports; the budget's moves are read
off the limiter (each charge, debit and refund, in order)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest

from gateway.core import Gateway
from tests.test_gateway_support import Stack, stack, words

pytestmark = pytest.mark.timeout(90)

BURST = 3000
# a slow refill (1 token/s): the bucket's level moves by the ledger alone in a test's time
POLICY = (
    "index: {pending_ttl_ms: 1}\n"
    f"default_tenant:\n  limits: {{uncached_tokens_per_s: 1, uncached_tokens_burst: {BURST}}}"
)
INSTRUCTIONS = words(600, 7)  # a long system prompt, repeated every turn


def _ledger(gw: Gateway) -> list[float]:
    """What the tenant budget is charged (+) and given back (-) from now on, in order."""
    moves: list[float] = []
    lim = gw.limiter
    charge, debit, refund = lim.charge_uncached, lim.debit_uncached, lim.refund_uncached

    def on_charge(tenant: str, limits: Any, tokens: float, now: float) -> Any:
        rej = charge(tenant, limits, tokens, now)
        if rej is None and tokens > 0:
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


def _computed(usage: dict[str, Any]) -> int:
    return int(usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"])


async def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # bounded: the deadline
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _turn(
    st: Stack, h: httpx.AsyncClient, moves: list[float], body: dict[str, Any]
) -> tuple[httpx.Response, dict[str, Any], list[float]]:
    """Send ``body`` (a stream's response read off its completed event; a background
    run's once its watch ended): the answer, the response, this request's budget moves."""
    at = len(moves)
    r = await h.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        events = [orjson.loads(b.split(b"data: ", 1)[1]) for b in r.content.split(b"\n\n") if b]
        done = next(e for e in events if e["type"] == "response.completed")["response"]
    elif body.get("background"):
        await _until(lambda: not st.gw._background)  # bounded: the watch ends it
        done = (await h.get(f"/v1/responses/{r.json()['id']}")).json()
    else:
        done = r.json()
    assert done["status"] in ("completed", "incomplete"), done
    return r, done, moves[at:]


async def test_a_chain_repeating_its_instructions_is_charged_what_the_engine_computed() -> None:
    async with stack(count=1, policy=POLICY, background_poll_s=0.05) as st, st.http() as h:
        moves = _ledger(st.gw)
        base = {"model": st.model, "instructions": INSTRUCTIONS, "max_output_tokens": 2}
        _, done, first = await _turn(st, h, moves, {**base, "input": words(10, 1)})
        prev, spent, old_spent = done["id"], sum(first), sum(first)
        old_429_at: int | None = None
        for i in range(10):  # bounded: ten follow-ups, the same instructions
            kind = ("json", "stream", "background")[i % 3]
            body = {**base, "input": words(10, 100 + i), "previous_response_id": prev}
            if kind != "json":
                body[kind] = True
            _, done, mine = await _turn(st, h, moves, body)
            usage = done["usage"]
            up_front, net, computed = mine[0], sum(mine), _computed(usage)
            # the engine served the instructions and the chain from its cache: the charge
            # is what it computed, the excess of the up-front charge given back once
            assert up_front > 600 and usage["input_tokens_details"]["cached_tokens"] > 600
            assert net == computed < 100, (i, kind, mine, usage)
            assert mine == [up_front, computed - up_front], (i, kind, mine)
            spent += net
            old_spent += max(up_front, computed)  # the old rule: never given back
            if old_429_at is None and BURST - old_spent < up_front:
                old_429_at = i + 1  # the next follow-up's up-front charge would not fit
            prev = done["id"]
        # the old rule spent the budget within 4 follow-ups; all 10 ran, about 60 tokens
        # apiece, not the 600-token instructions each time
        assert old_429_at is not None and old_429_at <= 4, (old_429_at, old_spent)
        assert spent < 2 * 620 < BURST <= old_spent, (spent, old_spent)


async def test_new_instructions_prefill_the_chain_again_and_stay_debited() -> None:
    # H144's case (D30): other instructions go first in vLLM's prompt, so the engine
    # prefills the whole stored chain again: debited beyond the up-front charge
    async with stack(count=1, policy=POLICY) as st, st.http() as h:
        moves = _ledger(st.gw)
        base = {"model": st.model, "max_output_tokens": 2}
        _, done, _ = await _turn(st, h, moves, {**base, "input": words(300, 1)})
        body = {**base, "input": "x", "instructions": words(3, 50),
                    "previous_response_id": done["id"]}  # fmt: skip
        _, done, mine = await _turn(st, h, moves, body)
        usage = done["usage"]
        computed = _computed(usage)
        assert computed > 300 and mine[0] < 30, (mine, usage)
        assert mine == [mine[0], computed - mine[0]] and sum(mine) == computed


async def test_a_chat_its_prediction_missed_is_charged_what_the_engine_computed() -> None:
    # the rule holds for every request with a usage report: no agents, so the index
    # predicts nothing (the pending entries expire at once) while the engine caches the
    # first turn: the second is charged whole up front, then trued to its engine's count
    async with stack(count=1, policy=POLICY) as st, st.http() as h:
        moves = _ledger(st.gw)
        msgs = [{"role": "system", "content": words(400, 3)}, {"role": "user", "content": "a"}]
        body = {"model": st.model, "messages": msgs, "max_tokens": 2}
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.05)  # its pending entries expired
        at = len(moves)
        msgs[1]["content"] = "b"
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        computed = u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
        mine = moves[at:]
        assert r.headers.get("x-kvgate-predicted-cached-tokens", "0") == "0"
        assert mine == [u["prompt_tokens"], computed - u["prompt_tokens"]], (mine, u)
        assert 0 < computed < 30 and sum(mine) == computed


async def test_a_run_with_built_in_tools_is_never_given_back() -> None:
    # an engine running built-in tools may loop, and vLLM's experimental parser context
    # reports its last turn's usage alone: the charge is raised to a report, never lowered
    async with stack(count=1, policy=POLICY) as st, st.http() as h:
        moves = _ledger(st.gw)
        body = {"model": st.model, "input": words(400, 4), "max_output_tokens": 2,
                    "tools": [{"type": "web_search"}]}  # fmt: skip
        _, done, _ = await _turn(st, h, moves, body)
        _, done, mine = await _turn(st, h, moves, body)
        assert done["usage"]["input_tokens_details"]["cached_tokens"] > 300, done["usage"]
        assert mine == [done["usage"]["input_tokens"]], mine  # charged whole, kept
