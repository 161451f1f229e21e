"""Review R-C of the whole-answer bound (H193, c33da89).

* The usual JSON answer (whole with its head) reads as before the bound: no header looked
  up for its length (it is what arrived), and a chunked one is joined once.

The transport's answer objects, as the relay reads them."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.upstream import LeanTransport, UpstreamResponse, _Body, _Conn
from tests.test_h193_body_bound import completion

pytestmark = pytest.mark.timeout(60)

LIMIT = 1024 * 1024


class _Unread(list[tuple[bytes, bytes]]):
    """Response headers that fail the test when looked through."""

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        raise AssertionError("headers looked up")


def _response(chunks: list[bytes], complete: bool, headers: list[tuple[bytes, bytes]]) -> Any:
    conn = _Conn(asyncio.get_running_loop())
    conn.chunks = deque(chunks)
    conn.complete = complete
    return UpstreamResponse(200, headers, _Body(LeanTransport(), ("h", 1, False), conn, 1, 1))


async def test_an_answer_whole_with_its_head_looks_up_no_header() -> None:
    # the hot path's usual answer: the bound costs it one length check (a content-length
    # lookup cost 1 us a request: 0.5 us before the bound, 1.5 us with it)
    body = completion(2048)
    r = _response([body], True, _Unread([(b"content-length", b"2048")]))
    assert await r.aread(LIMIT) == body


async def test_a_chunked_answer_is_read_whole_under_the_bound() -> None:
    chunks = [b"a" * 1000, b"b" * 1000, b"c" * 96]
    r = _response([], False, [])
    conn, loop = r.body.conn, asyncio.get_running_loop()
    for i, chunk in enumerate(chunks):  # as they arrive, one read each
        loop.call_later(0.01 * (i + 1), conn.on_body, chunk)
    loop.call_later(0.01 * len(chunks), conn.on_message_complete)
    assert await r.aread(4096) == b"".join(chunks)
    assert not conn.closed
