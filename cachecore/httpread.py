"""One read of an engine's HTTP answer, whole: within a deadline for the whole answer and
at most a cap of body, refused as it arrives. httpx's timeout is per read: a peer sending
its answer a byte at a time under it held the caller for as long as it dribbled, and a
body that did not end was read into memory for as long as it came. The agent's engine
scrapes, the gateway's health and model reads, its start-up checks and its
engine-tokenized pools read through :func:`read_answer`."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

# the headers that framed or encoded the body on the wire: the answer's body is decoded
_WIRE_HEADERS = ("content-encoding", "content-length", "transfer-encoding")
# engines' answers uncompressed (one that compresses all the same is inflated under the cap)
_IDENTITY = {"accept-encoding": "identity"}


class AnswerTooLarge(Exception):
    """The answer's body ran past the cap (never held whole)."""


class AnswerTimeout(TimeoutError):
    """No whole answer within the deadline. A ``TimeoutError``, so a caller that also
    awaits under its own deadline handles both alike."""


def _decoder(r: httpx.Response) -> Any:
    """A zlib decompressor for the answer's encoding; None for an uncompressed one."""
    encoding = r.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "identity":
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":  # HTTP's deflate is the zlib format
        return zlib.decompressobj()
    raise httpx.DecodingError(f"answer in an encoding not asked for: {encoding}", request=r.request)


def _inflate(decoder: Any, chunk: bytes, body: bytearray, cap: int) -> None:
    """Decode ``chunk`` into ``body``, never past ``cap + 1`` bytes: httpx's decoders
    inflate a network read whole before a cap could see it (64 KiB of gzip is 64 MiB of
    zeros). Stops early once over the cap (the caller refuses the answer)."""
    data = chunk
    try:
        while data and len(body) <= cap:
            body += decoder.decompress(data, cap - len(body) + 1)
            data = decoder.unconsumed_tail
    except zlib.error as exc:
        raise httpx.DecodingError(f"compressed answer not valid: {exc}") from None


async def _held(r: httpx.Response) -> AsyncIterator[bytes]:
    yield r.content


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
    extra_headers: dict[str, str] | None = None,
) -> httpx.Response:
    """``method url`` answered: the status and its (decoded) body read whole, as a
    response detached from the connection. ``timeout_s`` bounds each connect, write and
    read (httpx's), ``deadline_s`` the whole answer; a body over ``cap`` bytes is refused
    as it arrives. ``read_unless_ok=False``: a status other than 200 comes with no body
    (unread: the connection is closed rather than drained). ``extra_headers``: sent besides.

    Raises :class:`AnswerTooLarge`, :class:`AnswerTimeout` or ``httpx.HTTPError`` (an
    ``httpx.TimeoutException`` for one read, write or connect over ``timeout_s``; an
    ``httpx.DecodingError`` for a body it cannot decode)."""
    try:
        async with (
            asyncio.timeout(deadline_s),
            client.stream(
                method,
                url,
                json=json,
                timeout=timeout_s,
                headers={**_IDENTITY, **(extra_headers or {})},
            ) as r,
        ):
            body = bytearray()
            if r.status_code == 200 or read_unless_ok:
                if r.is_stream_consumed:
                    # a transport that read the body already (httpx.MockTransport) holds it
                    # decoded: no raw stream is left to read
                    decoder, raw = None, _held(r)
                else:
                    decoder, raw = _decoder(r), r.aiter_raw()
                async for chunk in raw:
                    if decoder is None:
                        body += chunk
                    else:
                        _inflate(decoder, chunk, body, cap)
                    if len(body) > cap:
                        raise AnswerTooLarge(f"answer over {cap} bytes")
                if decoder is not None:
                    body += decoder.flush(cap - len(body) + 1)
                    if len(body) > cap:
                        raise AnswerTooLarge(f"answer over {cap} bytes")
            headers = [(k, v) for k, v in r.headers.multi_items() if k not in _WIRE_HEADERS]
            return httpx.Response(
                r.status_code, headers=headers, content=bytes(body), request=r.request
            )
    except TimeoutError:
        # only this deadline's: an outer one's expiry passes through as a cancellation
        raise AnswerTimeout(f"no whole answer within {deadline_s:g} s") from None
