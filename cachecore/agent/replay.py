"""Replay client: asks the engine's replay ROUTER for the batches the subscriber missed.

A fresh DEALER per request, closed afterwards with linger 0: a late answer to a request that
timed out can then never be mistaken for the answer to the next one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from cachecore.agent.frames import Frame, parse_replay
from cachecore.kvevents import END_SEQ, MalformedEventError, seq_to_bytes


@dataclass
class ReplayResult:
    """Filled in while :meth:`ReplayClient.fetch` iterates: ``completed`` once the end
    marker arrived, else why the replay stopped."""

    completed: bool = False
    stopped: str = ""
    frames: int = 0


class ReplayClient:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        first_reply_timeout_s: float = 2.0,
        idle_timeout_s: float = 2.0,
        total_timeout_s: float = 60.0,
        max_batches: int = 1_000_000,
        max_payload_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.first_reply_timeout_s = first_reply_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.total_timeout_s = total_timeout_s
        self.max_batches = max_batches
        self.max_payload_bytes = max_payload_bytes

    async def fetch(
        self, start_seq: int, result: ReplayResult
    ) -> AsyncGenerator[Frame | MalformedEventError, None]:
        """Yield every reply (a :class:`Frame`, or the error a malformed reply raised) until
        the end marker, a timeout, or the batch cap; ``result`` says which."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # as the event stream's: else IPv6 reaches nothing
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_payload_bytes + 1024)
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart([b"", seq_to_bytes(start_seq)])
            deadline = time.monotonic() + self.total_timeout_s
            timeout_s = self.first_reply_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    result.stopped = "total_timeout"
                    return
                ready = await sock.poll(int(min(timeout_s, remaining) * 1000))
                if not ready:
                    result.stopped = "timeout"
                    return
                timeout_s = self.idle_timeout_s
                frames = await sock.recv_multipart(copy=True)
                try:
                    frame = parse_replay(frames, self.max_payload_bytes)
                except MalformedEventError as exc:
                    yield exc
                    continue
                if frame.seq == END_SEQ:
                    result.completed = True
                    return
                result.frames += 1
                yield frame
                if result.frames >= self.max_batches:
                    result.stopped = "max_batches"
                    return
        finally:
            sock.close(linger=0)
