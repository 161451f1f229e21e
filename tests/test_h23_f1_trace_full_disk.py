"""``--trace-out`` on a full disk (/dev/full answers every write with ENOSPC). The flush
task died at its first flush, silently; once the 1 MiB buffer (a few thousand records)
had filled, one trace write in ~25 raised ENOSPC inside ``Gateway.finish``, before the
precision check, the claim checks and the cost fit, so those requests skipped them; the
gateway's stop raised the same error. A record that cannot be written is now
dropped and counted (a warning at most once a minute), and the gateway goes on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from gateway.requesttrace import RequestTrace
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)

FULL = Path("/dev/full")


def record(i: int) -> dict[str, object]:
    return {"ts": 1.0, "request_id": f"req-{i:08d}", "replica": "r0", "tenant": "acme",
            "status": 200, "prompt_tokens": 2048, "cached_tokens": 2032,
            "predicted_cached_tokens": 2032, "ttft_s": None, "e2e_s": 0.12,
            "strategy": "expected_latency", "reason": "cache_hit", "kv_usage": 0.5,
            "queued_tokens": 0}  # fmt: skip


async def test_trace_writes_to_a_full_disk_are_dropped_and_counted_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trace = RequestTrace(FULL)
    n = 6000  # well over the 1 MiB a second's buffer holds
    with caplog.at_level(logging.WARNING, logger="gateway.requesttrace"):
        for i in range(n):
            trace.write(record(i))
        await trace.close()  # its last flush fails too: dropped, not raised
    assert trace.dropped == n
    warnings = [r for r in caplog.records if "trace records dropped" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: once a minute, not once a flush


async def dropped(trace: RequestTrace, n: int) -> None:
    """Until ``trace`` has dropped ``n`` records; at most 10 s."""
    for _ in range(200):
        if trace.dropped >= n:
            break
        await asyncio.sleep(0.05)
    assert trace.dropped == n


async def test_the_flush_task_outlives_a_failed_flush() -> None:
    trace = RequestTrace(FULL)
    trace.start()
    try:
        trace.write(record(0))
        await dropped(trace, 1)  # its first flush, after 1 s
        trace.write(record(1))
        await dropped(trace, 2)  # and the next: the task lives on
    finally:
        await trace.close()


async def test_a_gateway_tracing_to_a_full_disk_keeps_its_bookkeeping() -> None:
    async with stack(count=1, trace_out=FULL) as st:
        assert st.gw.trace is not None
        for i in range(6000):  # the records of the few thousand requests served so far
            with contextlib.suppress(OSError):  # (before the fix the later ones raised)
                st.gw.trace.write(record(i))
        before = st.gw.metrics.precision[1]
        c = st.client()
        prompts = 0
        # one trace write in ~25 (each time the text layer hands its 8 KiB on) raised
        for i in range(60):
            r = await c.completions.create(model=st.model, prompt=words(40, i), max_tokens=1)
            assert r.usage is not None
            prompts += r.usage.prompt_tokens
        # the precision check ran for every request (it is after the trace write)
        assert st.gw.metrics.precision[1] == before + prompts
    assert st.gw.trace is None or st.gw.trace.dropped >= 6060  # the stop did not raise


_TORN = """
import resource, signal, sys
from pathlib import Path
from gateway.requesttrace import RequestTrace
from tests.test_h23_f1_trace_full_disk import record

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit: EFBIG, not a kill
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
trace = RequestTrace(Path(sys.argv[1]))
size = len(open(sys.argv[2]).read())
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * size + size // 2, hard))
for i in range(5):
    trace.write(record(i))
trace.flush()  # a short write (three lines and half of one), then EFBIG
print(trace.dropped)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
for i in range(5, 7):
    trace.write(record(i))
trace.flush()
print(trace.dropped)
"""


def test_a_line_cut_short_by_a_write_error_does_not_swallow_the_next(tmp_path: Path) -> None:
    """A write that fails part-way (here the file size limit, as a disk filling up does)
    leaves half a line: the records wholly written are kept, the others counted dropped,
    and the next record starts on a line of its own instead of being glued to the half."""
    one = tmp_path / "one.jsonl"
    one.write_bytes(orjson.dumps(record(0)) + b"\n")  # every record is this long
    path = tmp_path / "trace.jsonl"
    out = subprocess.run(
        [sys.executable, "-c", _TORN, str(path), str(one)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["2", "2"], out
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""  # the file ends with a whole line
    ids = []
    for line in lines[:-1]:
        try:
            ids.append(orjson.loads(line)["request_id"])
        except orjson.JSONDecodeError:
            ids.append("torn")
    assert ids == ["req-00000000", "req-00000001", "req-00000002", "torn",
                   "req-00000005", "req-00000006"]  # fmt: skip
