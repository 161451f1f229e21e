"""The real-time driver around one :class:`EngineCore`: one asyncio task per replica that
steps the engine, sleeps for the step's modelled duration (times the time scale), then
publishes the step's KV events and hands each request its new tokens.

The engine is given the event loop's clock (``loop.time()``) as ``now``, so queue times come
out in wall seconds. The loop lag (how late the task wakes after a step's target end) is
recorded in ``kvgate_replica_loop_lag_seconds``: a lagging loop stretches every modelled
latency, and benchmarks reject runs where it is large.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cachecore.engine import (
    EngineCore,
    EngineRequest,
    RequestOutput,
    RequestRejectedError,
    StepResult,
)
from cachecore.replica.events import KVEventPublisher
from cachecore.replica.metrics import ReplicaMetrics
from cachecore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The request ended without finishing: aborted, or the engine went away (simulated
    restart or shutdown) with it in flight."""


@dataclass(eq=False)
class RequestHandle:
    """A submitted request's output stream."""

    request_id: str
    arrival: float
    queue: asyncio.Queue[RequestOutput | EngineStoppedError] = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_token_at: float | None = None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Step outputs until (and including) the one that finishes the request."""
        while True:
            item = await self.queue.get()
            if isinstance(item, EngineStoppedError):
                raise item
            yield item
            if item.finished:
                return


class EngineDriver:
    def __init__(
        self,
        core: EngineCore,
        metrics: ReplicaMetrics,
        publisher: KVEventPublisher | None,
        time_scale: float = 1.0,
        name: str = "replica",
    ) -> None:
        self.core = core
        self.metrics = metrics
        self.publisher = publisher
        self.time_scale = time_scale
        self.name = name
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._paused_until = 0.0
        self._inflight: StepResult | None = None  # stepped, its duration not yet elapsed
        self._between_steps = asyncio.Event()
        self._between_steps.set()
        self._loop = asyncio.get_running_loop()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"engine-{self.name}")

    async def stop(self, reason: str = "engine stopped") -> None:
        await cancel_and_wait(self._task)
        self._task = None
        for handle in self._handles.values():
            handle.queue.put_nowait(EngineStoppedError(reason))
        self._handles.clear()

    # ------------------------------------------------------------------ requests
    def submit(self, request: EngineRequest) -> RequestHandle:
        """Queue a request (raises RequestRejectedError like the engine)."""
        if request.request_id in self._handles:
            # still running here even when the core is done with it (its last outputs wait
            # for the step's modelled end): a second handle would take the first's outputs
            raise RequestRejectedError(f"Request id {request.request_id} already running.")
        now = self._loop.time()
        self.core.add_request(request, now)
        handle = RequestHandle(request.request_id, now)
        self._handles[request.request_id] = handle
        self._wake.set()
        return handle

    def abort(self, request_id: str, reason: str = "request aborted") -> None:
        """Drop a request; whoever still reads its outputs gets EngineStoppedError."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self.core.abort(request_id)
            handle.queue.put_nowait(EngineStoppedError(reason))

    def pause(self, seconds: float) -> None:
        """Chaos: no engine step for ``seconds`` (a hung engine; HTTP keeps answering)."""
        self._paused_until = self._loop.time() + seconds
        self._wake.set()

    async def between_steps(self) -> None:
        """Wait until no step is in flight (vLLM runs utility calls such as
        reset_prefix_cache between engine steps, after the step's outputs and events)."""
        await self._between_steps.wait()

    async def publish_now(self) -> None:
        """Publish events produced outside a step (reset_prefix_cache). While a step is in
        flight they join that step's batch, after its events: publishing them at once would
        let the step's earlier BlockStored arrive after the clear."""
        events = self.core.take_events()
        if not events:
            return
        if self._inflight is not None:
            self._inflight.events.extend(events)
        elif self.publisher is not None:
            await self.publisher.publish(events, time.time())

    # ------------------------------------------------------------------ loop
    async def _run(self) -> None:
        loop = self._loop
        core = self.core
        lag = self.metrics.loop_lag
        try:
            while True:
                pause = self._paused_until - loop.time()
                if pause > 0:
                    await asyncio.sleep(pause)
                    continue
                if not core.has_work():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = loop.time()
                self._between_steps.clear()
                result = self._inflight = core.step(start)
                target = start + result.duration_s * self.time_scale
                delay = target - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                end = loop.time()
                lag.observe(max(0.0, end - target))
                self._inflight = None
                if result.events and self.publisher is not None:
                    await self.publisher.publish(result.events, time.time())
                self._deliver(result.outputs, end)
                self._between_steps.set()
                if result.idle:
                    await asyncio.sleep(0)  # nothing schedulable this step: let others run
        except asyncio.CancelledError:
            self._between_steps.set()
            raise
        except Exception:
            logger.exception("engine loop crashed", extra={"replica": self.name})
            raise

    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        m = self.metrics
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue  # aborted while the step ran
            if out.first_token:
                handle.first_token_at = now
                m.ttft.observe(now - handle.arrival)
                if out.first_scheduled_time is not None:
                    m.queue_time.observe(max(0.0, out.first_scheduled_time - handle.arrival))
            elif handle.last_token_at is not None:
                m.itl.observe((now - handle.last_token_at) / max(1, len(out.new_token_ids)))
            handle.last_token_at = now
            if out.finished:
                m.e2e.observe(now - handle.arrival)
                del self._handles[out.request_id]
            handle.queue.put_nowait(out)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def step_in_flight(self) -> bool:
        """A step was taken whose duration has not elapsed: the engine state already
        includes it, its events are not published yet."""
        return self._inflight is not None
