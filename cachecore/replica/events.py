"""KV-event publishing of one replica, in vLLM's ZMQ wire format.

* PUB socket: one multipart message per engine step that produced events,
  ``[topic, seq (8 bytes big-endian), msgpack payload]``; ``seq`` starts at 0 per engine
  process and grows by one per batch.
* ROUTER replay socket: a DEALER sends ``[b"", start_seq]`` and gets, for every buffered batch
  with seq >= start_seq, ``[b"", topic, seq, payload]`` (``[b"", seq, payload]`` in legacy
  mode), then the end marker (seq -1, empty payload). The buffer holds the last
  ``buffer_steps`` batches.

Payloads are encoded by :func:`cachecore.kvevents.encode_batch`, the codec the agent decodes
with. Everything runs on pyzmq's asyncio sockets: a PUB send never blocks (ZMQ drops at the
high-water mark) and long replays yield to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import zmq
import zmq.asyncio

from cachecore.kvevents import (
    END_SEQ_BYTES,
    Encoding,
    EventBatch,
    KVEvent,
    MalformedEventError,
    encode_batch,
    seq_from_bytes,
    seq_to_bytes,
)
from cachecore.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

DEFAULT_HWM = 100_000  # vLLM's default
_REPLAY_YIELD_EVERY = 256


class KVEventPublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub_endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        encoding: Encoding = Encoding.MAP,
        buffer_steps: int = 10000,
        legacy_replay_reply: bool = False,
        data_parallel_rank: int | None = None,
    ) -> None:
        self._ctx = ctx
        self.pub_endpoint = pub_endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.encoding = encoding
        self.legacy_replay_reply = legacy_replay_reply
        self.data_parallel_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._drop_remaining = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.batches_published = 0
        self.batches_dropped = 0
        self.replay_requests = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        self._pub = self._bound(zmq.PUB, self.pub_endpoint)
        if self.replay_endpoint:
            router = self._router = self._bound(zmq.ROUTER, self.replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replay(router))

    def _bound(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        try:
            sock.setsockopt(zmq.SNDHWM, DEFAULT_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
        except BaseException:
            # a socket left open (its port in use) made the context's term() wait for it
            # for ever: `kvgate replica` printed the error and hung
            sock.close(linger=0)
            raise
        return sock

    async def close(self) -> None:
        await cancel_and_wait(self._replay_task)
        self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def reset(self) -> None:
        """A new engine process: seq back to 0, nothing to replay."""
        self._seq = 0
        self._buffer.clear()
        self._drop_remaining = 0

    def drop_next(self, n: int) -> None:
        """Keep the next ``n`` batches in the replay buffer but do not publish them (forces a
        gap on every subscriber)."""
        self._drop_remaining = max(0, n)

    async def publish(self, events: list[KVEvent], ts: float) -> int:
        """Encode and publish one batch; returns its seq."""
        payload = encode_batch(
            EventBatch(ts=ts, events=events, data_parallel_rank=self.data_parallel_rank),
            self.encoding,
        )
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop_remaining > 0:
            self._drop_remaining -= 1
            self.batches_dropped += 1
            return seq
        if self._pub is not None:
            await self._pub.send_multipart([self.topic, seq_to_bytes(seq), payload])
            self.batches_published += 1
        return seq

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            try:
                await self._answer_replay(router, frames)
            except (MalformedEventError, IndexError) as exc:
                logger.warning("bad replay request", extra={"error": str(exc)})
            except zmq.ZMQError as exc:
                logger.warning("replay send failed", extra={"error": str(exc)})

    async def _answer_replay(self, router: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        if rest and rest[0] == b"":
            rest = rest[1:]
        start = seq_from_bytes(rest[0])
        self.replay_requests += 1
        # snapshot: publishing may go on while we yield
        batches = [(s, p) for s, p in list(self._buffer) if s >= start]
        for i, (seq, payload) in enumerate(batches):
            if self.legacy_replay_reply:
                msg = [identity, b"", seq_to_bytes(seq), payload]
            else:
                msg = [identity, b"", self.topic, seq_to_bytes(seq), payload]
            await router.send_multipart(msg)
            if i % _REPLAY_YIELD_EVERY == _REPLAY_YIELD_EVERY - 1:
                await asyncio.sleep(0)
        if self.legacy_replay_reply:
            end = [identity, b"", END_SEQ_BYTES, b""]
        else:  # vLLM 0.33's end marker carries an empty topic frame
            end = [identity, b"", b"", END_SEQ_BYTES, b""]
        await router.send_multipart(end)
