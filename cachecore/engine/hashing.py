"""Engine-side block hashes, computed the way vLLM's prefix cache computes them.

These are the ENGINE's hashes (what its events carry), not kvgate's block keys
(:mod:`cachecore.keys`). They depend on the hash algorithm and on a per-process seed, exactly
like vLLM's (``--prefix-caching-hash-algo``; ``NONE_HASH`` is random per process unless
``PYTHONHASHSEED`` is set), so nothing outside the engine can or should reproduce them::

    h_0 = H(ROOT(seed), tokens of block 0, extra_keys of block 0)
    h_i = H(h_{i-1},    tokens of block i, extra_keys of block i)

``extra_keys`` of a block: the LoRA name in every block, then the request's ``cache_salt`` in
block 0 only (vLLM's ``generate_block_hash_extra_keys``); ``None`` when empty.

Digests are bytes (32 for sha256, 16 for xxhash, as vLLM's ``BlockHash``). On the wire vLLM
sends them as ints (the last 8 bytes, big-endian; ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the
default) or as the raw bytes: :class:`WireHashFormat`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

import msgpack
import xxhash

from cachecore.keys import tokens_to_bytes

EngineHash = bytes
"""A block hash as the engine holds it (a digest)."""

ExtraKeys = tuple[Any, ...] | None


_MEMO_BLOCKS = 16  # blocks per memoised span of EngineHasher.chain
_MEMO_MAX = 256  # memoised spans per engine (256 x ~1.6 KiB at 16-token blocks)


class HashAlgo(StrEnum):
    SHA256 = "sha256"  # vLLM's default
    XXHASH = "xxhash"  # vLLM's fast option (xxh3-128)


class WireHashFormat(StrEnum):
    INT = "int"  # 64-bit unsigned int: last 8 bytes of the digest, big-endian (vLLM default)
    BYTES = "bytes"  # the raw digest


# uint32 little-endian, as the block keys take them (one implementation: its fast paths
# serve a decode step's block in both the engine's hash and the agent's key)
_token_bytes = tokens_to_bytes


def _extra_bytes(extra: ExtraKeys) -> bytes:
    # Length-tagged so (tokens, extra) pairs cannot alias each other.
    if not extra:
        return b"\x00"
    body: bytes = msgpack.packb(list(extra), use_bin_type=True)
    return b"\x01" + len(body).to_bytes(4, "little") + body


class EngineHasher:
    """Chained block hashes for one engine process.

    ``seed=None`` draws a random root per instance (vLLM's default behaviour: two engine
    processes never agree on hashes); a fixed seed makes hashes reproducible across restarts.
    """

    def __init__(self, algo: HashAlgo = HashAlgo.SHA256, seed: int | None = None) -> None:
        self.algo = HashAlgo(algo)
        self.seed = seed
        seed_material = os.urandom(32) if seed is None else f"kvgate-engine:{seed}".encode()
        self._digest = (
            (lambda data: hashlib.sha256(data).digest())
            if self.algo is HashAlgo.SHA256
            else xxhash.xxh3_128_digest
        )
        self.root: EngineHash = self._digest(b"root\x00" + seed_material)
        # (parent, a span's token bytes, block 0's extra bytes or None, other blocks' extra
        # bytes) -> the span's hashes: a prefix that many requests share (a system prompt, a
        # document) is hashed once per engine instead of once per request. Cleared when
        # full, so it holds at most _MEMO_MAX spans (of _MEMO_BLOCKS blocks each).
        self._memo: dict[tuple[EngineHash, bytes, bytes | None, bytes], list[EngineHash]] = {}

    def block_hash(
        self, parent: EngineHash | None, tokens: Sequence[int], extra: ExtraKeys
    ) -> EngineHash:
        head = self.root if parent is None else parent
        return self._digest(head + _token_bytes(tokens) + _extra_bytes(extra))

    def next_hash(self, parent: EngineHash, tokens: Sequence[int], extra: bytes) -> EngineHash:
        """The hash of one full block after ``parent`` (the root for a request's first);
        ``extra`` is its extra keys' bytes (``ExtraKeysFn.first_bytes`` or ``rest_bytes``):
        :meth:`chain` of one block."""
        return self._digest(parent + _token_bytes(tokens) + extra)

    def chain(
        self,
        parent: EngineHash | None,
        tokens: Sequence[int],
        block_size: int,
        first_block_index: int,
        extra_of_block: ExtraKeysFn,
    ) -> list[EngineHash]:
        """Hashes of the consecutive full blocks of ``tokens`` (a multiple of block_size)
        whose first block has index ``first_block_index`` in its request."""
        if len(tokens) == block_size:  # one block (a decode step filled it): no span to memo
            xk = extra_of_block
            extra = xk.first_bytes if first_block_index == 0 else xk.rest_bytes
            return [self.next_hash(self.root if parent is None else parent, tokens, extra)]
        return self.chain_bytes(
            parent, _token_bytes(tokens), block_size, first_block_index, extra_of_block
        )

    def chain_bytes(
        self,
        parent: EngineHash | None,
        data: bytes,
        block_size: int,
        first_block_index: int,
        extra_of_block: ExtraKeysFn,
    ) -> list[EngineHash]:
        """:meth:`chain` of tokens already in their byte form (uint32 little-endian): a
        prompt is converted once at admission, not again for its hashes."""
        h = self.root if parent is None else parent
        out: list[EngineHash] = []
        step = block_size * 4
        rest = extra_of_block.rest_bytes  # the same for every block but a request's first
        span = step * _MEMO_BLOCKS
        memo = self._memo
        off = 0
        while off + span <= len(data):  # whole spans: memoised (identical hashes)
            first = extra_of_block.first_bytes if first_block_index + off // step == 0 else None
            chunk = data[off : off + span]
            key = (h, chunk, first, rest)
            hashes = memo.get(key)
            if hashes is None:
                hashes = self._run(h, chunk, step, first, rest)
                if len(memo) >= _MEMO_MAX:
                    memo.clear()
                memo[key] = hashes
            out += hashes
            h = hashes[-1]
            off += span
        if off + step <= len(data):
            first = extra_of_block.first_bytes if first_block_index + off // step == 0 else None
            out += self._run(h, data[off:], step, first, rest)
        return out

    def _run(
        self, h: EngineHash, data: bytes, step: int, first: bytes | None, rest: bytes
    ) -> list[EngineHash]:
        """The chained hashes of the whole blocks in ``data`` after parent ``h``; ``first``
        (when not None) is the first block's extra bytes, ``rest`` the others'."""
        digest = self._digest
        out: list[EngineHash] = []
        for off in range(0, len(data) - step + 1, step):
            h = digest(h + data[off : off + step] + (rest if first is None else first))
            first = None
            out.append(h)
        return out


class ExtraKeysFn:
    """The extra keys of each block of one request (LoRA name everywhere, salt in block 0)."""

    __slots__ = ("first", "first_bytes", "rest", "rest_bytes")

    def __init__(self, lora_name: str | None, cache_salt: str | None) -> None:
        base: tuple[Any, ...] = (lora_name,) if lora_name else ()
        first = base + ((cache_salt,) if cache_salt else ())
        self.first: ExtraKeys = first or None
        self.rest: ExtraKeys = base or None
        # their encodings, as the hash consumes them (once per request, not per block)
        self.first_bytes = _extra_bytes(self.first)
        self.rest_bytes = _extra_bytes(self.rest)

    def __call__(self, block_index: int) -> ExtraKeys:
        return self.first if block_index == 0 else self.rest


def int_hash(h: EngineHash) -> int:
    """The 64-bit int vLLM derives from a digest (and decoders derive from bytes hashes)."""
    return int.from_bytes(h[-8:], "big")


def to_wire(h: EngineHash, fmt: WireHashFormat) -> int | bytes:
    """An engine hash as vLLM puts it into an event."""
    if fmt is WireHashFormat.BYTES:
        return h
    return int_hash(h)
