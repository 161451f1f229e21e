"""One read of an engine's HTTP answer, whole: within a deadline for the whole answer and
at most a cap of body, refused as it arrives. httpx's timeout is per read: a peer sending
its answer a byte at a time under it held the caller for as long as it dribbled, and a
body that did not end was read into memory for as long as it came. The agent's engine
scrapes, the gateway's health and model reads, its start-up checks and its
engine-tokenized pools read through :func:`read_answer`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

# the headers that framed or encoded the body on the wire: the answer's body is decoded
_WIRE_HEADERS = ("content-encoding", "content-length", "transfer-encoding")


class AnswerTooLarge(Exception):
    """The answer's body ran past the cap (never held whole)."""


class AnswerTimeout(TimeoutError):
    """No whole answer within the deadline. A ``TimeoutError``, so a caller that also
    awaits under its own deadline handles both alike."""


async def read_answer(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    timeout_s: float,
    deadline_s: float,
    cap: int,
    json: Any = None,
    read_unless_ok: bool = True,
) -> httpx.Response:
    """``method url`` answered: the status and its (decoded) body read whole, as a
    response detached from the connection. ``timeout_s`` bounds each connect, write and
    read (httpx's), ``deadline_s`` the whole answer; a body over ``cap`` bytes is refused
    as it arrives. ``read_unless_ok=False``: a status other than 200 comes with no body
    (unread: the connection is closed rather than drained).

    Raises :class:`AnswerTooLarge`, :class:`AnswerTimeout` or ``httpx.HTTPError`` (an
    ``httpx.TimeoutException`` for one read, write or connect over ``timeout_s``)."""
    try:
        async with (
            asyncio.timeout(deadline_s),
            client.stream(method, url, json=json, timeout=timeout_s) as r,
        ):
            body = bytearray()
            if r.status_code == 200 or read_unless_ok:
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > cap:
                        raise AnswerTooLarge(f"answer over {cap} bytes")
            headers = [(k, v) for k, v in r.headers.multi_items() if k not in _WIRE_HEADERS]
            return httpx.Response(
                r.status_code, headers=headers, content=bytes(body), request=r.request
            )
    except TimeoutError:
        # only this deadline's: an outer one's expiry passes through as a cancellation
        raise AnswerTimeout(f"no whole answer within {deadline_s:g} s") from None
