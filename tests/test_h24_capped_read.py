"""Every read of an engine's answer is whole within a deadline and capped as it arrives
(cachecore.httpread.read_answer). The gateway's health probe and model read had the
deadline (four per-read timeouts) but no cap: an engine, or anything at its URL, answering
/v1/models (or /health) with a body that does not end was read into the gateway's memory
for as long as it came within the deadline, every ``models_refresh_s`` (at loopback speed,
hundreds of MiB a round)."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import orjson
import pytest

from cachecore.agent.scrape import EngineScraper, ScrapeError
from cachecore.httpread import AnswerTimeout, AnswerTooLarge, read_answer
from gateway.errors import GatewayError
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.tokenization import EnginePromptTokenizer
from policies.schema import HealthPolicy
from tests.test_h23_f1_startup_reads import engine  # a loopback engine that can flood
from tests.test_tokenize_retries import in_order
from tests.test_upstream import json_answer, read_request, server

pytestmark = pytest.mark.timeout(60)

# what the sockets' buffers may hold beyond a cap (the engine fixture's own allowance)
_BUFFERS = 16 << 20


async def _flood(writer: asyncio.StreamWriter, head: bytes, sent: dict[str, int]) -> None:
    """``head``, then a body that does not end: 64 KiB chunks (chunked framing when the
    head says so) as fast as they are read, 256 MiB at most, counted in ``sent``."""
    writer.write(head)
    chunk = b"#" * (1 << 16)
    if b"chunked" in head:
        chunk = b"%x\r\n%b\r\n" % (len(chunk), chunk)
    for _ in range(1 << 12):
        writer.write(chunk)
        await writer.drain()
        sent["bytes"] += 1 << 16


async def _dribbles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A 300-byte answer, a byte per 0.2 s (60 s in all): each read well in time."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 300\r\n\r\n")
    for _ in range(300):
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"1")


# ------------------------------------------------------------------ the gateway's reads
async def test_an_endless_models_answer_is_read_no_further_than_the_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The defect: ``_models`` read all 256 MiB on offer (2 s per-read timeout, 8 s whole).
    A list never read is asked for again every round: said once, read to the cap each."""
    policy = HealthPolicy(timeout_s=2.0)
    async with engine(floods="/v1/models") as eng, httpx.AsyncClient() as client:
        pool = ReplicaPool(client, policy)
        rep = pool.add(ReplicaSpec("flood", eng["url"]))
        for _ in range(2):
            await asyncio.wait_for(pool.check_once(), 20)
    assert rep.healthy and rep.models is None  # no model list read: none made up
    # the cap (8 MiB) and what the socket buffers hold, twice; 512 MiB were on offer
    assert eng["sent"] < 2 * ((8 << 20) + _BUFFERS), eng["sent"]
    warned = [r for r in caplog.records if "/v1/models too large" in r.getMessage()]
    assert len(warned) == 1, warned


async def test_an_endless_health_answer_is_a_failed_probe_read_no_further_than_the_cap() -> None:
    """It was read whole (256 MiB within 8 s at loopback speed) and counted healthy."""
    policy = HealthPolicy(timeout_s=2.0, unhealthy_after=1)
    async with engine(floods="/health") as flood, httpx.AsyncClient() as client:
        pool = ReplicaPool(client, policy)
        rep = pool.add(ReplicaSpec("flood", flood["url"]))
        await asyncio.wait_for(pool.check_once(refresh_models=True), 20)
    assert not rep.healthy and rep.models is None
    # the cap (64 KiB) and what the socket buffers hold
    assert flood["sent"] < (64 << 10) + _BUFFERS, flood["sent"]


async def test_a_models_answer_under_the_cap_is_read_whole() -> None:
    """Many adapters make a long list: 5,000 cards (~0.5 MiB) are all read."""
    cards = [
        {
            "id": f"lora-{i}",
            "object": "model",
            "parent": "base",
            "root": "base",
            "permission": [{"id": f"perm-{i}", "allow_sampling": True}],
        }
        for i in range(5000)
    ]
    body = orjson.dumps({"object": "list", "data": cards})

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(10):  # bounded: a round sends two requests
            head = await read_request(reader)
            writer.write(json_answer(body if b" /v1/models " in head else b"{}"))
            await writer.drain()

    async with server(answer) as (url, _), httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy(timeout_s=2.0))
        rep = pool.add(ReplicaSpec("many", url))
        await asyncio.wait_for(pool.check_once(refresh_models=True), 20)
    assert rep.models is not None and len(rep.models) == 5000
    assert rep.lora_base["lora-4999"] == "base"


