"""Every read of an engine's answer is whole within a deadline and capped as it arrives
(cachecore.httpread.read_answer). The gateway's health probe and model read had the
deadline (four per-read timeouts) but no cap: an engine, or anything at its URL, answering
/v1/models (or /health) with a body that does not end was read into the gateway's memory
for as long as it came within the deadline, every ``models_refresh_s`` (at loopback speed,
hundreds of MiB a round)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import orjson
import pytest

from cachecore.agent.scrape import EngineScraper, ScrapeError
from cachecore.httpread import AnswerTimeout, AnswerTooLarge, read_answer
from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy
from tests.test_h23_f1_startup_reads import engine  # a loopback engine that can flood

pytestmark = pytest.mark.timeout(60)

# what the sockets' buffers may hold beyond a cap (the engine fixture's own allowance)
_BUFFERS = 16 << 20

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def answering(handler: Handler) -> AsyncIterator[str]:
    """A loopback server: ``handler(path, writer)`` writes the answer to each request (a
    bounded number per connection). Yields its URL."""
    tasks: set[asyncio.Task[None]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
                await handler(head.split(b" ", 2)[1], writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(serve(reader, writer))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


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
    async with (
        engine(floods="/health") as flood,
        engine() as fine,
        httpx.AsyncClient() as client,
    ):
        pool = ReplicaPool(client, policy)
        bad = pool.add(ReplicaSpec("flood", flood["url"]))
        good = pool.add(ReplicaSpec("fine", fine["url"]))
        await asyncio.wait_for(pool.check_once(refresh_models=True), 20)
    assert not bad.healthy and good.healthy and good.models == {"m"}
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

    async def answer(path: bytes, writer: asyncio.StreamWriter) -> None:
        page = body if path == b"/v1/models" else b"{}"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(page) + page)

    async with answering(answer) as url, httpx.AsyncClient() as client:
        pool = ReplicaPool(client, HealthPolicy(timeout_s=2.0))
        rep = pool.add(ReplicaSpec("many", url))
        await asyncio.wait_for(pool.check_once(refresh_models=True), 20)
    assert rep.models is not None and len(rep.models) == 5000
    assert rep.lora_base["lora-4999"] == "base"


# ------------------------------------------------------------------ the helper itself
async def test_a_body_over_the_cap_is_refused_as_it_arrives() -> None:
    sent = {"bytes": 0}

    async def floods(path: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * (1 << 16)
        for _ in range(1 << 12):  # 256 MiB at most, with no length said
            writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await writer.drain()
            sent["bytes"] += len(chunk)

    async with answering(floods) as url, httpx.AsyncClient() as client:
        with pytest.raises(AnswerTooLarge, match="answer over 1048576 bytes"):
            await read_answer(client, "GET", url, timeout_s=2.0, deadline_s=20.0, cap=1 << 20)
    assert sent["bytes"] < (1 << 20) + _BUFFERS, sent


async def test_a_dribbled_answer_runs_out_of_its_deadline_not_its_per_read_timeout() -> None:
    async def dribbles(path: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 300\r\n\r\n")
        for _ in range(300):  # 60 s in all, a byte per 0.2 s: each read well in time
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(b" ")

    loop = asyncio.get_running_loop()
    async with answering(dribbles) as url, httpx.AsyncClient() as client:
        t0 = loop.time()
        with pytest.raises(AnswerTimeout, match="no whole answer within 1 s") as caught:
            await read_answer(client, "GET", url, timeout_s=1.0, deadline_s=1.0, cap=1 << 20)
        took = loop.time() - t0
    assert isinstance(caught.value, TimeoutError)  # callers' own deadlines handle it alike
    assert took < 5.0, took


async def test_an_outer_deadline_passes_through_as_its_own() -> None:
    """A caller's shorter deadline is the caller's TimeoutError, not an AnswerTimeout."""

    async def hangs(path: bytes, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(30)

    async with answering(hangs) as url, httpx.AsyncClient() as client:
        with pytest.raises(TimeoutError) as caught:
            async with asyncio.timeout(0.3):
                await read_answer(client, "GET", url, timeout_s=5.0, deadline_s=5.0, cap=100)
    assert not isinstance(caught.value, AnswerTimeout)


@pytest.mark.parametrize("read_unless_ok", [True, False])
async def test_a_refusal_body_is_read_only_when_asked(read_unless_ok: bool) -> None:
    async def refuses(path: bytes, writer: asyncio.StreamWriter) -> None:
        page = b'{"error": {"message": "too long"}}'
        writer.write(
            b"HTTP/1.1 400 Bad Request\r\nretry-after: 3\r\ncontent-length: %d\r\n\r\n%b"
            % (len(page), page)
        )

    async with answering(refuses) as url, httpx.AsyncClient() as client:
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

    async def zipped(path: bytes, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%b"
            % (len(page), page)
        )

    async with answering(zipped) as url, httpx.AsyncClient() as client:
        r = await read_answer(client, "GET", url, timeout_s=2.0, deadline_s=2.0, cap=1 << 20)
        assert r.content == b"0" * (1 << 20) and "content-encoding" not in r.headers
        with pytest.raises(AnswerTooLarge):
            await read_answer(client, "GET", url, timeout_s=2.0, deadline_s=2.0, cap=1 << 19)


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
    async with engine() as eng:  # /metrics is a 404 there
        scraper = EngineScraper(eng["url"], timeout_s=2.0)
        try:
            with pytest.raises(ScrapeError, match="/metrics answered 404"):
                await scraper.metrics()
        finally:
            await scraper.close()
