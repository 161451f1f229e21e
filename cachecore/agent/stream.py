"""One engine's KV-event stream: receive, validate, order, recover.

The stream owns the sequence tracking of one engine publisher (seq starts at 0 per engine
process and grows by one per batch). Every accepted batch goes, in seq order, to the
:class:`~cachecore.agent.sync.ReplicaSync` of its data-parallel rank. Decisions:

* ``seq == last + 1``: apply.
* ``seq > last + 1`` (a gap): replay from the engine's ROUTER, starting AT ``last`` so the
  first reply doubles as an identity check (same payload bytes as the batch we applied:
  same engine process; different: the engine restarted and passed our seq). A replay that
  does not start where we asked, has a hole, or does not answer is an unrecoverable gap: the
  replica is cleared and marked COLD, and the stream continues from the batches it has.
* ``seq <= last``: either a stale/replayed message or a restarted engine. The replay ROUTER
  decides: if the engine still holds our last batch, the message is stale and ignored (so a
  replayed old BlockStored can never resurrect an evicted block); if it does not, the engine
  restarted: clear, then catch up from seq 0. Without a replay endpoint a lower seq is taken
  as a restart (facts §1).
* A changed ``process_start_time_seconds`` (periodic scrape) is a restart too.
* A live batch the engine's replay does not hold (the replay completed, and ended below its
  seq) was published by a previous engine process: the engine appends each batch to its
  replay buffer as it publishes it, so a batch we already hold is in the buffer, or newer
  ones are. Such a batch (still queued in the SUB socket when the engine restarted) is
  dropped as stale; applied, it put the dead process's blocks in the new one's index.

Malformed messages are dropped before any of this, so they can never move the tracking.
The live SUB socket is connected before any replay is requested and is not read while a
replay runs: live batches wait in the socket's queue (``rcvhwm``) and are then applied in
order, the ones the replay already covered being skipped as stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cachecore.agent.frames import Frame, RateLimitedLog, parse_live
from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.replay import ReplayClient, ReplayResult
from cachecore.agent.sync import ApplyBatch, ClearReplica, ReplicaSync
from cachecore.index.base import ReplicaState
from cachecore.kvevents import EventBatch, MalformedEventError, decode_batch

log = logging.getLogger(__name__)

MAX_DP_RANKS = 1024
"""Highest data-parallel rank (exclusive) a batch may carry; anything else is malformed."""

MISWIRED_AFTER = 3
"""Subscriptions dropped before any handshake, or replays unanswered, in a row that make the
stream's wiring a problem (:attr:`EventStream.wiring_problem`): one is a restarting engine,
three in a row is an endpoint that is not the engine's socket of that kind."""

