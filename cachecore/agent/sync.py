"""One (replica, data-parallel rank): the agent's mirror of its engine cache and the ordered
writer that keeps the index equal to it.

A :class:`ReplicaSync` owns one queue and one worker task. Everything that changes the
replica's index state goes through that queue as a command, so batches, clears, state changes
and index checks apply in exactly the order the event stream decided them, while several
replicas (or ranks) progress concurrently. The worker coalesces consecutive batches into one
:class:`~cachecore.lifecycle.IndexWrite` (one backend call) without reordering anything.

Invariants (checked by the tests through :meth:`ReplicaSync.check_invariants`):

* after the worker drained its queue and is not dirty, the index's blocks of the replica's
  current epoch equal ``mirror.blocks()``, and the index's persisted mirror equals
  ``mirror.snapshot()``;
* ``written_seq`` is the seq of the last batch whose write completed and equals the index
  meta's ``last_seq`` (or the index lost our state: the next check resyncs); within an
  epoch it never goes back (a clear starts a new epoch from the index's seq), and the
  persisted mirror holds exactly the batches up to it, so an agent that restarts from the
  index replays each batch after it once and none before it;
* ``mirrored_seq`` is the seq of the last batch applied to the mirror (>= ``written_seq``);
  a resync writes the mirror's snapshot with that seq, never an older one;
* when an index call fails the replica is ``dirty`` and its next successful index call is a
  complete rewrite from the mirror (RESYNC), so no write is ever lost, only delayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.trace import TraceWriter
from cachecore.index.base import PrefixIndex, ReplicaState, StaleEpochError
from cachecore.index.redis import EntryCounts
from cachecore.keys import BlockKeyer
from cachecore.kvevents import BlockRemoved, BlockStored, EventBatch, KVEvent
from cachecore.lifecycle import IndexWrite, MirrorCounters, ReplicaMirror
from cachecore.tasks import cancel_and_wait

log = logging.getLogger(__name__)

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention"})
"""``kv_cache_spec_kind`` values of full-attention groups. For hybrid models (sliding window,
mamba) only a full-attention group describes a reusable prefix, so only it is indexed."""


# --------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class ApplyBatch:
    seq: int
    batch: EventBatch
    received: float  # time.time() when the agent received it
    # came from a replay (a gap, a restart, catching up): its age is the backlog's, not
    # the live event-to-index latency, which it would swamp for thousands of batches
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class ClearReplica:
    """Bump the index epoch (drop every entry) and empty the mirror."""

    state: ReplicaState
    engine_start: float
    cause: str
    keyer: BlockKeyer | None = None  # a restarted engine may come back with a new config
    model: str | None = None


@dataclass(frozen=True, slots=True)
class SetEngineReachable:
    reachable: bool


@dataclass(frozen=True, slots=True)
class CheckIndex:
    """Verify the index still holds our epoch and last seq (a Redis restart loses both, an
    old snapshot rolls them back) and, where the backend counts them, as many entries and
    mirror records as the mirror (an evicting Redis drops those hashes and keeps the meta);
    resync from the mirror when it does not."""

    server_changed: bool = False


Command = ApplyBatch | ClearReplica | SetEngineReachable | CheckIndex


@runtime_checkable
class CountsEntries(Protocol):
    """Index backends that count a replica's entries cheaply (Redis: ``HLEN``). The memory
    index does not: its own bound evicts entries by design, and a resync would not stay."""

    async def entry_counts(self, replica: str) -> EntryCounts: ...


@dataclass(frozen=True, slots=True)
class SyncKnobs:
    queue_size: int = 10_000
    max_coalesce_batches: int = 512
    max_coalesce_blocks: int = 20_000
    resync_chunk_blocks: int = 5_000
    retry_max_s: float = 5.0


def _when(ts: float) -> float:
    """A batch's time for the trace: the engine's, or now when it sent none usable."""
    return ts if ts > 0 else time.time()


def _counter_deltas(now: MirrorCounters, before: MirrorCounters) -> dict[str, int]:
    return {
        name: getattr(now, name) - getattr(before, name)
        for name in MirrorCounters.__dataclass_fields__
        if getattr(now, name) != getattr(before, name)
    }


class ReplicaSync:
    """Mirror + epoch + ordered index writer of one index replica id."""

    def __init__(
        self,
        replica_id: str,
        index: PrefixIndex,
        mirror: ReplicaMirror,
        metrics: AgentMetrics,
        knobs: SyncKnobs | None = None,
        trace: TraceWriter | None = None,
        clock_ms: Callable[[], int] | None = None,
        attention_group: int | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.index = index
        self.mirror = mirror
        self.metrics = metrics
        self.knobs = knobs or SyncKnobs()
        self.trace = trace
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self.epoch = 0
        self.state = ReplicaState.UNKNOWN  # the routable state (LIVE or COLD) we publish
        self.engine_reachable = True
        self.engine_start = 0.0
        self.written_seq = -1
        self.mirrored_seq = -1
        self.received_seq = -1
        self.dirty = False  # an index call failed: the next one must be a full rewrite
        self.last_ts = 0.0
        self._pinned_group = attention_group
        if attention_group is not None:
            mirror.group_idx = attention_group
        self._queue: asyncio.Queue[Command] = asyncio.Queue(self.knobs.queue_size)
        self._task: asyncio.Task[None] | None = None
        self._inflight: asyncio.Task[None] | None = None
        self._counters = replace(mirror.counters)
        # block sizes already warned about, and whether unscoped drops were (once each)
        self._warned_sizes: set[int] = set()
        self._warned_unscoped = False
        self._retry_s = 0.05
        self._next_retry = 0.0
        self._m_events = metrics.events_applied.labels(replica_id)
        self._m_stored = metrics.blocks_stored.labels(replica_id)
        self._m_removed = metrics.blocks_removed.labels(replica_id)
        self._m_writes = metrics.index_writes.labels(replica_id)

    # ---------------------------------------------------------------- lifecycle

    async def load(self) -> bool:
        """Adopt the index's persisted state (agent restart). Returns False when the index
        knows nothing of this replica."""
        meta = await self.index.meta(self.replica_id)
        if meta.unreadable:  # the agent's load rebuilds the replica (cause corrupt_meta)
            raise ValueError(f"meta fields that are no number: {', '.join(meta.unreadable)}")
        if meta.state is ReplicaState.UNKNOWN:
            return False
        records = await self.index.load_mirror(self.replica_id)
        self.mirror.restore(records)
        self.epoch = meta.epoch
        self.state = (
            meta.state
            if meta.state in (ReplicaState.LIVE, ReplicaState.COLD)
            else ReplicaState.LIVE
        )
        self.engine_start = meta.engine_start
        self.written_seq = self.mirrored_seq = self.received_seq = meta.last_seq
        self._counters = replace(self.mirror.counters)
        self.metrics.mirror_blocks.labels(self.replica_id).set(len(self.mirror))
        log.info(
            "agent state loaded from the index",
            extra={
                "replica": self.replica_id,
                "epoch": self.epoch,
                "last_seq": meta.last_seq,
                "mirror_records": len(records),
            },
        )
        return True

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"agent-sync-{self.replica_id}")

    async def stop(self) -> None:
        # repeated cancellation: a write's index call can swallow one (cachecore.tasks)
        await cancel_and_wait(self._inflight)
        self._inflight = None
        await cancel_and_wait(self._task)
        self._task = None

    async def put(self, cmd: Command) -> None:
        # the stream puts every command in its decided order, so what follows a restart's
        # clear is the new process's: its seq counts from scratch (the old one's stayed in
        # /health until the new engine's first batch, for ever if none came)
        if isinstance(cmd, ApplyBatch):
            self.received_seq = cmd.seq
        elif isinstance(cmd, ClearReplica) and cmd.cause == "engine_restart":
            self.received_seq = -1
        await self._queue.put(cmd)

    async def drain(self) -> None:
        """Wait until every queued command has been processed (tests, shutdown)."""
        await self._queue.join()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    # ------------------------------------------------------------------- worker

    async def _run(self) -> None:
        while True:
            first = await self._queue.get()
            cmds = [first]
            blocks = self._blocks_of(first)
            while (
                len(cmds) < self.knobs.max_coalesce_batches
                and blocks < self.knobs.max_coalesce_blocks
                and not self._queue.empty()
            ):
                cmd = self._queue.get_nowait()
                cmds.append(cmd)
                blocks += self._blocks_of(cmd)
            try:
                await self._process(cmds)
                if self._queue.empty():
                    await self._settle()  # idle: complete the write before drain() returns
            except asyncio.CancelledError:
                raise
            except Exception:  # the worker must outlive any bug: count, mark dirty, go on
                log.exception(
                    "agent worker failed on a command group", extra={"replica": self.replica_id}
                )
                self.dirty = True
            finally:
                for _ in cmds:
                    self._queue.task_done()

    @staticmethod
    def _blocks_of(cmd: Command) -> int:
        if not isinstance(cmd, ApplyBatch):
            return 0
        n = 0
        for ev in cmd.batch.events:
            if isinstance(ev, BlockStored | BlockRemoved):
                n += len(ev.block_hashes)
        return n

    async def _process(self, cmds: list[Command]) -> None:
        acc = IndexWrite()
        covered: list[ApplyBatch] = []
        for cmd in cmds:
            if isinstance(cmd, ApplyBatch):
                write, cleared = self._apply_to_mirror(cmd)
                self.mirrored_seq = cmd.seq
                if cleared:
                    acc, covered = IndexWrite(), []
                    if self.trace is not None:
                        self.trace.clear(_when(cmd.batch.ts), self.replica_id)
                    await self._clear(ReplicaState.LIVE, self.engine_start, "all_blocks_cleared")
                write.seq = cmd.seq
                acc.merge(write)
                covered.append(cmd)
                if self.trace is not None:
                    self.trace.blocks(_when(cmd.batch.ts), self.replica_id, write.blocks)
            else:
                await self._flush(acc, covered)
                acc, covered = IndexWrite(), []
                if isinstance(cmd, ClearReplica):
                    self._reconfigure(cmd)
                    self.mirror.clear()
                    # the emptied mirror stands for no batch: a resync before the next
                    # batch must not write the old stream's seq (a restart counts from 0)
                    self.mirrored_seq = -1
                    if self.trace is not None:
                        # agent time: the batches after it (a replay) may be older; the
                        # analysis replays a replica's records in file order for that
                        self.trace.clear(time.time(), self.replica_id)
                    await self._clear(cmd.state, cmd.engine_start, cmd.cause)
                    # a new stream (engine restart) may count from zero again
                    self.mirrored_seq = self.written_seq
                elif isinstance(cmd, SetEngineReachable):
                    await self._set_reachable(cmd.reachable)
                else:
                    await self._check_index(cmd)
        await self._flush(acc, covered)
        self._sync_counters()

    def _reconfigure(self, cmd: ClearReplica) -> None:
        if cmd.keyer is not None:
            self.mirror.keyer = cmd.keyer
        if cmd.model is not None:
            self.mirror.model = cmd.model

    def _filter(self, events: list[KVEvent]) -> list[KVEvent]:
        """Events this replica indexes: the full-attention group of a hybrid model only, and
        BlockStored of our block size only (keys of any other size would be wrong keys)."""
        out: list[KVEvent] = []
        bs = self.mirror.keyer.block_size
        for ev in events:
            if isinstance(ev, BlockStored):
                kind = ev.kv_cache_spec_kind
                if kind is not None and kind.lower() not in FULL_ATTENTION_KINDS:
                    self.metrics.blocks_dropped.labels(self.replica_id, "other_group").inc(
                        len(ev.block_hashes)
                    )
                    continue
                if (
                    kind is not None
                    and ev.group_idx is not None
                    and self.mirror.group_idx is None
                    and self._pinned_group is None
                ):
                    # learnt once: the first full-attention group seen is the one we index
                    self.mirror.group_idx = ev.group_idx
                if ev.block_size != bs and self.mirror._wanted_group(ev.group_idx):
                    self.metrics.messages_dropped.labels("block_size_mismatch").inc()
                    self._warn_block_size(ev.block_size, bs)
                    continue
            elif isinstance(ev, BlockRemoved) and not ev.block_hashes:
                continue
            out.append(ev)
        return out

    def _warn_block_size(self, got: int, bs: int) -> None:
        if got in self._warned_sizes:
            return
        self._warned_sizes.add(got)
        log.warning(
            "the engine publishes blocks of %d tokens but this replica is keyed in blocks of "
            "%d: every such store is dropped (messages_dropped{reason=block_size_mismatch}) "
            "and nothing of it can be routed to. Start the engine with the block size of "
            "the gateway policy's pool (vLLM --block-size; SGLang --page-size, whose default "
            "is 1) and give the agent no --block-size, or that same one",
            got,
            bs,
            extra={"replica": self.replica_id, "engine_block_size": got, "block_size": bs},
        )

    def _warn_unscoped(self, dropped: int) -> None:
        self._warned_unscoped = True
        log.warning(
            "dropped %d blocks starting chains that carry no kvgate salt, and the blocks "
            "chained after them: they are never indexed (tenant isolation, "
            "docs/security.md; the first counted in blocks_dropped{reason=unscoped}; "
            "logged once). Expected for requests that did "
            "not come through a kvgate gateway. If every request does, the engine does not "
            "report the gateway's cache_salt in its events and none of its prefixes can be "
            "routed to: vLLM without cache_salt support, or SGLang before 0.5.18 (its cache "
            "is isolated by cache_salt but its events carry no salt; docs/agent.md)%s",
            dropped,
            "" if self.mirror.counters.stored_blocks else "; no block of it was indexed so far",
            extra={"replica": self.replica_id},
        )

    def _apply_to_mirror(self, cmd: ApplyBatch) -> tuple[IndexWrite, bool]:
        events = self._filter(cmd.batch.events)
        try:
            write, cleared = self.mirror.apply(events)
        except Exception:
            # The mirror may be half-updated: it no longer describes the engine. Forget it;
            # the replica restarts from empty (cold), which under-claims but never lies.
            log.exception("mirror rejected a batch; clearing", extra={"replica": self.replica_id})
            self.metrics.messages_dropped.labels("apply_error").inc()
            self.mirror.clear()
            self.state = ReplicaState.COLD
            return IndexWrite(), True
        self._m_events.inc(len(events))
        if cmd.batch.ts > 0:  # NaN (no usable time) keeps the last known one
            self.last_ts = cmd.batch.ts
        return write, cleared

    def _sync_counters(self) -> None:
        deltas = _counter_deltas(self.mirror.counters, self._counters)
        if not deltas:
            return
        self._counters = replace(self.mirror.counters)
        rid = self.replica_id
        if "dropped_unscoped" in deltas and not self._warned_unscoped:
            self._warn_unscoped(deltas["dropped_unscoped"])
        for name, n in deltas.items():
            if name == "stored_blocks":
                self._m_stored.inc(n)
            elif name == "removed_blocks":
                self._m_removed.inc(n)
            elif name.startswith("dropped_"):
                self.metrics.blocks_dropped.labels(rid, name.removeprefix("dropped_")).inc(n)
            elif name == "unknown_removed":
                self.metrics.blocks_dropped.labels(rid, "unknown_removed").inc(n)
        self.metrics.mirror_blocks.labels(rid).set(len(self.mirror))

    # ------------------------------------------------------------- index calls

    def _now_ms(self) -> int:
        return self._clock_ms()

    def _published_state(self) -> ReplicaState:
        return self.state if self.engine_reachable else ReplicaState.UNAVAILABLE

    async def _settle(self) -> None:
        """Wait for the write in flight (at most one: writes stay in order)."""
        task = self._inflight
        if task is not None:
            self._inflight = None
            with contextlib.suppress(Exception):
                await task

    async def _flush(self, acc: IndexWrite, covered: list[ApplyBatch]) -> None:
        """Send ``acc`` without waiting for it: the mirror work of the next command group
        overlaps this write's round trip. The previous write completes first."""
        if not acc and not covered:
            return
        await self._settle()
        self._inflight = asyncio.create_task(self._write(acc, covered))

    async def _write(self, acc: IndexWrite, covered: list[ApplyBatch]) -> None:
        if self.dirty:
            if not await self._resync("index_error"):
                return
        else:
            if acc.seq is not None and acc.seq < self.written_seq:
                # a resync already wrote these batches (in its snapshot) and a later seq:
                # the values rewrite idempotently, the seq must not go back
                acc.seq = self.written_seq
            t0 = time.perf_counter()
            try:
                await self.index.apply(self.replica_id, self.epoch, acc, self._now_ms())
            except StaleEpochError:
                self.metrics.index_errors.labels(self.replica_id, "stale_epoch").inc()
                self.dirty = True
                if not await self._resync("stale_epoch"):
                    return
            except Exception as exc:
                self._index_failed("apply", exc)
                return
            else:
                self.metrics.index_write_seconds.observe(time.perf_counter() - t0)
                self._m_writes.inc()
        if acc.seq is not None and acc.seq > self.written_seq:
            self.written_seq = acc.seq
        self._observe_latency(covered)

    def _observe_latency(self, covered: list[ApplyBatch]) -> None:
        if not covered:
            return
        now = time.time()
        hist = self.metrics.event_to_index_seconds
        window = self.metrics.latency
        # NaN, 0: no time; replayed batches are as old as the backlog, not a live latency
        timed = [cmd.batch.ts for cmd in covered if cmd.batch.ts > 0 and not cmd.replayed]
        for ts in timed:
            lat = max(0.0, now - ts)
            hist.observe(lat)
            window.add(lat)
        rid = self.replica_id
        if timed:
            self.metrics.lag_seconds.labels(rid).set(max(0.0, now - timed[-1]))
        self.metrics.last_seq.labels(rid).set(self.written_seq)
        self.metrics.seq_lag.labels(rid).set(max(0, self.received_seq - self.written_seq))

    def _index_failed(self, op: str, exc: BaseException) -> None:
        self.metrics.index_errors.labels(self.replica_id, op).inc()
        if not self.dirty:
            log.warning(
                "index call failed; will resync from the mirror",
                extra={"replica": self.replica_id, "op": op, "error": repr(exc)},
            )
        self.dirty = True
        self._next_retry = time.monotonic() + self._retry_s
        self._retry_s = min(self._retry_s * 2, self.knobs.retry_max_s)

    async def _clear(self, state: ReplicaState, engine_start: float, cause: str) -> None:
        await self._settle()
        self.state = state
        self.engine_start = engine_start
        self.metrics.clears.labels(self.replica_id, cause).inc()
        log.info(
            "replica cleared",
            extra={"replica": self.replica_id, "cause": cause, "state": state.value},
        )
        if self.dirty:
            # a clear resets the index's seq: the rewrite's seq is the mirror's alone (the
            # old stream's, kept, made an agent restarted after an engine restart during
            # an index outage replay from past the new stream's batches, losing them)
            self.written_seq = -1
            await self._try_resync("index_error")  # rewrites from the (now empty) mirror
            self._seq_gauges()
            return
        try:
            self.epoch = await self.index.clear_replica(
                self.replica_id, self._published_state(), self._now_ms(), engine_start
            )
            self.written_seq = (await self.index.meta(self.replica_id)).last_seq
        except Exception as exc:
            self._index_failed("clear", exc)
            self.written_seq = -1  # as above: the resync that follows does the clear
        self._seq_gauges()

    def _seq_gauges(self) -> None:
        """last_seq and seq_lag as of now (a clear: the gauge kept the old stream's seq until
        the next write, for ever if none came)."""
        self.metrics.last_seq.labels(self.replica_id).set(self.written_seq)
        self.metrics.seq_lag.labels(self.replica_id).set(
            max(0, self.received_seq - self.written_seq)
        )

    async def _set_reachable(self, reachable: bool) -> None:
        await self._settle()
        if reachable == self.engine_reachable:
            return
        self.engine_reachable = reachable
        if self.dirty:
            await self._try_resync("index_error")
            return
        try:
            await self.index.set_state(self.replica_id, self._published_state(), self._now_ms())
        except Exception as exc:
            self._index_failed("set_state", exc)

    async def _check_index(self, cmd: CheckIndex) -> None:
        await self._settle()
        if self.dirty:
            await self._try_resync("index_error")
            return
        try:
            meta = await self.index.meta(self.replica_id)
        except Exception as exc:
            self._index_failed("meta", exc)
            return
        cause = ""
        if cmd.server_changed:
            cause = "index_restarted"
        elif meta.state is ReplicaState.UNKNOWN:
            cause = "index_lost"
        elif meta.epoch != self.epoch or meta.last_seq != self.written_seq:
            cause = "index_diverged"
        elif await self._entries_missing():
            cause = "index_entries_lost"
        elif meta.state is not self._published_state():
            try:  # only the state differs (e.g. marked unavailable while we were away)
                await self.index.set_state(self.replica_id, self._published_state(), self._now_ms())
            except Exception as exc:
                self._index_failed("set_state", exc)
            return
        if cause:
            self.dirty = True
            await self._try_resync(cause)

    async def _entries_missing(self) -> bool:
        """Whether the index holds fewer (or more) entries or mirror records of our epoch
        than the mirror: one read-only script (``HLEN`` of ``b:`` and ``m:``). A Redis with
        an ``allkeys-*`` maxmemory-policy evicts those hashes while the meta, which this
        check reads, stays recently used; the meta alone showed nothing wrong (R6). A failed
        read is the next check's to repeat (logged as an index error, no resync)."""
        index = self.index
        if not isinstance(index, CountsEntries):
            return False
        try:
            got = await index.entry_counts(self.replica_id)
        except Exception as exc:
            self.metrics.index_errors.labels(self.replica_id, "entry_counts").inc()
            log.debug(
                "entry count read failed", extra={"replica": self.replica_id, "error": repr(exc)}
            )
            return False
        blocks, records = self.mirror.sizes()
        if got.epoch != self.epoch or (got.blocks, got.mirror) == (blocks, records):
            return False  # a clear in between is the next check's (the meta's) to judge
        log.error(
            "the index lost entries of this replica (is Redis evicting keys? the index "
            "needs maxmemory-policy noeviction or volatile-*): rewriting from the mirror",
            extra={
                "replica": self.replica_id,
                "index_blocks": got.blocks,
                "mirror_blocks": blocks,
                "index_records": got.mirror,
                "mirror_records": records,
            },
        )
        return True

    async def _try_resync(self, cause: str) -> bool:
        await self._settle()
        return await self._resync(cause)

    async def _resync(self, cause: str) -> bool:
        """Rewrite everything the index holds for this replica from the mirror: a new epoch,
        then blocks + mirror records in chunks (the last chunk carries the seq). Returns
        whether it succeeded; on failure the replica stays dirty and retries later."""
        if time.monotonic() < self._next_retry:
            return False
        try:
            epoch = await self.index.clear_replica(
                self.replica_id, self._published_state(), self._now_ms(), self.engine_start
            )
            # the snapshot and the seq it stands for, taken together (no await between):
            # batches keep reaching the mirror while writes are in flight, so the seq of
            # the last completed write (an outage's, possibly long ago) would be too old,
            # and an agent restarting from it would replay batches the mirror holds
            blocks = self.mirror.blocks()
            records = self.mirror.snapshot()
            seq = max(self.mirrored_seq, self.written_seq)
            chunk = self.knobs.resync_chunk_blocks
            block_items = list(blocks.items())
            record_items: list[tuple[int, bytes | None]] = list(records.items())
            n = max(len(block_items), len(record_items))
            for off in range(0, max(n, 1), chunk):
                write = IndexWrite(
                    blocks=dict(block_items[off : off + chunk]),
                    mirror=dict(record_items[off : off + chunk]),
                )
                if off + chunk >= n:
                    write.seq = seq
                if write:
                    await self.index.apply(self.replica_id, epoch, write, self._now_ms())
        except Exception as exc:
            self._index_failed("resync", exc)
            return False
        self.epoch = epoch
        self.written_seq = seq
        self.dirty = False
        self._retry_s = 0.05
        self._next_retry = 0.0
        self.metrics.resyncs.labels(self.replica_id, cause).inc()
        log.info(
            "index rewritten from the mirror",
            extra={
                "replica": self.replica_id,
                "cause": cause,
                "blocks": len(blocks),
                "epoch": epoch,
            },
        )
        return True

    # ------------------------------------------------------------------- checks

    async def check_invariants(self) -> None:
        """Assert the module invariants against the index (tests; call after drain())."""
        assert not self.dirty, "replica is dirty"
        held = await self.index.replica_blocks(self.replica_id)
        want = self.mirror.blocks()
        assert held == want, f"index holds {len(held)} blocks, mirror {len(want)}"
        persisted = await self.index.load_mirror(self.replica_id)
        assert persisted == self.mirror.snapshot(), "persisted mirror differs"
        meta = await self.index.meta(self.replica_id)
        assert meta.epoch == self.epoch and meta.last_seq == self.written_seq, meta
