"""D17's progress tracker against the counters a long chunked prefill leaves still: vLLM
counts a prompt only at its first token (review 3, E1), so one long prefill with nothing
decoding beside it froze both token counters and read as a stall; its KV-cache usage,
which vLLM publishes after every step, rises with each chunk."""

from __future__ import annotations

import asyncio
import time

import httpx
from prometheus_client.exposition import generate_latest

from cachecore.agent.progress import ProgressTracker
from cachecore.agent.scrape import EngineScraper, EngineSnapshot, parse_metrics
from cachecore.engine import PROFILES, EngineConfig, EngineCore, EngineRequest
from cachecore.replica import ReplicaSettings, run_fleet
from cachecore.replica.metrics import ReplicaMetrics

VOCAB = tuple(range(1000, 1500))
GRACE_S = 2.0  # routing.overdue_grace_ms's default, 2000


def _exposition(metrics: ReplicaMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def _long_prefill_stalls(budget: int, prompt_len: int) -> tuple[float, float]:
    """One long prompt alone on an 8b-h100 engine, in virtual time, scraped through the
    replica's own exposition every 0.25 s as the agent would: the longest stretch its
    vllm:prompt_tokens_total stood still while busy, and the longest stall D17 reported."""
    core = EngineCore(
        EngineConfig(profile=PROFILES["8b-h100"], num_blocks=4096, max_num_batched_tokens=budget),
        VOCAB,
    )
    metrics = ReplicaMetrics("m", lambda: core, 1000.0)
    tracker = ProgressTracker()
    tracker.observe(parse_metrics(_exposition(metrics)), 0.0)
    core.add_request(EngineRequest("long", list(range(2000, 2000 + prompt_len)), 4), 0.0)
    now, next_step = 0.0, 0.0
    frozen_since: float | None = None
    last_prompt: float | None = None
    longest_frozen = worst_stall = 0.0
    for _ in range(2000):  # bounded: ~10 s of virtual time
        if not core.has_work():
            break
        now += 0.25
        while core.has_work() and next_step <= now:
            next_step += core.step(next_step).duration_s
        snap: EngineSnapshot = parse_metrics(_exposition(metrics))
        busy = snap.running + snap.waiting > 0
        if busy and snap.prompt_tokens == last_prompt:
            frozen_since = now if frozen_since is None else frozen_since
            longest_frozen = max(longest_frozen, now - frozen_since)
        else:
            frozen_since = None
        last_prompt = snap.prompt_tokens
        worst_stall = max(worst_stall, tracker.observe(snap, now))
    assert not core.has_work()
    return longest_frozen, worst_stall


def test_a_long_chunked_prefill_is_no_stall() -> None:
    """A 16,384-token prompt in 2,048-token chunks (0.54 s each): 4.3 s of prefill with
    both token counters still, as vLLM's are. The tracker read that as a 3.5 s stall (over
    the default grace: the gateway charged a healthy replica); the KV usage each chunk
    raises is progress, so what is left is at most one step."""
    frozen, stall = _long_prefill_stalls(2048, 16_384)
    assert frozen > GRACE_S  # the case exists: counters still for longer than the grace
    assert stall <= 0.6, stall  # one 0.54 s step at most, not the whole prefill


def test_a_step_longer_than_the_grace_is_still_seen_as_one_step() -> None:
    """The default 8,192-token budget: 2.08 s a chunk. Between two chunk ends nothing vLLM
    exports moves, so up to one step reads as a stall; never the whole prefill."""
    frozen, stall = _long_prefill_stalls(8192, 28_672)
    assert frozen > 5.0
    assert stall <= 2.1, stall


async def test_a_replicas_long_prefill_over_http_is_no_stall() -> None:
    """The same through a running replica's /metrics and the agent's scraper, wall clock
    (time scale 0.5: 8 chunks of 0.27 s, about 2.2 s of prefill)."""
    settings = ReplicaSettings(
        profile="8b-h100", time_scale=0.5, max_num_batched_tokens=2048, publish_events=False
    )
    async with run_fleet(settings, count=1) as fleet:
        ep = fleet.endpoints[0]
        scraper = EngineScraper(ep.url)
        tracker = ProgressTracker()
        async with httpx.AsyncClient(timeout=30) as http:
            body = {
                "model": ep.model,
                "prompt": [1 + i % 8000 for i in range(16_384)],
                "max_tokens": 2,
            }
            task = asyncio.create_task(http.post(ep.url + "/v1/completions", json=body))
            try:
                first_busy: float | None = None
                prompt_moved_at: float | None = None
                stall = 0.0
                for _ in range(400):  # bounded: 20 s
                    if task.done():
                        break
                    snap = await scraper.metrics()
                    now = time.monotonic()
                    if snap.running + snap.waiting > 0:
                        first_busy = first_busy or now
                        if snap.prompt_tokens:
                            prompt_moved_at = prompt_moved_at or now
                        stall = max(stall, tracker.observe(snap, now))
                    await asyncio.sleep(0.05)
                r = await task
            finally:
                task.cancel()
                await scraper.close()
        assert r.status_code == 200, r.text
        assert first_busy is not None
        # the prompt counter stood still for most of the prefill (vLLM's meaning) ...
        held = (prompt_moved_at or time.monotonic()) - first_busy
        assert held > 1.5, held
        # ... and the agent saw progress all along (one 0.27 s step, plus scheduling slack)
        assert stall < 1.0, stall


def test_only_a_rise_in_kv_usage_is_progress() -> None:
    """Freed blocks are no step for sure: the simulated replica applies an abort at once
    (vLLM publishes the gauge with its next step's stats), so a wedged engine whose client
    hung up must still read as stalled."""

    def snap(usage: float) -> EngineSnapshot:
        return EngineSnapshot(
            running=1.0, kv_usage=usage, prompt_tokens=100.0, generation_tokens=10.0
        )

    t = ProgressTracker()
    assert t.observe(snap(0.5), 0.0) == 0.0
    assert t.observe(snap(0.5), 1.0) == 1.0
    assert t.observe(snap(0.6), 2.0) == 0.0  # blocks allocated: a step
    assert t.observe(snap(0.2), 3.0) == 1.0  # freed: not progress
    assert t.observe(snap(0.2), 4.0) == 2.0
    assert t.observe(snap(0.3), 5.0) == 0.0  # rises again from the last scrape's value