_MONITORED = (
    zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


def payload_digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _close_pair(sock: zmq.asyncio.Socket | None, monitor: zmq.asyncio.Socket | None) -> None:
    """Close a SUB socket and its monitor, the monitor stopped first."""
    if sock is not None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        sock.close(linger=0)
    if monitor is not None:
        monitor.close(linger=0)


class EventStream:
    """Sequence tracking and recovery for one engine publisher.

    ``sync_for(rank)`` returns (creating on first use) the sync of a DP rank;
    ``clear_command(cause, state)`` builds the ClearReplica every rank receives on a clear
    (the agent fills in the engine's current start time and config);
    ``start_time_changed()`` scrapes the engine and says whether its process changed.
    """

    def __init__(
        self,
        *,
        name: str,
        ctx: zmq.asyncio.Context,
        events_endpoint: str,
        replay: ReplayClient | None,
        topic: str,
        metrics: AgentMetrics,
        sync_for: Callable[[int], Awaitable[ReplicaSync]],
        all_syncs: Callable[[], list[ReplicaSync]],
        clear_command: Callable[[str, ReplicaState], Awaitable[ClearReplica]],
        start_time_changed: Callable[[], Awaitable[bool]],
        default_rank: int = 0,
        max_payload_bytes: int = 16 * 1024 * 1024,
        max_tokens_per_event: int = 1024 * 1024,
        rcvhwm: int = 100_000,
        stale_probe_cooldown_s: float = 1.0,
    ) -> None:
        self.name = name
        self.ctx = ctx
        self.events_endpoint = events_endpoint
        self.replay = replay
        self.topic = topic.encode()
        self.metrics = metrics
        self._sync_for = sync_for
        self._all_syncs = all_syncs
        self._clear_command = clear_command
        self._start_time_changed = start_time_changed
        self.default_rank = default_rank
        self.max_payload_bytes = max_payload_bytes
        self.max_tokens_per_event = max_tokens_per_event
        self.rcvhwm = rcvhwm
        self.stale_probe_cooldown_s = stale_probe_cooldown_s
        self.last_seq = -1
        self.last_digest: int | None = None
        # monotonic time the last live batch that decoded arrived (None: none yet): an
        # engine that computes while none arrives publishes nothing (cachecore.agent.silence)
        self.last_batch_at: float | None = None
        # between a received message (or the catch-up) and the next wait for one: a replay,
        # the lock or a full queue holds the stream, and what waits in the SUB socket is
        # unknown (reading ZMQ_EVENTS from another task would eat the edge the poller needs)
        self._handling = False
        self.lock = asyncio.Lock()
        self.caught_up = asyncio.Event()
        self._stale_until = 0.0
        # the last replay: whether it completed, and the highest seq it returned (-1: none)
        self._replay_completed = False
        self._replay_high = -1
        self._drop_log = RateLimitedLog()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._poller = zmq.asyncio.Poller()
        # wiring (--events and --replay swapped, or not the engine's sockets): the SUB
        # connection accepted then dropped at the ZMTP handshake, and replays unanswered,
        # looked like an idle engine behind a green /health, logged at INFO only
        self._handshaken = False  # the SUB socket's handshake succeeded since it connected
        self._refused = False  # the last dropped one's peer refused the handshake (socket type)
        self._drops_in_row = 0  # SUB connections dropped before a handshake, in a row
        self._unanswered_in_row = 0  # replays that got no reply at all, in a row
        self._warned_problem: str | None = None

    # -------------------------------------------------------------------- run

    def subscribe(self) -> None:
        """Connect the SUB socket (before any replay, so nothing falls in between). One that
        fails (a refused endpoint, a ZMQ error) closes what it made: the start-up that
        called it is retried, and each attempt would leave its sockets open otherwise."""
        if self._sock is not None:
            return
        sock = self.ctx.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # ZMQ's default is IPv4 only: a connect to tcp://[::1]:PORT (an IPv6 engine)
            # reached nothing, without a word; IPv4 addresses and names still connect
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
            # ZMQ drops the peer on a larger frame before buffering it, so a broken
            # publisher cannot make the agent allocate gigabytes. libzmq does not reconnect
            # after such a drop: the monitor sees the disconnect and we resubscribe (then
            # catch up).
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_payload_bytes + 1024)
            sock.setsockopt(zmq.SUBSCRIBE, self.topic)
            monitor = sock.get_monitor_socket(_MONITORED)
            sock.connect(self.events_endpoint)
        except BaseException:
            _close_pair(sock, monitor)
            raise
        self._sock = sock
        self._monitor = monitor
        self._handshaken = False
        self._poller = zmq.asyncio.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)

    def last_live_batch(self, now: float) -> float | None:
        """When the engine last published a batch we received: ``now`` while the stream is
        not waiting for a message (it handles one, or catches up: a replay, the lock or a
        full queue may hold it while batches wait in the SUB socket), else the arrival of
        the last live batch that decoded (None: none yet)."""
        return now if self._handling else self.last_batch_at

    def close(self) -> None:
        """Close the SUB socket and its monitor (idempotent; a later :meth:`subscribe`
        opens new ones)."""
        _close_pair(self._sock, self._monitor)
        self._sock = None
        self._monitor = None

    async def _recv(self) -> list[bytes] | None:
        """The next live message, or None after the connection was lost and replaced."""
        assert self._sock is not None
        try:  # the hot path: messages are waiting, no poll needed
            return await self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            pass
        while True:  # a handshake event alone is no message: poll on
            ready = dict(await self._poller.poll())
            if self._monitor is not None and self._monitor in ready:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self.metrics.resubscribes.inc()
                    log.info(
                        "event stream disconnected; resubscribing", extra={"replica": self.name}
                    )
                    self._dropped()
                    self.close()
                    await asyncio.sleep(0.05)
                    self.subscribe()
                    return None
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshaken, self._refused, self._drops_in_row = True, False, 0
                    self._check_wiring()
                elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                    self._refused = True
            if self._sock in ready:
                return await self._sock.recv_multipart(copy=True)

    # ----------------------------------------------------------------- wiring

    def _dropped(self) -> None:
        if not self._handshaken:
            self._drops_in_row += 1
            self._check_wiring()

    def _replayed(self, result: ReplayResult) -> None:
        answered = result.completed or result.frames > 0
        self._unanswered_in_row = 0 if answered else self._unanswered_in_row + 1
        self._check_wiring()

    @property
    def wiring_problem(self) -> str | None:
        """Why the endpoints look miswired (``MISWIRED_AFTER`` failures in a row), or None.
        Both failing is the signature of --events and --replay swapped: a SUB socket is
        refused by the engine's ROUTER, a replay DEALER by its PUB, which never answers."""
        dropping = self._drops_in_row >= MISWIRED_AFTER
        silent = self.replay is not None and self._unanswered_in_row >= MISWIRED_AFTER
        if dropping and silent:
            return (
                f"the events endpoint drops every subscription and the replay endpoint never "
                f"answers: are --events and --replay the engine's PUB ('endpoint') and ROUTER "
                f"('replay_endpoint'), not swapped? (--events {self.events_endpoint}, "
                f"--replay {self.replay.endpoint if self.replay else None})"
            )
        if dropping:
            why = "refuses the handshake (no PUB socket)" if self._refused else "drops it"
            return (
                f"the events endpoint {self.events_endpoint} takes every subscription and "
                f"{why}: is --events the engine's PUB endpoint ('endpoint')?"
            )
        if silent:
            assert self.replay is not None
            return (
                f"the replay endpoint {self.replay.endpoint} answered none of the last "
                f"{self._unanswered_in_row} replays: is --replay the engine's replay ROUTER "
                f"('replay_endpoint'), and does the engine enable it?"
            )
        return None

    def _check_wiring(self) -> None:
        """A WARNING when a wiring problem appears (or changes), INFO when it is gone."""
        problem = self.wiring_problem
        if problem == self._warned_problem:
            return
        if problem is not None:
            log.warning(
                "event stream endpoints look miswired",
                extra={"replica": self.name, "problem": problem},
            )
        else:
            log.info("event stream wiring recovered", extra={"replica": self.name})
        self._warned_problem = problem

    async def run(self, restart_first: bool) -> None:
        """Catch up (replay from last + 1, or a restart from 0), then follow the live
        stream until cancelled."""
        self.subscribe()
        self._handling = True
        try:
            async with self.lock:
                if restart_first:
                    await self.restart("start_time")
                else:
                    await self._replay_and_apply(self.last_seq + 1, verify=False)
            self.caught_up.set()
            while True:
                self._handling = False
                frames = await self._recv()
                self._handling = True
                if frames is None:
                    async with self.lock:
                        await self._after_reconnect()
                    continue
                self.metrics.batches_received.labels("live").inc()
                try:
                    frame = parse_live(frames, self.topic, self.max_payload_bytes)
                except MalformedEventError as exc:
                    self._drop(exc, "live")
                    continue
                async with self.lock:
                    await self._on_live(frame)
        finally:
            self._handling = False
            self.close()

    async def _after_reconnect(self) -> None:
        """Whatever was published while we were not connected: replay it, verifying that
        the engine is still the process we followed (a disconnect is often a restart)."""
        if self._sock is None or self.replay is None:
            return
        if self.last_seq < 0:
            await self._replay_and_apply(0, verify=False)
            return
        outcome = await self._replay_and_apply(self.last_seq, verify=True)
        if outcome == "restarted":
            await self.restart("replay_identity")

    # --------------------------------------------------------------- decoding

    def _drop(self, exc: MalformedEventError, source: str) -> None:
        self.metrics.messages_dropped.labels(exc.reason).inc()
        self._drop_log.warn(
            exc.reason,
            "dropped a malformed event message",
            replica=self.name,
            source=source,
            detail=str(exc)[:200],
        )

    def _decode(self, frame: Frame, source: str) -> EventBatch | None:
        try:
            batch = decode_batch(frame.payload, self.max_payload_bytes, self.max_tokens_per_event)
        except MalformedEventError as exc:
            self._drop(exc, source)
            return None
        except Exception as exc:  # the codec's contract is MalformedEventError; be paranoid
            self._drop(MalformedEventError("decode_error", type(exc).__name__), source)
            return None
        rank = batch.data_parallel_rank
        if rank is not None and not 0 <= rank < MAX_DP_RANKS:
            self._drop(MalformedEventError("bad_rank", str(rank)), source)
            return None
        if batch.skipped:
            self.metrics.events_skipped.inc(len(batch.skipped))
            self._drop_log.warn(
                "skipped_events",
                "skipped events: unknown types or stores with nothing to key",
                replica=self.name,
                source=source,
                types=sorted(set(batch.skipped))[:8],
            )
        return batch

    # ------------------------------------------------------------ live path

    async def _on_live(self, frame: Frame) -> None:
        batch = self._decode(frame, "live")
        if batch is None:
            return
        self.last_batch_at = time.monotonic()
        digest = payload_digest(frame.payload)
        seq = frame.seq
        if seq == self.last_seq + 1:
            await self._route(seq, batch, digest)
        elif seq > self.last_seq + 1:
            await self._on_gap(seq, batch, digest)
        elif seq == self.last_seq and digest == self.last_digest:
            self.metrics.stale_batches.inc()  # an exact duplicate
        else:
            await self._on_backwards(seq, batch, digest)

    async def _on_gap(self, seq: int, batch: EventBatch, digest: int) -> None:
        self.metrics.gaps.inc()
        log.info(
            "sequence gap", extra={"replica": self.name, "last_seq": self.last_seq, "seq": seq}
        )
        if self.replay is None:
            if await self._start_time_changed():
                await self.restart("start_time")
        else:
            verify = self.last_seq >= 0
            start = self.last_seq if verify else 0
            outcome = await self._replay_and_apply(start, verify=verify)
            if outcome == "restarted":
                await self.restart("replay_identity")
            if self._not_held(seq):
                return
        await self._accept_ordered(seq, batch, digest)

    async def _on_backwards(self, seq: int, batch: EventBatch, digest: int) -> None:
        if time.monotonic() < self._stale_until:
            self.metrics.stale_batches.inc()
            return
        if self.replay is None:
            # nothing to ask: a lower seq is an engine restart
            await self.restart("lower_seq")
            await self._accept_ordered(seq, batch, digest)
            return
        outcome = await self._replay_and_apply(self.last_seq, verify=True)
        if outcome in ("same", "ok"):
            self.metrics.stale_batches.inc()
            self._stale_until = time.monotonic() + self.stale_probe_cooldown_s
            self._drop_log.warn(
                "stale",
                "ignored a batch older than the last applied one",
                replica=self.name,
                seq=seq,
                last_seq=self.last_seq,
            )
            return
        await self.restart("lower_seq")
        if self._not_held(seq):
            return
        await self._accept_ordered(seq, batch, digest)

    def _not_held(self, seq: int) -> bool:
        """Whether live batch ``seq`` is not the engine's: its replay, just completed,
        ended below it (see the module docstring). Counted as stale."""
        if not (self._replay_completed and self._replay_high < seq):
            return False
        self.metrics.stale_batches.inc()
        self._drop_log.warn(
            "not_held",
            "ignored a batch the engine's replay does not hold: from a previous engine process",
            replica=self.name,
            seq=seq,
            replay_high=self._replay_high,
        )
        return True

    # -------------------------------------------------------------- ordering

    async def _route(
        self, seq: int, batch: EventBatch, digest: int, replayed: bool = False
    ) -> None:
        rank = batch.data_parallel_rank
        sync = await self._sync_for(self.default_rank if rank is None else rank)
        await sync.put(ApplyBatch(seq, batch, time.time(), replayed))
        self.last_seq = seq
        self.last_digest = digest

    async def _accept_ordered(
        self, seq: int, batch: EventBatch, digest: int, replayed: bool = False
    ) -> None:
        """Apply without further replay: a hole before ``seq`` is unrecoverable."""
        if seq <= self.last_seq:
            self.metrics.stale_batches.inc()
            return
        if seq != self.last_seq + 1:
            await self.clear_all("gap_unrecoverable", ReplicaState.COLD)
        await self._route(seq, batch, digest, replayed)

    async def clear_all(self, cause: str, state: ReplicaState) -> None:
        cmd = await self._clear_command(cause, state)
        for sync in self._all_syncs():
            await sync.put(cmd)

    # ----------------------------------------------------------------- replay

    async def _replay_and_apply(self, start: int, verify: bool) -> str:
        """Replay from ``start`` and apply what comes in order. With ``verify`` the first
        batch must be our last applied one (same bytes: same engine process).

        Returns ``"restarted"`` (verification failed), ``"same"`` (verified and the engine
        has nothing newer), ``"ok"`` (complete), or why it stopped (``"no_replay"``,
        ``"timeout"``, ...; batches received until then were applied).
        """
        self._replay_completed = False
        self._replay_high = -1
        if self.replay is None:
            return "no_replay"
        result = ReplayResult()
        verified = not verify
        applied = 0
        t0 = time.monotonic()
        gen = self.replay.fetch(start, result)
        try:
            async for item in gen:
                self.metrics.batches_received.labels("replay").inc()
                if isinstance(item, MalformedEventError):
                    self._drop(item, "replay")
                    continue
                self._replay_high = max(self._replay_high, item.seq)
                batch = self._decode(item, "replay")
                if batch is None:
                    continue
                self.metrics.replayed_batches.inc()
                digest = payload_digest(item.payload)
                if not verified:
                    verified = True
                    if item.seq == self.last_seq and self.last_digest is not None:
                        if digest != self.last_digest:
                            self.metrics.replays.labels("restarted").inc()
                            return "restarted"
                        continue
                    if await self._start_time_changed():
                        self.metrics.replays.labels("restarted").inc()
                        return "restarted"
                    if item.seq == self.last_seq:
                        continue  # no digest to compare (agent restarted); start time agrees
                await self._accept_ordered(item.seq, batch, digest, replayed=True)
                applied += 1
        finally:
            with contextlib.suppress(Exception):
                await gen.aclose()
        self._replay_completed = result.completed
        self._replayed(result)
        outcome = "ok" if result.completed else (result.stopped or "stopped")
        if verify and not verified and result.completed:
            # the engine holds nothing at or after our last batch: its seq went back
            outcome = "restarted"
        elif verify and verified and applied == 0 and result.completed:
            outcome = "same"
        self.metrics.replays.labels(outcome).inc()
        log.info(
            "replay done",
            extra={
                "replica": self.name,
                "start": start,
                "outcome": outcome,
                "applied": applied,
                "last_seq": self.last_seq,
                "seconds": round(time.monotonic() - t0, 4),
            },
        )
        return outcome

    async def restart(self, signal: str) -> None:
        """The engine process changed: forget everything, catch up from seq 0. Call with
        :attr:`lock` held."""
        self.metrics.engine_restarts.labels(signal).inc()
        log.warning(
            "engine restart detected",
            extra={"replica": self.name, "signal": signal, "last_seq": self.last_seq},
        )
        await self.clear_all("engine_restart", ReplicaState.LIVE)
        self.last_seq = -1
        self.last_digest = None
        self._stale_until = 0.0
        await self._replay_and_apply(0, verify=False)
