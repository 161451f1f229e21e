"""R1's E3 (twenty-sixth session): open-loop TTFT is timed from the request's due time. A
load generator whose loop stalls sends the due requests late; timed from the late send,
their wait vanished (coordinated omission) and the run looked calm."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from loadtest.replay import LATE_SEND_S, replay
from loadtest.workloads import WorkItem, Workload

STALL_S = 0.3


async def _server(request: httpx.Request) -> httpx.Response:
    await asyncio.sleep(0.01)
    body = (
        "data: " + json.dumps({"choices": [{"delta": {"content": "x"}}]}) + "\n\n"
        "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                         "completion_tokens": 1}}) + "\n\n"
        "data: [DONE]\n\n"
    )  # fmt: skip
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


def test_a_stalled_load_generator_shows_in_the_ttft_and_the_late_count() -> None:
    items = tuple(
        WorkItem(t=0.01 * i, api="completions", max_tokens=1, prompt=" a") for i in range(20)
    )

    async def go() -> tuple[float, list[tuple[float, float]], int]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(_server))
        # the generator's loop is blocked (CPU-starved) from 15 ms on, while requests are due
        asyncio.get_running_loop().call_later(0.015, time.sleep, STALL_S)
        rep = await replay(Workload("w", items), "http://x", "m", client=client)
        await client.aclose()
        s = rep.summary()
        return (
            s["ttft_p99_s"],
            [(r.t_sent - r.t_sched, r.ttft_s or 0.0) for r in rep.results],
            rep.late_sends,
        )

    p99, rows, late = asyncio.run(go())
    assert all(ttft >= lateness for lateness, ttft in rows)  # the wait is in the TTFT
    stalled = [lateness for lateness, _ in rows if lateness > LATE_SEND_S]
    assert len(stalled) >= 10 and late == len(stalled)
    # the request due at 20 ms waited ~0.3 s for the loop: so does the run's tail
    assert p99 >= 0.8 * STALL_S
