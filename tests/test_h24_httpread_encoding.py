"""An engine's answer is inflated under its cap: ``read_answer`` asks for identity, and a
body compressed all the same is decoded at most a cap's worth at a time. httpx's decoders
inflated each network read whole before the cap could see it: a 64 KiB ``/health`` cap let
~64 KB of gzip inflate to 64 MiB, per replica and per health round (the reviewer's gzip
bomb: +133 MiB peak RSS)."""

from __future__ import annotations

import asyncio
import gzip
import tracemalloc

import httpx
import pytest

from cachecore.httpread import AnswerTooLarge, read_answer
from tests.test_upstream import Handler, server

pytestmark = pytest.mark.timeout(60)

BOMB = gzip.compress(bytes(64 << 20), compresslevel=9)  # 64 MiB of zeros, ~64 KB on the wire


def engine(gzip_always: bool, heads: list[bytes]) -> Handler:
    """Answers a GET with 64 MiB of zeros, gzip-encoded when ``gzip_always`` (whatever the
    client accepts), else plain; appends the request heads it read to ``heads``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        if gzip_always:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n"
                % len(BOMB)
            )
            writer.write(BOMB)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (64 << 20))
            for _ in range(64):
                writer.write(bytes(1 << 20))
                await writer.drain()
        await writer.drain()

    return serve


async def _peak_of_read(url: str) -> tuple[BaseException, int]:
    async with httpx.AsyncClient() as client:
        tracemalloc.start()
        try:
            try:
                await read_answer(
                    client, "GET", url + "/health", timeout_s=5.0, deadline_s=10.0, cap=64 << 10
                )
            except (AnswerTooLarge, httpx.HTTPError) as exc:
                caught: BaseException = exc
            else:
                raise AssertionError("a 64 MiB answer was read under a 64 KiB cap")
            return caught, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()


async def test_a_gzip_bomb_is_refused_before_it_inflates() -> None:
    heads: list[bytes] = []
    async with server(engine(True, heads)) as (url, _):
        exc, peak = await _peak_of_read(url)
    assert peak < 8 << 20, peak  # before: ~64 MiB inflated from one read
    assert isinstance(exc, AnswerTooLarge)
    assert b"accept-encoding: identity" in heads[0].lower()


async def test_an_encoding_it_cannot_decode_is_one_clear_error() -> None:
    async def brotli(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-encoding: br\r\ncontent-length: 3\r\n\r\nabc")
        await writer.drain()

    async with server(brotli) as (url, _), httpx.AsyncClient() as client:
        with pytest.raises(httpx.DecodingError, match="encoding not asked for: br"):
            await read_answer(client, "GET", url, timeout_s=5, deadline_s=5, cap=1024)


async def test_a_plain_answer_over_the_cap_is_still_refused_as_it_arrives() -> None:
    async with server(engine(False, [])) as (url, _):
        exc, peak = await _peak_of_read(url)
    assert isinstance(exc, AnswerTooLarge)
    assert peak < 8 << 20, peak
