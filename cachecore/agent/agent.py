"""The per-replica cache agent: engine KV events and load into the index, with recovery.

One :class:`Agent` serves one engine (one event publisher; its DP rank, if any, is in the
settings). It runs as asyncio tasks, standalone (``kvgate agent``, Redis index) or embedded
in the gateway process (sharing the gateway's :class:`~cachecore.index.memory.MemoryIndex`).

Tasks::

    supervisor   waits for the engine, loads persisted state, starts the others
    stream       SUB -> validate -> seq tracking / replay -> per-rank queues (EventStream)
    sync (each)  per-rank worker: mirror -> coalesced IndexWrite -> index (ReplicaSync)
    scraper      engine /metrics every scrape_interval_s: load record (with how long the
                 engine has been busy without progress), restart and reachability detection
    heartbeat    registration with a TTL (only URLs the operator declared are accepted)
    checker      index still holds our state? (Redis restart: changed run_id / lost meta)

stream, scraper, heartbeat and checker run under one supervision rule (:meth:`Agent._loop`):
an unexpected error is logged and counted and the loop restarts after a pause. The
supervisor's start-up follows it too (loop ``start``), its failed attempt undone first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

import zmq
import zmq.asyncio

from cachecore.agent.links import LoadLink, RegistryLink
from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.progress import ProgressTracker
from cachecore.agent.replay import ReplayClient
from cachecore.agent.scrape import EngineScraper, EngineSnapshot, ScrapeError
from cachecore.agent.settings import AgentSettings, StopRegistration
from cachecore.agent.silence import SilenceDetector
from cachecore.agent.stream import EventStream
from cachecore.agent.sync import (
    CheckIndex,
    ClearReplica,
    ReplicaSync,
    SetEngineReachable,
    SyncKnobs,
)
from cachecore.agent.trace import TraceWriter
from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.index.layout import dp_replica_id
from cachecore.index.redis import evicts_any_key
from cachecore.keys import BlockKeyer
from cachecore.lifecycle import MirrorRecordError, ReplicaMirror
from cachecore.loadstate import LoadStore
from cachecore.registry import RegistryStore
from cachecore.tasks import Step, cancel_and_wait, run_steps, run_to_end

log = logging.getLogger(__name__)

_START_TIME_TOLERANCE_S = 1e-3

# a failed background loop restarts after 0.5 s, doubling while it fails without progress
_LOOP_PAUSE_S = 0.5
_LOOP_PAUSE_MAX_S = 5.0
LOOP_FAILING_AFTER = 3
"""Failures in a row (no progress between them) after which /health calls a loop failing."""

STOP_STEP_S = 10.0
"""How long one step of :meth:`Agent.stop` may take (the registration's: this and the
engine probe's ``scrape_timeout_s``) before it is cancelled, logged as failed, and the next
one runs."""


@runtime_checkable
class HasInstanceId(Protocol):
    """Index backends that can tell they lost their contents (Redis ``run_id``)."""

    async def instance_id(self) -> str: ...


@runtime_checkable
class HasEvictionPolicy(Protocol):
    """Index backends on a server with a ``maxmemory-policy`` (Redis)."""

    async def eviction_policies(self) -> dict[str, str | None]: ...


def index_replica_id(name: str, dp_rank: int | None) -> str:
    """Index id of one (replica, data-parallel rank): ``name`` for rank 0 or no rank,
    ``name@dpN`` otherwise."""
    return dp_replica_id(name, dp_rank or None)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the agent learnt of its engine at startup (and after each restart)."""

    model: str
    block_size: int
    num_gpu_blocks: int | None
    start_time: float


class LoopRun:
    """One background loop's record under supervision: restarts in all, and failures since
    it last made progress. A periodic loop reports each completed iteration
    (:meth:`progressed`); a loop that never completes one (the stream) has a ``probe``
    whose value moves with its progress (the last seq it applied)."""

    __slots__ = ("_at_failure", "_in_a_row", "last_error", "name", "probe", "restarts")

    def __init__(self, name: str, probe: Callable[[], object] | None = None) -> None:
        self.name = name
        self.probe = probe
        self.restarts = 0
        self._in_a_row = 0
        self._at_failure: object = None  # the probe's value at the last failure
        self.last_error: str | None = None

    def progressed(self) -> None:
        self._in_a_row = 0

    @property
    def in_a_row(self) -> int:
        moved = self.probe is not None and self.probe() != self._at_failure
        return 0 if moved else self._in_a_row

    def failed(self, exc: Exception) -> float:
        """Record a failure; the pause before the restart, seconds."""
        self.restarts += 1
        self._in_a_row = self.in_a_row + 1
        if self.probe is not None:
            self._at_failure = self.probe()
        self.last_error = repr(exc)[:300]
        return min(_LOOP_PAUSE_MAX_S, _LOOP_PAUSE_S * 2.0 ** (self._in_a_row - 1))

    @property
    def failing(self) -> bool:
        return self.in_a_row >= LOOP_FAILING_AFTER


class RegistrationRelease(StrEnum):
    """What a clean stop did with the replica's registration: the ``outcome`` field of its
    log line (:meth:`Agent._release_registration`)."""

    HANDOVER = "handover"  # kept handover_window_s for the next agent
    DEREGISTER = "deregister"  # deleted: gateways remove the replica after their grace
    ABSENT = "absent"  # none of this agent's was there: never written, lapsed, a successor's
    FAILED = "failed"  # the registry call failed: it lapses after registration_ttl_s


class Agent:
    """One engine's cache agent. ``await start()`` returns at once (the engine may not be up
    yet); ``await stop()`` cancels everything and deregisters, or hands the registration
    over to the next agent while the engine serves (:meth:`stop`).

    ``load_store`` and ``registry`` are optional (tests may run an agent without them).
    """

    def __init__(
        self,
        settings: AgentSettings,
        index: PrefixIndex,
        load_store: LoadStore | None = None,
        registry: RegistryStore | None = None,
        *,
        zmq_context: zmq.asyncio.Context | None = None,
        metrics: AgentMetrics | None = None,
        trace: TraceWriter | None = None,
    ) -> None:
        self.settings = settings
        self.index = index
        self.metrics = metrics or AgentMetrics()
        self.trace = trace
        if trace is None and settings.trace_out is not None:
            self.trace = TraceWriter(settings.trace_out)
            self._own_trace = True
        else:
            self._own_trace = False
        self._own_ctx = zmq_context is None
        self.ctx = zmq_context or zmq.asyncio.Context()
        self.scraper = EngineScraper(settings.engine_url, settings.scrape_timeout_s)
        self.load_link = LoadLink(load_store, settings) if load_store is not None else None
        self.registry_link = RegistryLink(registry, settings) if registry is not None else None
        self.engine: EngineInfo | None = None
        self.last_snapshot: EngineSnapshot | None = None
        self.progress = ProgressTracker()  # busy without progress (D17), per scrape
        # computing without publishing KV events, per scrape (cachecore.agent.silence)
        self.silence = SilenceDetector(self.primary_id, settings.events_silence_window_s)
        self.engine_reachable = False
        self._index_warned = False  # "index not reachable" logged in this engine wait
        self._last_scrape_ok = 0.0
        self._metrics_failing = False  # warned once while /metrics fails but /health answers
        self._busy_unreported_warned = False  # warned once: an engine without request gauges
        self.syncs: dict[int, ReplicaSync] = {}
        self.stream: EventStream | None = None
        self.ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.loops: dict[str, LoopRun] = {}  # the supervised background loops, by name
        self._supervisor: asyncio.Task[None] | None = None
        self._instance_id: str | None = None
        self._evicting: bool | None = None  # Redis's maxmemory-policy is allkeys-* (None: unread)
        self._stopped = False
        self.started_at = time.time()

    # ------------------------------------------------------------------ public

    @property
    def replica_id(self) -> str:
        return self.settings.replica_id

    @property
    def primary_id(self) -> str:
        return index_replica_id(self.settings.replica_id, self.settings.data_parallel_rank)

    async def start(self) -> None:
        if self._supervisor is None:
            self._supervisor = asyncio.create_task(
                self._supervise(), name=f"agent-{self.primary_id}"
            )

    async def stop(self, deregister: bool | None = None) -> None:
        """Cancel everything, then release the replica's registration. ``deregister``: None
        does what ``settings.deregister_on_stop`` says (auto: deregister unless the engine
        still answers ``/health``, else hand the registration over to the next agent for
        ``handover_window_s``); True deregisters; False leaves the registration as it is.

        Every step runs (:meth:`_stop_steps`: the tasks, the subscription, each rank, the
        registration, the scraper, the trace file, the ZMQ context), in a task of its own
        that the caller's cancellations do not reach (:func:`~cachecore.tasks.run_to_end`):
        one step failing or the stop being cancelled ended it in that step, and the SUB
        socket, the trace file and the context after it stayed open for the rest of the
        process. A failing step is logged with its traceback and the first failure raised
        once all ran; a cancellation is raised after them. A step that blocks is cancelled
        after :data:`STOP_STEP_S` (logged as failed) and the next one runs."""
        self._stopped = True
        steps = run_steps(self._stop_steps(deregister), "agent stop", replica=self.primary_id)
        await run_to_end(steps, self.stop_limit_s, f"agent {self.primary_id} stop")

    @property
    def stop_limit_s(self) -> float:
        """How long :meth:`stop` may take in all. Its steps' bounds are the real ones; this
        one keeps a step that ignores its cancellation from holding the caller for ever:
        each step that waits (the tasks, each rank, the registration, the scraper), and
        one more. What waits on a stop (the embedded agents, the agent CLI's shutdown)
        derives its own bound from this one (:func:`~cachecore.tasks.enclosing_limit_s`)."""
        waits = len(self.syncs) + 3
        return STOP_STEP_S * (waits + 1) + self.settings.scrape_timeout_s

    def _stop_steps(self, deregister: bool | None) -> Iterator[Step]:
        """:meth:`stop`'s steps in order, each with its bound. A generator: what follows the
        tasks is read once they have ended (the stream's task makes a new rank's sync)."""
        yield "tasks", self._stop_tasks, STOP_STEP_S
        stream = self.stream
        if stream is not None:  # subscribed by a start-up its stream task never ran in

            async def close_stream() -> None:
                stream.close()

            yield "stream", close_stream, STOP_STEP_S
        for rank, sync in list(self.syncs.items()):
            yield f"rank {rank}", sync.stop, STOP_STEP_S
        link = self.registry_link
        if deregister is not False and link is not None:

            async def release() -> None:
                await self._release_registration(link, force=deregister is True)

            # its /health probe alone may take scrape_timeout_s
            yield "registration", release, STOP_STEP_S + self.settings.scrape_timeout_s
        yield "scraper", self.scraper.close, STOP_STEP_S
        if self.trace is not None:
            yield "trace", self._close_trace, STOP_STEP_S
        if self._own_ctx:
            yield "zmq context", self._destroy_ctx, STOP_STEP_S

    async def _stop_tasks(self) -> None:
        await cancel_and_wait(self._supervisor, *self._tasks)
        self._tasks.clear()
        self._supervisor = None

    async def _close_trace(self) -> None:
        assert self.trace is not None
        try:
            self.trace.flush()
        finally:
            if self._own_trace:
                self.trace.close()

    async def _destroy_ctx(self) -> None:
        self.ctx.destroy(linger=0)

    async def _release_registration(self, link: RegistryLink, force: bool) -> None:
        """A clean stop's end of the registration. Deregistering takes the replica out of
        every discovering gateway (after their removal grace), which is right when its
        engine is gone (a scale-down, an engine crash) and wrong when only the agent
        restarts (an upgrade): its healthy engine left routing until the next agent's first
        heartbeat, and came back as a new replica. So while the engine answers /health the
        registration is handed over: kept ``handover_window_s`` from now, for the next
        agent's first heartbeat to overwrite. The index entries stay either way (no stop
        touches them); the next agent loads them and replays what it missed.

        What happened is one log line with the ``outcome`` (:class:`RegistrationRelease`),
        not a metric: the process, or the agent and its registry, end with this stop, so a
        counter it moved would almost never be scraped (docs/agent.md)."""
        rid, s = self.primary_id, self.settings
        mode = StopRegistration.ALWAYS if force else s.deregister_on_stop
        serving: bool | None = None
        if link.registered and mode is StopRegistration.AUTO:
            serving = await self.scraper.healthy()  # bounded by scrape_timeout_s
        # never registered: nothing of ours to hand over (a predecessor's stays); the
        # deregistration removes only ours, in case a heartbeat wrote it and then failed
        hand_over = link.registered and mode is not StopRegistration.ALWAYS and serving is not False
        fields: dict[str, Any] = {
            "replica": rid,
            "action": "handover" if hand_over else "deregister",
            "mode": mode.value,
            "engine_serving": serving,
            "handover_window_s": s.handover_window_s,
            "agent_id": link.agent_id,
        }
        try:
            if hand_over:
                done = await link.hand_over(rid, s.handover_window_s)
            else:
                done = await link.deregister(rid)
        except Exception as exc:  # the registration lapses after its heartbeat TTL
            log.warning(
                "registration hand-over failed" if hand_over else "deregistration failed",
                extra={
                    **fields,
                    "outcome": RegistrationRelease.FAILED.value,
                    "registration_ttl_s": s.registration_ttl_s,
                    "error": repr(exc),
                },
            )
            return
        if not done:  # lapsed, or a successor's registration: left alone
            outcome, message = (
                RegistrationRelease.ABSENT,
                "no registration of this agent's to release",
            )
        elif hand_over:
            outcome, message = (
                RegistrationRelease.HANDOVER,
                "registration left for the replica's next agent",
            )
        else:
            outcome, message = RegistrationRelease.DEREGISTER, "replica deregistered"
        log.info(message, extra={**fields, "outcome": outcome.value})

    async def wait_ready(self, timeout_s: float) -> None:
        """Until the startup catch-up is done (tests, embedded start). Not wait_for: on 3.11
        it swallows a cancellation that arrives as the agent becomes ready."""
        async with asyncio.timeout(timeout_s):
            await self.ready.wait()

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Until every queued command of every rank has been applied (tests)."""
        async with asyncio.timeout(timeout_s):
            for sync in list(self.syncs.values()):
                await sync.drain()

    @property
    def registration_conflict(self) -> bool:
        """Another agent registered our replica id within the last three heartbeats."""
        link = self.registry_link
        return link is not None and link.in_conflict(3 * self.settings.heartbeat_interval_s)

    def health(self) -> dict[str, Any]:
        stream = self.stream
        lat = self.metrics.latency
        replicas = {}
        for sync in self.syncs.values():
            replicas[sync.replica_id] = {
                "state": sync._published_state().value,
                "epoch": sync.epoch,
                "last_seq": sync.written_seq,
                "received_seq": sync.received_seq,
                "queued": sync.queued,
                "mirror_blocks": len(sync.mirror),
                "dirty": sync.dirty,
                "lag_s": round(max(0.0, time.time() - sync.last_ts), 3) if sync.last_ts else None,
            }
        problems = [stream.wiring_problem if stream else None, self.silence.problem]
        stream_problem = "; ".join(p for p in problems if p is not None) or None
        if not self.ready.is_set():
            status = "starting"
        elif (
            any(s.dirty for s in self.syncs.values())
            or not self.engine_reachable
            or self.registration_conflict
            or stream_problem is not None
            or any(loop.failing for loop in self.loops.values())
        ):
            status = "degraded"
        else:
            status = "ok"
        p50, p99 = lat.percentile(50), lat.percentile(99)
        return {
            "status": status,
            "replica": self.replica_id,
            "engine_url": self.settings.engine_url,
            "engine_reachable": self.engine_reachable,
            "registration_conflict": self.registration_conflict,
            "engine_start": self.engine.start_time if self.engine else None,
            "model": self.engine.model if self.engine else None,
            "block_size": self.engine.block_size if self.engine else None,
            "stream_last_seq": stream.last_seq if stream else None,
            "stream_problem": stream_problem,
            "replicas": replicas,
            "loops": {
                loop.name: {
                    "restarts": loop.restarts,
                    "failures_in_row": loop.in_a_row,
                    "failing": loop.failing,
                    "last_error": loop.last_error,
                }
                for loop in self.loops.values()
            },
            "event_to_index_ms": {
                "p50": None if p50 is None else round(p50 * 1000, 3),
                "p99": None if p99 is None else round(p99 * 1000, 3),
                "samples": len(lat),
            },
        }

    # ------------------------------------------------------------- supervisor

    async def _supervise(self) -> None:
        """Start-up under the background loops' rule (:meth:`_loop`, loop ``start``): an
        unexpected error in it (an index or library error escaping the steps that retry
        what they expect) left the agent ``starting`` for the life of the process, indexing
        nothing; now the failed attempt is undone and start-up retried after the pause."""
        await self._loop(self.loops.setdefault("start", LoopRun("start")), self._start_once)

    async def _start_once(self, run: LoopRun) -> None:
        try:
            await self._start_up()
        except Exception:
            # a retry must find nothing of this attempt: no second subscription, scraper
            # or sync worker beside the next attempt's (stop() undoes a cancelled one)
            await self._undo_start()
            raise
        run.progressed()

    async def _start_up(self) -> None:
        """Wait for the engine, load the index's state, subscribe, spawn the loops."""
        snap = await self._wait_for_engine()
        info = await self._engine_info(snap)
        self.engine = info
        self.engine_reachable = True
        primary = await self._new_sync(self.settings.data_parallel_rank or 0)
        loaded, cause = await self._load(primary)
        restart_first = False
        if not loaded:
            await primary.put(ClearReplica(ReplicaState.LIVE, info.start_time, cause, None, None))
        else:
            known = primary.engine_start
            if known and abs(known - info.start_time) > _START_TIME_TOLERANCE_S:
                restart_first = True
            elif not known and info.start_time:
                # a meta written by someone else (the gateway marks replicas live)
                primary.engine_start = info.start_time
                await self._retry_index(
                    lambda: self._set_engine_start(primary.replica_id, info.start_time),
                    "set_engine_start",
                )
            # the engine answers: whatever state the index had, it is reachable now
            await primary.put(CheckIndex())
        self._instance_id = await self._instance()
        await self._check_eviction()
        stream = self.stream = self._make_stream()
        stream.last_seq = primary.written_seq
        stream.subscribe()
        self._spawn("scrape", self._scrape_loop)
        self._spawn("check", self._check_loop)
        if self.registry_link is not None:
            self._spawn("heartbeat", self._heartbeat_loop)
        self._spawn(
            "stream",
            lambda loop: self._run_stream(stream, restart_first, loop),
            probe=lambda: stream.last_seq,
        )
        await stream.caught_up.wait()
        log.info(
            "agent ready",
            extra={
                "replica": self.primary_id,
                "model": info.model,
                "block_size": info.block_size,
                "last_seq": stream.last_seq,
                "restored": loaded,
            },
        )
        self.ready.set()

    async def _undo_start(self) -> None:
        """Undo a failed start-up attempt: its loops, its subscription (a stream task that
        never ran has not closed it) and every rank's sync, each stopped as an agent stop
        would (what they wrote stays in the index: the next attempt loads it, as a
        restarted agent would)."""
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        for name in [n for n in self.loops if n != "start"]:
            del self.loops[name]
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        for sync in self.syncs.values():
            await sync.stop()
        self.syncs.clear()

    def _spawn(
        self,
        name: str,
        run: Callable[[LoopRun], Awaitable[None]],
        probe: Callable[[], object] | None = None,
    ) -> None:
        loop = self.loops[name] = LoopRun(name, probe)
        self._tasks.append(
            asyncio.create_task(self._loop(loop, run), name=f"agent-{self.primary_id}-{name}")
        )

    async def _loop(self, loop: LoopRun, run: Callable[[LoopRun], Awaitable[None]]) -> None:
        """The one supervision rule of every background loop: none gives up. An unexpected
        error (a bug, a library's) ended a loop silently for the life of the process (no
        more scrapes, checks or heartbeats: the registration expired) while /health said
        ok; now it is logged with its traceback, counted, and the loop restarts after a
        pause that doubles while it fails without progress (0.5 s to 5 s)."""
        while True:
            try:
                await run(loop)
                return  # the loops run until cancelled; one that ends meant to
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                pause = loop.failed(exc)
                self.metrics.loop_restarts.labels(self.primary_id, loop.name).inc()
                log.exception(
                    "agent loop failed; restarting it",
                    extra={
                        "replica": self.primary_id,
                        "loop": loop.name,
                        "failures_in_row": loop.in_a_row,
                        "pause_s": pause,
                    },
                )
                await asyncio.sleep(pause)

    async def _run_stream(self, stream: EventStream, restart_first: bool, loop: LoopRun) -> None:
        """A restarted stream replays what it missed (a start-time restart is done on the
        first run only)."""
        await stream.run(restart_first and loop.restarts == 0)

    async def _wait_for_engine(self) -> EngineSnapshot:
        t0 = time.monotonic()
        marked = engine_warned = False
        self._index_warned = False  # one WARNING per wait, not one per scrape
        while True:
            try:
                snap = await self.scraper.metrics()
            except ScrapeError as exc:
                self.metrics.scrape_errors.inc()
                self.metrics.engine_up.set(0)
                waited = time.monotonic() - t0
                if not marked and waited >= self.settings.unavailable_after_s:
                    marked = await self._mark_persisted_unavailable()
                # once per wait: at DEBUG only, a wrong --engine-url left the agent silent
                # (not ready, nothing logged) for as long as it ran
                late = not engine_warned and waited >= self.settings.unavailable_after_s
                log.log(
                    logging.WARNING if late else logging.DEBUG,
                    "engine not reachable; waiting for it (logged once)"
                    if late
                    else "engine not reachable yet",
                    extra={
                        "replica": self.primary_id,
                        "engine_url": self.settings.engine_url,
                        "error": str(exc),
                    },
                )
                engine_warned = engine_warned or late
                await asyncio.sleep(self.settings.scrape_interval_s)
                continue
            if snap.start_time is None:
                log.warning(
                    "engine /metrics has no process_start_time_seconds: restarts are "
                    "detected by sequence only",
                    extra={"replica": self.primary_id},
                )
            self._scrape_ok(snap)
            return snap

    async def _mark_persisted_unavailable(self) -> bool:
        """The engine is down at agent start: keep its entries but stop routing to them."""
        try:
            meta = await self.index.meta(self.primary_id)
            if meta.state in (ReplicaState.LIVE, ReplicaState.COLD):
                await self.index.set_state(self.primary_id, ReplicaState.UNAVAILABLE, _now_ms())
            return True
        except Exception as exc:
            level = logging.DEBUG if self._index_warned else logging.WARNING
            log.log(level, "index not reachable", extra={"error": repr(exc)})
            self._index_warned = True
            return False

    async def _engine_info(self, snap: EngineSnapshot) -> EngineInfo:
        block_size = self.settings.block_size or snap.block_size
        while block_size is None:
            log.error(
                "engine reports no block size (vllm:cache_config_info); pass --block-size "
                "(for SGLang: its --page-size)",
                extra={"replica": self.primary_id},
            )
            await asyncio.sleep(max(5.0, self.settings.scrape_interval_s))
            try:
                snap = await self.scraper.metrics()
            except ScrapeError:
                continue
            block_size = snap.block_size
        model = self.settings.model or await self.scraper.model() or snap.model_name
        while model is None:
            log.error(
                "engine reports no model (/v1/models); pass --model",
                extra={"replica": self.primary_id},
            )
            await asyncio.sleep(max(5.0, self.settings.scrape_interval_s))
            model = await self.scraper.model()
        return EngineInfo(
            model, block_size, snap.capacity_blocks(block_size), snap.start_time or 0.0
        )

    async def _load(self, sync: ReplicaSync) -> tuple[bool, str]:
        """Adopt the index's persisted state for ``sync``: (True, "") when adopted, else
        (False, the cause of the clear it needs): "fresh" when the index knows nothing of
        the replica, "corrupt_mirror" when its records cannot be restored (a corrupt or
        foreign index: its entries are dropped and rebuilt from the engine's events, as no
        retry would make them restorable)."""
        try:
            return await self._retry_index(sync.load, "load"), "fresh"
        except MirrorRecordError as exc:
            log.error(
                "the index's mirror records of this replica cannot be restored: its "
                "entries are dropped and rebuilt from the engine's events",
                extra={"replica": sync.replica_id, "error": str(exc)},
            )
            return False, "corrupt_mirror"
        except ValueError as exc:  # a meta field no agent writes (a broken tool's "abc")
            log.error(
                "the index's meta record of this replica cannot be read: its entries are "
                "dropped and rebuilt from the engine's events (a non-numeric epoch cannot "
                "be cleared: the rewrite is retried until the record is repaired)",
                extra={"replica": sync.replica_id, "error": str(exc)},
            )
            return False, "corrupt_meta"

    async def _retry_index(self, call: Callable[[], Awaitable[bool]], what: str) -> bool:
        delay = 0.1
        while True:
            try:
                return await call()
            except ValueError:
                # the index answered, with records or meta values no agent writes (a
                # MirrorRecordError, a non-numeric last_seq): no retry makes them readable
                raise
            except Exception as exc:
                log.warning(
                    "index not reachable at startup; retrying",
                    extra={"replica": self.primary_id, "op": what, "error": repr(exc)},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.index_retry_max_s)

    async def _set_engine_start(self, replica: str, start: float) -> bool:
        await self.index.set_engine_start(replica, start)
        return True

    async def _instance(self) -> str | None:
        if not isinstance(self.index, HasInstanceId):
            return None
        try:
            return await self.index.instance_id()
        except Exception:
            return None

    async def _check_eviction(self) -> None:
        """Read the index server's ``maxmemory-policy`` (each primary's on Cluster): under an
        ``allkeys-*`` policy Redis evicts this replica's entries and mirror without a word
        (docs/index.md requires noeviction or volatile-*). An ERROR when it is first seen
        so (and the gauge kvgate_agent_index_evicting at 1), an INFO when it is fixed; the
        index check finds and rewrites the lost entries meanwhile (``_entries_missing``)."""
        index = self.index
        if not isinstance(index, HasEvictionPolicy):
            return
        try:
            policies = await index.eviction_policies()
        except Exception:  # the index is down: its checks say so
            return
        evicting = sorted({p for p in policies.values() if p is not None and evicts_any_key(p)})
        now = bool(evicting)
        self.metrics.index_evicting.set(1 if now else 0)
        if now and self._evicting is not True:
            log.error(
                "the index's Redis evicts any key (maxmemory-policy %s): it drops replicas' "
                "index entries and mirrors under memory pressure, losing cache-aware routing "
                "until the agent notices and rewrites them; set maxmemory-policy noeviction "
                "(or volatile-*), and give Redis the memory the index needs",
                ", ".join(evicting),
                extra={"replica": self.primary_id, "policies": policies},
            )
        elif not now and self._evicting:
            log.info(
                "the index's Redis no longer evicts any key",
                extra={"replica": self.primary_id, "policies": policies},
            )
        elif self._evicting is None and any(p is None for p in policies.values()):
            log.info(
                "could not read the index's maxmemory-policy (INFO memory lacks it and "
                "CONFIG GET is refused); it must be noeviction or volatile-*",
                extra={"replica": self.primary_id},
            )
        self._evicting = now

    # ------------------------------------------------------------------- ranks

    async def _new_sync(self, rank: int) -> ReplicaSync:
        assert self.engine is not None
        s = self.settings
        rid = index_replica_id(s.replica_id, rank)
        mirror = ReplicaMirror(BlockKeyer(self.engine.block_size), self.engine.model)
        knobs = SyncKnobs(
            queue_size=s.queue_size,
            max_coalesce_batches=s.max_coalesce_batches,
            max_coalesce_blocks=s.max_coalesce_blocks,
            resync_chunk_blocks=s.resync_chunk_blocks,
            retry_max_s=s.index_retry_max_s,
        )
        sync = ReplicaSync(
            rid,
            self.index,
            mirror,
            self.metrics,
            knobs,
            self.trace,
            attention_group=s.attention_group,
        )
        sync.engine_reachable = self.engine_reachable
        sync.engine_start = self.engine.start_time
        self.syncs[rank] = sync
        sync.start()
        return sync

    async def _sync_for(self, rank: int) -> ReplicaSync:
        sync = self.syncs.get(rank)
        if sync is not None:
            return sync
        sync = await self._new_sync(rank)
        assert self.engine is not None
        loaded, cause = await self._load(sync)
        if not loaded:
            await sync.put(ClearReplica(ReplicaState.LIVE, self.engine.start_time, cause))
        else:
            # a rank we had not seen since the agent started: its seq history is unknown
            # to this stream, so its persisted entries cannot be trusted
            await sync.put(ClearReplica(ReplicaState.COLD, self.engine.start_time, "new_rank"))
        return sync

    def _make_stream(self) -> EventStream:
        s = self.settings
        replay = None
        if s.replay:
            replay = ReplayClient(
                self.ctx,
                s.replay,
                first_reply_timeout_s=s.replay_timeout_s,
                idle_timeout_s=s.replay_timeout_s,
                total_timeout_s=s.replay_total_timeout_s,
                max_batches=s.max_replay_batches,
                max_payload_bytes=s.max_payload_bytes,
            )
        return EventStream(
            name=self.primary_id,
            ctx=self.ctx,
            events_endpoint=s.events,
            replay=replay,
            topic=s.topic,
            metrics=self.metrics,
            sync_for=self._sync_for,
            all_syncs=lambda: list(self.syncs.values()),
            clear_command=self._clear_command,
            start_time_changed=self._start_time_changed,
            default_rank=s.data_parallel_rank or 0,
            max_payload_bytes=s.max_payload_bytes,
            max_tokens_per_event=s.max_tokens_per_event,
            rcvhwm=s.rcvhwm,
            stale_probe_cooldown_s=s.stale_probe_cooldown_s,
        )

    async def _clear_command(self, cause: str, state: ReplicaState) -> ClearReplica:
        """The clear every rank gets. After a restart the engine may come back with another
        model or block size: re-read both so the new keys are right."""
        assert self.engine is not None
        keyer: BlockKeyer | None = None
        model: str | None = None
        if cause == "engine_restart":
            snap = self.last_snapshot
            with contextlib.suppress(ScrapeError):
                snap = await self.scraper.metrics()  # the new process's start time
                self._scrape_ok(snap)
            bs = self.settings.block_size or (snap.block_size if snap else None)
            if bs is not None and bs != self.engine.block_size:
                keyer = BlockKeyer(bs)
            new_model = self.settings.model or await self.scraper.model()
            if new_model is not None and new_model != self.engine.model:
                model = new_model
            start = snap.start_time if snap and snap.start_time else self.engine.start_time
            self.engine = EngineInfo(
                model or self.engine.model,
                keyer.block_size if keyer else self.engine.block_size,
                snap.capacity_blocks(keyer.block_size if keyer else self.engine.block_size)
                if snap
                else self.engine.num_gpu_blocks,
                start,
            )
        return ClearReplica(state, self.engine.start_time, cause, keyer, model)

    # ----------------------------------------------------------------- engine

    def _scrape_ok(self, snap: EngineSnapshot) -> None:
        self._metrics_failing = False
        self.last_snapshot = snap
        self._last_scrape_ok = time.monotonic()
        self.metrics.engine_up.set(1)

    def _start_changed(self, snap: EngineSnapshot) -> bool:
        return (
            self.engine is not None
            and snap.start_time is not None
            and abs(snap.start_time - self.engine.start_time) > _START_TIME_TOLERANCE_S
        )

    async def _start_time_changed(self) -> bool:
        try:
            snap = await self.scraper.metrics()
        except ScrapeError:
            self.metrics.scrape_errors.inc()
            return False
        self._scrape_ok(snap)
        return self._start_changed(snap)

    async def _scrape_loop(self, loop: LoopRun) -> None:
        while True:
            await asyncio.sleep(self.settings.scrape_interval_s)
            await self._scrape_once()
            loop.progressed()

    async def _scrape_once(self) -> None:
        s = self.settings
        stream = self.stream
        assert stream is not None
        try:
            snap = await self.scraper.metrics()
        except ScrapeError as exc:
            self.metrics.scrape_errors.inc()
            self.metrics.engine_up.set(0)
            down_for = time.monotonic() - self._last_scrape_ok
            if self.engine_reachable and down_for >= s.unavailable_after_s:
                if await self.scraper.healthy():
                    # only its metrics fail (slow or broken): it serves, and its events
                    # keep its index current, so its cache stays routable (a slow
                    # /metrics used to hide a healthy replica's cache from routing)
                    if not self._metrics_failing:
                        self._metrics_failing = True
                        log.warning(
                            "engine metrics failing but /health answers: replica stays "
                            "routable, its load is not published",
                            extra={"replica": self.primary_id, "error": str(exc)},
                        )
                    return
                self.engine_reachable = False
                log.warning(
                    "engine unreachable: replica unavailable for routing",
                    extra={"replica": self.primary_id, "error": str(exc)},
                )
                for sync in list(self.syncs.values()):
                    await sync.put(SetEngineReachable(False))
            return
        self._scrape_ok(snap)
        # one rank of a data-parallel server: its own core's queues and progress (the
        # server's /metrics holds every rank's, labelled by engine)
        core = snap.for_core(s.data_parallel_rank)
        now = time.monotonic()
        stalled_s = self.progress.observe(core, now)
        self.metrics.engine_stalled.set(stalled_s)
        self._observe_silence(snap, stream, now)
        if self.load_link is not None and core.busy_reported:
            await self.load_link.publish(self.primary_id, core, self.metrics, stalled_s)
        elif self.load_link is not None and not self._busy_unreported_warned:
            # zeros it never measured would read as an idle engine: the gateways' views
            # and their background watches (D33 engine_idle) take no record as unknown
            self._busy_unreported_warned = True
            log.warning(
                "engine exports no request gauges (vllm:num_requests_running/waiting; "
                "vLLM's --disable-log-stats): its load is not published",
                extra={"replica": self.primary_id},
            )
        # a new process first clears (still unroutable), only then becomes reachable:
        # its old entries must never be routable, not even for a moment
        if self._start_changed(snap):
            async with stream.lock:
                if self._start_changed(snap):  # the stream may have handled it meanwhile
                    await stream.restart("start_time")
        if not self.engine_reachable:
            self.engine_reachable = True
            log.info("engine reachable again", extra={"replica": self.primary_id})
            for sync in list(self.syncs.values()):
                await sync.put(SetEngineReachable(True))

    def _observe_silence(self, snap: EngineSnapshot, stream: EventStream, now: float) -> None:
        """Whether the engine computes without publishing KV events, judged on the core
        whose events this agent receives (core 0 of a data-parallel server for an agent
        given no rank: every vLLM rank publishes on its own port, rank 0 on the base one)."""
        assert self.engine is not None
        rank = self.settings.data_parallel_rank
        work = snap.for_core(0 if rank is None else rank)
        episodes = self.silence.episodes
        problem = self.silence.observe(
            work, self.engine.block_size, stream.last_live_batch(now), now
        )
        if self.silence.episodes != episodes:
            self.metrics.silences.inc()
        self.metrics.events_silent.set(0 if problem is None else 1)

    async def _check_loop(self, loop: LoopRun) -> None:
        while True:
            await asyncio.sleep(self.settings.index_check_interval_s)
            current = await self._instance()
            changed = (
                current is not None
                and self._instance_id is not None
                and current != self._instance_id
            )
            if current is not None:
                if changed:
                    log.warning(
                        "index instance changed (restart): rewriting from the mirror",
                        extra={"replica": self.primary_id},
                    )
                self._instance_id = current
            await self._check_eviction()  # one INFO: a policy changed at run time is seen
            for sync in list(self.syncs.values()):
                await sync.put(CheckIndex(server_changed=changed))
            loop.progressed()

    async def _heartbeat_loop(self, loop: LoopRun) -> None:
        assert self.registry_link is not None and self.engine is not None
        while True:
            snap = self.last_snapshot
            info = self.engine
            await self.registry_link.heartbeat(
                self.primary_id,
                model=info.model,
                block_size=info.block_size,
                capacity_blocks=(snap.capacity_blocks(info.block_size) if snap else None)
                or info.num_gpu_blocks,
                metrics=self.metrics,
            )
            loop.progressed()
            await asyncio.sleep(self.settings.heartbeat_interval_s)


def _now_ms() -> int:
    return int(time.time() * 1000)
