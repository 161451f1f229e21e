"""``RequestTrace.close`` awaited its cancelled flusher under ``suppress(CancelledError)``,
so a close that was itself cancelled (a shutdown cut short) swallowed the caller's
cancellation and returned normally. Now it still writes what is buffered and closes the
file, then ends cancelled (review R1, twenty-ninth session)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from gateway.requesttrace import RequestTrace

pytestmark = pytest.mark.timeout(30)


async def test_a_cancelled_close_flushes_closes_and_stays_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = RequestTrace(path)
    trace.start()
    trace.write({"request_id": "r1"})
    closing = asyncio.ensure_future(trace.close())
    await asyncio.sleep(0)  # close is waiting for its cancelled flusher
    assert not closing.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert closing.cancelled()
    assert [orjson.loads(line) for line in path.read_bytes().splitlines()] == [{"request_id": "r1"}]
    trace.write({"request_id": "r2"})  # after close: nothing is written, nothing raised
    await trace.close()  # again: nothing left to do
    assert path.read_bytes().count(b"\n") == 1


async def test_a_plain_close_writes_everything(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = RequestTrace(path)
    trace.start()
    for i in range(3):
        trace.write({"i": i})
    await trace.close()
    assert [orjson.loads(line)["i"] for line in path.read_bytes().splitlines()] == [0, 1, 2]
