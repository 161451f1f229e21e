"""Engine-side tokenization (``engine_tokenize`` / ``engine_render`` pools) against real
loopback servers: which failures pass over to another replica, and the one deadline that
bounds them all. An engine that is alive but slow was retried like a dead one: three read
timeouts (6 s with the 2 s default) before the client heard anything, with three times the
tokenization load on a fleet that was already slow."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import orjson
import pytest

from cachecore.testing import free_port
from gateway.errors import GatewayError
from gateway.tokenization import EnginePromptTokenizer
from tests.test_gateway_support import stack, words
from tests.test_upstream import json_answer, read_request

pytestmark = pytest.mark.timeout(60)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TOKENS = orjson.dumps({"tokens": [1, 2, 3]})


@asynccontextmanager
async def server(handler: Handler, hits: list[str], name: str) -> AsyncIterator[str]:
    """A loopback HTTP server; each request it reads is recorded in ``hits`` as ``name``."""

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(10):  # bounded: a test sends a request or two per connection
                await read_request(reader)
                hits.append(name)
                await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    finally:
        srv.close()
        await srv.wait_closed()


async def answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(json_answer(TOKENS))
    await writer.drain()


async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(5.0)  # alive, but answers after any test's deadline


async def overloaded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b'{"error": "overloaded"}'
    writer.write(
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()


def in_order(urls: list[str]) -> Callable[[Collection[str]], str | None]:
    """The replica picker: the first URL not tried yet (the gateway's picks at random)."""
    return lambda tried: next((u for u in urls if u not in tried), None)


async def tokenize(urls: list[str], timeout_s: float) -> tuple[list[int] | GatewayError, float]:
    async with httpx.AsyncClient() as client:
        tok = EnginePromptTokenizer("tokenize", client, in_order(urls), timeout_s)
        t0 = time.monotonic()
        try:
            got: list[int] | GatewayError = await tok.completion({"prompt": "hi"}, "salt")
        except GatewayError as exc:
            got = exc
        return got, time.monotonic() - t0


async def test_a_slow_engine_is_a_504_within_one_timeout_not_retried() -> None:
    hits: list[str] = []
    async with AsyncExitStack() as ex:
        urls = [await ex.enter_async_context(server(slow, hits, f"s{i}")) for i in range(3)]
        got, took = await tokenize(urls, 1.0)
    assert isinstance(got, GatewayError) and got.status == 504, got
    assert hits == ["s0"]  # one slow engine asked, not three
    # the old worst case: 3 x 1 s; the bound leaves a busy host 1 s past the deadline (with
    # a 0.4 s deadline and a 0.8 s bound it had 0.4 s)
    assert took < 2.0, took


async def test_a_slow_first_replica_is_not_passed_over_for_a_fast_one() -> None:
    """The deadline is the client's: a slow engine is not raced against the others."""
    hits: list[str] = []
    async with AsyncExitStack() as ex:
        urls = [
            await ex.enter_async_context(server(slow, hits, "slow")),
            await ex.enter_async_context(server(answers, hits, "fast")),
        ]
        got, _ = await tokenize(urls, 0.3)
    assert isinstance(got, GatewayError) and got.status == 504
    assert hits == ["slow"]


async def test_a_connect_timeout_that_spends_the_deadline_is_a_504() -> None:
    """A replica whose listen queue is full (the SYN goes unanswered) times out connecting:
    passed over as unreachable, but it spent the whole deadline, so the client hears a
    timeout, not a second attempt."""
    full = socket.socket()
    fillers: list[socket.socket] = []
    try:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        for _ in range(3):  # fill the accept queue (never accepted)
            s = socket.socket()
            fillers.append(s)
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(full.getsockname())
        hits: list[str] = []
        async with server(answers, hits, "ok") as ok:
            url = f"http://127.0.0.1:{full.getsockname()[1]}"
            got, took = await tokenize([url, ok], 0.3)
        assert isinstance(got, GatewayError) and got.status == 504, got
        # a second attempt shows in hits; the bound (one connect timeout, not an unbounded
        # one) leaves a busy host over 1 s past the 0.3 s deadline
        assert hits == [] and took < 1.5, (hits, took)
    finally:
        for s in [*fillers, full]:
            s.close()


async def drops(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()  # a reset, no answer


async def test_a_replica_that_drops_the_connection_is_passed_over() -> None:
    hits: list[str] = []
    async with AsyncExitStack() as ex:
        urls = [
            await ex.enter_async_context(server(drops, hits, "drop")),
            await ex.enter_async_context(server(answers, hits, "ok")),
        ]
        got, _ = await tokenize(urls, 2.0)
    assert got == [1, 2, 3] and hits == ["drop", "ok"]


async def test_unreachable_and_failing_replicas_are_passed_over_within_the_deadline() -> None:
    hits: list[str] = []
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect refused
    async with AsyncExitStack() as ex:
        urls = [
            dead,
            await ex.enter_async_context(server(overloaded, hits, "503")),
            await ex.enter_async_context(server(answers, hits, "ok")),
        ]
        got, took = await tokenize(urls, 2.0)
        assert got == [1, 2, 3] and hits == ["503", "ok"] and took < 2.0
        # every attempt a 5xx: the last one's answer; a 503 is relayed as the engine's
        # 503 in its words (the client retries it), as the proxy relays it
        hits.clear()
        got, _ = await tokenize([dead, urls[1]], 2.0)
    assert isinstance(got, GatewayError) and got.status == 503 and got.message == "overloaded"
    assert hits == ["503"]


async def test_the_gateway_answers_a_slow_engine_tokenizer_with_one_504() -> None:
    """End to end: an engine-tokenized pool whose replicas all tokenize slowly (the engine
    is alive: health checks and completions answer) gets one 504 within the tokenization
    timeout, with the OpenAI error shape."""
    policy = "models: {default: {tokenizer: engine_tokenize}}"
    async with stack(count=2, policy=policy) as st:
        assert st.gw.tokenizers is not None
        hits: list[str] = []
        async with AsyncExitStack() as ex:
            urls = [await ex.enter_async_context(server(slow, hits, f"s{i}")) for i in range(3)]
            pick = in_order(urls)
            st.gw.tokenizers._replica_url = lambda model, tried: pick(tried)
            async with httpx.AsyncClient(base_url=st.url, timeout=30.0) as h:
                t0 = time.monotonic()
                r = await h.post(
                    "/v1/completions",
                    json={"model": st.model, "prompt": words(20, 7), "max_tokens": 1},
                )
                took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "timeout"
        assert hits == ["s0"] and took < 3.5  # one 2 s timeout, not three
