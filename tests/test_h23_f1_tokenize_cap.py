"""An engine-tokenized pool's tokenize (or render) answer is read up to a cap (64 MiB):
an answer that did not end was read into the gateway's memory for as long as the
tokenization deadline let it come, for every request of the pool. A gzip-encoded answer
is read as before."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

import httpx
import orjson
import pytest

from gateway.errors import GatewayError
from gateway.tokenization import EnginePromptTokenizer
from tests.test_tokenize_retries import in_order, server

pytestmark = pytest.mark.timeout(60)


async def tokenize(url: str, timeout_s: float) -> list[int] | GatewayError:
    async with httpx.AsyncClient() as client:
        tok = EnginePromptTokenizer("tokenize", client, in_order([url]), timeout_s)
        try:
            return await tok.completion({"prompt": "hi"}, "salt")
        except GatewayError as exc:
            return exc


async def test_an_endless_tokenize_answer_is_read_no_further_than_the_cap() -> None:
    sent = {"bytes": 0}

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (1 << 28))
        chunk = b"1," * (1 << 15)
        for _ in range(1 << 12):  # 256 MiB at most
            writer.write(chunk)
            await writer.drain()
            sent["bytes"] += len(chunk)

    hits: list[str] = []
    async with server(floods, hits, "flood") as url:
        got = await tokenize(url, 20.0)
    assert isinstance(got, GatewayError) and got.status == 502, got
    assert "over" in got.message
    # the cap (64 MiB) and what the socket buffers hold; 256 MiB were on offer
    assert sent["bytes"] < (64 << 20) + (16 << 20), sent


async def test_a_gzip_encoded_tokenize_answer_is_read() -> None:
    async def zipped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = gzip.compress(orjson.dumps({"tokens": [4, 5, 6]}))
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        await writer.drain()

    hits: list[str] = []
    async with server(zipped, hits, "gz") as url:
        got: Any = await tokenize(url, 5.0)
    assert got == [4, 5, 6]
