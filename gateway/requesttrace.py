"""``kvgate serve --trace-out FILE``: one JSON line per answered request, the request-record
format of :mod:`cachecore.traceanalysis` (``kvgate trace analyze`` reads it beside the
agents' cache-event traces)::

    {"ts": 1712.5, "request_id": "...", "endpoint": "chat", "replica": "r0", "tenant": "acme",
     "status": 200,
     "prompt_tokens": 2048, "cached_tokens": 2032, "predicted_cached_tokens": 2032,
     "ttft_s": 0.041, "e2e_s": 0.120, "strategy": "expected_latency",
     "reason": "cache_hit", "kv_usage": 0.62, "queued_tokens": 1024}

``ts`` is the wall-clock time the answer ended. ``cached_tokens`` is the engine's report
(null when it sent none: an error, a stream cut short); ``predicted_cached_tokens`` is the
gateway's prediction under the request's own scope (null for sensitive and media requests,
which have none); ``ttft_s`` is null for a non-streamed answer (it arrives whole).
``kv_usage`` and ``queued_tokens`` are the chosen replica's KV-cache occupancy and queued
uncached prefill tokens as the routing decision saw them: the per-request cache occupancy.
Records hold counts and names, never prompt text.

Lines are buffered and flushed once a second (and at shutdown), so a request costs no
syscall on the hot path; a reader lags the gateway by at most that second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from cachecore.tasks import cancel_and_wait

FLUSH_INTERVAL_S = 1.0
BUFFER_BYTES = 1024 * 1024  # written out early when a second's records pass it
DROP_LOG_INTERVAL_S = 60.0

log = logging.getLogger(__name__)


class RequestTrace:
    """Appends request records to ``path``. ``start`` runs the periodic flush; ``close``
    flushes and closes (idempotent).

    A record that cannot be written (a full disk, a file system gone read-only) is dropped
    and counted in ``dropped``, with a warning at most once a minute: the trace is a side
    output, and its failure must not fail the request's bookkeeping (the caller's precision
    check, claim checks and cost fit run after the write) nor stop the flushing, which
    retries at the next interval."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: BinaryIO | None = path.open("ab", buffering=0)
        self._task: asyncio.Task[None] | None = None
        self._buf = bytearray()  # whole lines not yet written
        self._pending = 0  # records in _buf
        self._torn = False  # the file ends in a line an error cut short
        self.records = 0
        self.dropped = 0
        self._warned_at = -DROP_LOG_INTERVAL_S

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_every())

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        try:
            line = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        except orjson.JSONEncodeError as exc:  # a value orjson cannot write: this record
            self._drop(1, exc)
            return
        self._buf += line
        self._pending += 1
        self.records += 1
        if len(self._buf) >= BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._fh is None or not self._buf:
            return
        written = 0
        try:
            if self._torn:  # end the line an earlier error cut short: the next is whole
                if not self._fh.write(b"\n"):
                    raise OSError("no progress writing the trace")
                self._torn = False
            with memoryview(self._buf) as view:
                while written < len(view):  # a short write leaves the rest: write it
                    n = self._fh.write(view[written:])
                    if not n:
                        raise OSError("no progress writing the trace")
                    written += n
        except OSError as exc:
            # the records whose lines were not wholly written are lost
            if written and self._buf[written - 1] != ord("\n"):
                self._torn = True
            self._drop(self._pending - self._buf.count(b"\n", 0, written), exc)
        finally:
            self._buf.clear()
            self._pending = 0

    def _drop(self, n: int, exc: Exception) -> None:
        self.dropped += n
        now = time.monotonic()
        if now - self._warned_at >= DROP_LOG_INTERVAL_S:
            self._warned_at = now
            log.warning(
                "request trace records dropped: cannot write --trace-out",
                extra={"path": str(self.path), "error": str(exc), "dropped": self.dropped},
            )

    async def close(self) -> None:
        """Stop the flusher, write what is buffered and close the file. A close that is
        itself cancelled still flushes and closes, then ends cancelled: suppressing the
        flusher's CancelledError here swallowed the caller's own cancellation."""
        try:
            await cancel_and_wait(self._task)
        finally:
            self._task = None
            if self._fh is not None:
                self.flush()
                with contextlib.suppress(OSError):
                    self._fh.close()
                self._fh = None
