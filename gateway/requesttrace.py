"""``kvgate serve --trace-out FILE``: one JSON line per answered request, the request-record
format of :mod:`cachecore.traceanalysis` (``kvgate trace analyze`` reads it beside the
agents' cache-event traces)::

    {"ts": 1712.5, "request_id": "...", "replica": "r0", "tenant": "acme", "status": 200,
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
from pathlib import Path
from typing import Any, TextIO

import orjson

FLUSH_INTERVAL_S = 1.0


class RequestTrace:
    """Appends request records to ``path``. ``start`` runs the periodic flush; ``close``
    flushes and closes (idempotent)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: TextIO | None = path.open("a", buffering=1024 * 1024)
        self._task: asyncio.Task[None] | None = None
        self.records = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_every())

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            self.flush()

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(orjson.dumps(record).decode() + "\n")
            self.records += 1

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None
