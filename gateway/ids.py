"""Ids the gateway makes up: unpredictable, and without a system call per id.

A request's ``x-request-id`` when the client sent none, and the suffix that makes the
engine's request id unique, reach the client (the header; vLLM answers the engine's id in
the completion's ``id``). Drawn from Python's ``random`` (a Mersenne Twister, whose state
is 624 consecutive outputs), they let a tenant clone the generator from its own answers
and then count every other tenant's requests between two of its own, and predict the ids
the others would get (tests/test_h29_redteam_ids.py). These come from ``os.urandom``, read
4 KiB at a time: one ``getrandom`` call per 256 request ids.

Called from the event loop only (not thread-safe: two threads could take one slice). A
forked child starts with an empty buffer, so it never hands out its parent's ids.
"""

from __future__ import annotations

import os

_CHUNK = 4096


class RandomHex:
    """Hex strings of fresh ``os.urandom`` bytes, from a buffer refilled when spent."""

    __slots__ = ("_at", "_buf")

    def __init__(self) -> None:
        self._buf = b""
        self._at = 0

    def reset(self) -> None:
        """Forget the buffer (a forked child: the parent's bytes are the parent's)."""
        self._buf = b""
        self._at = 0

    def __call__(self, n_bytes: int) -> str:
        """``n_bytes`` random bytes as ``2 * n_bytes`` lowercase hex digits."""
        at = self._at
        end = at + n_bytes
        if end > len(self._buf):
            self._buf = os.urandom(max(_CHUNK, n_bytes))
            at, end = 0, n_bytes
        self._at = end
        return self._buf[at:end].hex()


random_hex = RandomHex()
os.register_at_fork(after_in_child=random_hex.reset)