# ------------------------------------------------------------------ the helper itself
async def test_a_body_over_the_cap_is_refused_as_it_arrives() -> None:
    sent = {"bytes": 0}

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # no length said
        await _flood(writer, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", sent)

    async with server(floods) as (url, _), httpx.AsyncClient() as client:
        with pytest.raises(AnswerTooLarge, match="answer over 1048576 bytes"):
            await read_answer(client, "GET", url, timeout_s=2.0, deadline_s=20.0, cap=1 << 20)
    assert sent["bytes"] < (1 << 20) + _BUFFERS, sent


async def test_a_dribbled_answer_runs_out_of_its_deadline_not_its_per_read_timeout() -> None:
    loop = asyncio.get_running_loop()
    async with server(_dribbles) as (url, _), httpx.AsyncClient() as client:
        t0 = loop.time()
        with pytest.raises(AnswerTimeout, match="no whole answer within 1 s") as caught:
            await read_answer(client, "GET", url, timeout_s=1.0, deadline_s=1.0, cap=1 << 20)
        took = loop.time() - t0
    assert isinstance(caught.value, TimeoutError)  # callers' own deadlines handle it alike
    assert took < 5.0, took


async def test_an_outer_deadline_passes_through_as_its_own() -> None:
    """A caller's shorter deadline is the caller's TimeoutError, not an AnswerTimeout."""

    async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # no answer: until the client gives up and closes

    async with server(hangs) as (url, _), httpx.AsyncClient() as client:
        with pytest.raises(TimeoutError) as caught:
            async with asyncio.timeout(0.3):
                await read_answer(client, "GET", url, timeout_s=5.0, deadline_s=5.0, cap=100)
    assert not isinstance(caught.value, AnswerTimeout)


@pytest.mark.parametrize("read_unless_ok", [True, False])
async def test_a_refusal_body_is_read_only_when_asked(read_unless_ok: bool) -> None:
    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        page = b'{"error": {"message": "too long"}}'
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\nretry-after: 3\r\ncontent-length: %d\r\n\r\n%b"
            % (len(page), page)
        )

    async with server(refuses) as (url, _), httpx.AsyncClient() as client:
        r = await read_answer(
            client,
            "POST",
            url,
            json={"prompt": "hi"},
            timeout_s=2.0,
            deadline_s=2.0,
            cap=1 << 10,
            read_unless_ok=read_unless_ok,
        )
    assert r.status_code == 400 and r.headers["retry-after"] == "3"
    assert r.content == (b'{"error": {"message": "too long"}}' if read_unless_ok else b"")


async def test_a_gzip_answer_is_decoded_and_capped_as_decoded() -> None:
    """The cap counts what the body decodes to: 1 MiB of zeros is ~1 KiB on the wire."""
    page = gzip.compress(b"0" * (1 << 20))

    async def zipped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):  # the test's two requests, on one connection or two
            await read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%b"
                % (len(page), page)
            )
            await writer.drain()

    async with server(zipped) as (url, _), httpx.AsyncClient() as client:
        r = await read_answer(client, "GET", url, timeout_s=2.0, deadline_s=2.0, cap=1 << 20)
        assert r.content == b"0" * (1 << 20) and "content-encoding" not in r.headers
        with pytest.raises(AnswerTooLarge):
            await read_answer(client, "GET", url, timeout_s=2.0, deadline_s=2.0, cap=1 << 19)


# ------------------------------------------------------------------ the tokenize answer
async def test_a_dribbled_tokenize_answer_is_a_504_within_the_deadline() -> None:
    """The helper's deadline is a TimeoutError: the client hears the tokenization's own
    504, not a 502 or an internal error."""

    loop = asyncio.get_running_loop()
    async with server(_dribbles) as (url, _), httpx.AsyncClient() as client:
        tok = EnginePromptTokenizer("tokenize", client, in_order([url]), 1.0)
        t0 = loop.time()
        with pytest.raises(GatewayError) as caught:
            await tok.completion({"prompt": "hi"}, "salt")
        took = loop.time() - t0
    assert caught.value.status == 504 and "timed out" in caught.value.message, caught.value
    assert took < 5.0, took


# ------------------------------------------------------------------ the agent's scrape
async def test_an_endless_metrics_page_is_a_scrape_error_read_no_further_than_the_cap() -> None:
    """The agent's scrape was capped before (8 MiB); it reads through the helper now."""
    async with engine(floods="/metrics") as eng:
        scraper = EngineScraper(eng["url"], timeout_s=5.0)
        try:
            with pytest.raises(ScrapeError, match="/metrics larger than 8388608 bytes"):
                await scraper.metrics()
            assert await scraper.model() == "m"  # the small reads go on
            assert await scraper.healthy()
        finally:
            await scraper.close()
    assert eng["sent"] < (8 << 20) + _BUFFERS, eng["sent"]


async def test_a_scrape_refused_with_a_status_is_not_read() -> None:
    """A 404 whose body does not end: the status is the answer, the body left unread."""
    sent = {"bytes": 0}

    async def refuses(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await _flood(
            writer, b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n" % (1 << 28), sent
        )

    async with server(refuses) as (url, _):
        scraper = EngineScraper(url, timeout_s=5.0)
        try:
            with pytest.raises(ScrapeError, match="/metrics answered 404"):
                await scraper.metrics()
        finally:
            await scraper.close()
    assert sent["bytes"] < _BUFFERS, sent
