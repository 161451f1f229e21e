"""Frame-level validation of ZMQ messages, before the payload reaches the codec.

Live (SUB) messages are ``[topic, seq (8 bytes), payload]``; replay (DEALER) replies are
``[b"", topic, seq, payload]`` (recent vLLM) or ``[b"", seq, payload]`` (older), ending with a
seq of -1 and an empty payload. Anything else raises
:class:`~cachecore.kvevents.MalformedEventError` with a reason the agent counts by; nothing in
this module touches agent state, so a malformed message can never move the sequence tracking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cachecore.kvevents import END_SEQ, MalformedEventError, seq_from_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Frame:
    """One validated message: its seq and the still-encoded payload."""

    seq: int
    payload: bytes


def parse_live(frames: Sequence[bytes], topic: bytes, max_payload_bytes: int) -> Frame:
    if len(frames) != 3:
        raise MalformedEventError("bad_frames", f"{len(frames)} frames")
    got_topic, raw_seq, payload = frames
    if topic and got_topic != topic and not bytes(got_topic).startswith(topic + b"\0"):
        # SUB filters by prefix only: "kv" also receives "kv-events". An empty topic (vLLM's
        # default) subscribes to everything the engine publishes, whatever its topic. After
        # a NUL the frame carries metadata, not topic: SGLang with a snapshot endpoint
        # appends "\0sgl-kv-epoch=N" (docs/agent.md)
        raise MalformedEventError("bad_topic", repr(bytes(got_topic[:32])))
    seq = seq_from_bytes(raw_seq)
    if seq < 0:
        raise MalformedEventError("bad_seq", f"negative seq {seq}")
    if len(payload) > max_payload_bytes:
        raise MalformedEventError("oversized", f"{len(payload)} bytes")
    return Frame(seq, bytes(payload))


def parse_replay(frames: Sequence[bytes], max_payload_bytes: int) -> Frame:
    """A replay reply; ``Frame.seq == END_SEQ`` is the end marker."""
    if len(frames) not in (3, 4):
        raise MalformedEventError("bad_frames", f"{len(frames)} replay frames")
    if frames[0] != b"":
        raise MalformedEventError("bad_frames", "replay reply without empty delimiter")
    raw_seq, payload = frames[-2], frames[-1]
    seq = seq_from_bytes(raw_seq)
    if seq == END_SEQ:
        return Frame(seq, b"")
    if seq < 0:
        raise MalformedEventError("bad_seq", f"negative seq {seq}")
    if len(payload) > max_payload_bytes:
        raise MalformedEventError("oversized", f"{len(payload)} bytes")
    return Frame(seq, bytes(payload))


@dataclass
class RateLimitedLog:
    """Logs at most one line per ``interval_s`` per reason, with the number suppressed, so a
    flood of bad messages cannot flood the logs (or cost the agent its CPU in logging)."""

    interval_s: float = 5.0
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def warn(self, reason: str, message: str, **extra: object) -> None:
        now = time.monotonic()
        last = self._last.get(reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        suppressed = self._suppressed.pop(reason, 0)
        log.warning(message, extra={"reason": reason, "suppressed": suppressed, **extra})
