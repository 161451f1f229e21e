"""An engine that serves but publishes no KV events, told from an idle one by its counters.

A broken publisher, a ``kv_events_config`` without events (or with another endpoint or
topic), an event port the agent cannot reach: to the event stream each looks like an idle
engine, while the index keeps what the engine last published (its new prefixes never
indexed, its evicted blocks still claimed). The engine's own counters tell the two apart:
tokens whose KV it computed must have filled new blocks, and vLLM publishes a
``BlockStored`` for every block that becomes full (prompt blocks and those decoding fills),
in a batch right after the step that scheduled it.

The evidence, over a window of ``window_s`` (the setting ``events_silence_window_s``):

* computed prompt tokens: ``vllm:prefix_cache_queries_total`` minus
  ``vllm:prefix_cache_hits_total`` (tokens looked up at admission, less those the prefix
  cache served: a request served from cache stores nothing new). ``vllm:prompt_tokens_total``
  is not used: it counts cached tokens too. Without both counters, generated tokens alone;
* generated tokens (``vllm:generation_tokens_total``): always computed, and kept in blocks;
* one block per request as slack: a request's new tokens fill ``floor((t - 1) / bs)`` new
  blocks at least (its first new token may complete a block begun before, its last may
  wait for the next step), so ``(tokens - requests * bs) / bs`` blocks at least were
  stored. Requests active in the window finished in it (``vllm:request_success_total``) or
  are still running or waiting at its end; without that counter nothing is judged.

The stream is silent when those blocks reach :data:`MIN_BLOCKS` while no live batch arrived
since the window's first scrape. The counters are read from a scrape at least a quarter of
the window old (and at least 3/4 of the window after the first), so work an engine has just
scheduled, whose batch is not out yet, never counts. A data-parallel server is judged on
the agent's own core (label ``engine``; core 0 for an agent given no rank). A new
``process_start_time_seconds`` or a counter that went backwards (a restart) starts the
history over and ends a silence; otherwise a silence lasts until a live batch arrives.
SGLang exports none of these series (its token counters move only when a request finishes)
and is never judged.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from cachecore.agent.progress import start_time_moved
from cachecore.agent.scrape import EngineSnapshot

log = logging.getLogger(__name__)

MIN_BLOCKS = 4
"""Blocks the counters must prove stored (beyond a block of slack per request)."""

_MAX_SAMPLES = 100_000  # a bound whatever the window and the scrape interval


@dataclass(frozen=True, slots=True)
class _Sample:
    t: float  # monotonic s of the scrape
    queries: float | None  # prefix-cache lookups, tokens
    hits: float | None
    generation: float | None
    finished: float | None
    in_flight: float  # running + waiting

    @property
    def computed(self) -> float | None:
        """Prompt tokens computed: looked up and not served by the prefix cache."""
        if self.queries is None or self.hits is None:
            return None
        return self.queries - self.hits


def _sample(snap: EngineSnapshot, now: float) -> _Sample:
    return _Sample(
        now,
        snap.prefix_queries,
        snap.prefix_hits,
        snap.generation_tokens,
        snap.finished,
        snap.running + snap.waiting,
    )


def _went_back(old: _Sample, new: _Sample) -> bool:
    """A counter that went backwards or appeared or vanished: a new engine process."""
    pairs = (
        (old.queries, new.queries),
        (old.hits, new.hits),
        (old.generation, new.generation),
        (old.finished, new.finished),
    )
    for a, b in pairs:
        if (a is None) != (b is None):
            return True
        if a is not None and b is not None and b < a - 1e-9:
            return True
    return False


class SilenceDetector:
    """Whether one engine computes without publishing KV events. :meth:`observe` is called
    once per scrape with a monotonic clock and the monotonic time of the last live batch
    the stream received (None: none yet). ``problem`` says why while it is silent; a
    WARNING is logged once when a silence starts and an INFO when it ends."""

    def __init__(self, name: str, window_s: float) -> None:
        self.name = name
        self.window_s = window_s
        self.problem: str | None = None
        self.episodes = 0
        self._samples: deque[_Sample] = deque(maxlen=_MAX_SAMPLES)
        self._start_time: float | None = None
        self._silent_since: float | None = None  # the window's start when it was found

    def reset(self, why: str) -> None:
        """Forget the history (a new engine process); a silence ends."""
        self._samples.clear()
        self._end(why)

    def _end(self, why: str) -> None:
        if self.problem is None:
            return
        log.info(
            "engine KV events: the silence ended (%s)",
            why,
            extra={"replica": self.name, "reason": why},
        )
        self.problem = None
        self._silent_since = None

    def observe(
        self, snap: EngineSnapshot, block_size: int, last_batch_at: float | None, now: float
    ) -> str | None:
        if self.window_s <= 0:
            return None
        restarted = start_time_moved(self._start_time, snap.start_time)
        self._start_time = snap.start_time
        sample = _sample(snap, now)
        if restarted or (self._samples and _went_back(self._samples[-1], sample)):
            self.reset("engine restarted")
        if (
            self._silent_since is not None
            and last_batch_at is not None
            and last_batch_at > self._silent_since
        ):
            self._end("a batch arrived")
        self._samples.append(sample)
        self._judge(block_size, last_batch_at, now)
        return self.problem

    def _judge(self, block_size: int, last_batch_at: float | None, now: float) -> None:
        """Find the window's scrapes (dropping those no later window can use) and, unless
        a silence is on already, whether they prove blocks no batch announced."""
        grace = self.window_s / 4
        samples = self._samples
        end = base = None
        for s in reversed(samples):
            if end is None:
                if s.t <= now - grace:
                    end = s
            elif s.t <= end.t - (self.window_s - grace):
                base = s
                break
        if base is not None:
            while samples[0] is not base:  # older ones can serve no later window
                samples.popleft()
        if end is None or base is None or self.problem is not None:
            return
        if last_batch_at is not None and last_batch_at >= base.t:
            return
        if end.finished is None or base.finished is None:
            return  # how many requests shared the tokens is unknown: no bound
        computed = (
            end.computed - base.computed
            if end.computed is not None and base.computed is not None
            else None
        )
        generated = (
            end.generation - base.generation
            if end.generation is not None and base.generation is not None
            else None
        )
        if computed is None and generated is None:
            return
        computed = None if computed is None else max(0.0, computed)
        tokens = (computed or 0.0) + (generated or 0.0)
        requests = (end.finished - base.finished) + end.in_flight
        blocks = int((tokens - requests * block_size) // block_size) if block_size > 0 else 0
        if blocks < MIN_BLOCKS:
            return
        quiet = now - base.t
        what = (
            f"computed {computed:.0f} prompt tokens and generated {generated or 0.0:.0f}"
            if computed is not None
            else f"generated {generated or 0.0:.0f}"
        )
        self.problem = (
            f"the engine {what} tokens over {end.t - base.t:.1f} s ({blocks} new blocks at "
            f"least, {requests:.0f} requests) and published no KV events in the last "
            f"{quiet:.1f} s: check its kv_events_config (enable_kv_cache_events, publisher, "
            f"endpoint, topic) and that the agent's --events (and --topic) reach its PUB "
            f"socket"
        )
        self._silent_since = base.t
        self.episodes += 1
        log.warning(
            "engine computes but publishes no KV events: its index entries go stale",
            extra={
                "replica": self.name,
                "problem": self.problem,
                "computed_prompt_tokens": computed,
                "generated_tokens": generated,
                "blocks": blocks,
                "quiet_s": round(quiet, 3),
            },
        )
