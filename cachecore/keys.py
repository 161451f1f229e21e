"""Tenant-scoped prefix block keys: the one implementation the gateway, the agent, the
simulator and the benchmarks share.

Keys are chained over full blocks of token ids::

    key_0 = H(salt, model, lora, tokens of block 0)
    key_i = H(key_{i-1}, tokens of block i)

``salt`` is the ``cache_salt`` the gateway sends to the engine, ``"kvg1:" + HMAC(secret,
scope)``. vLLM puts that salt into block 0's ``extra_keys`` of its BlockStored event, so an
agent that sees only the event (token ids, salt, LoRA name) and knows the replica's model
recomputes exactly the gateway's keys, without any secret. Scopes never share a salt, hence
never a key_0, hence never any key: one tenant's prompts cannot answer a lookup for another.

H is xxh3-128. Why 128 bits: with n indexed blocks the expected number of colliding pairs is
about n^2 / 2^(b+1). At n = 10^10 that is ~2.7 for b = 64 (a collision is expected, and it
would make the index claim a prefix the engine does not hold) and ~1.5e-19 for b = 128.
The key is 16 bytes; xxh3-128 costs the same as xxh3-64 on short inputs.
"""

from __future__ import annotations

import array
import hashlib
import hmac
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import xxhash

KEY_BYTES = 16
BlockKey = bytes
"""A 16-byte block key (xxh3-128 digest)."""

SALT_PREFIX = "kvg1:"
EPHEMERAL_SALT_PREFIX = "kvg1:e:"
"""Salt marker of ephemeral scopes (sensitive requests): agents drop such blocks and the
gateway writes no pending entries for them."""

_ROOT_TAG = b"kvg1-root\x00"
_NATIVE_LITTLE = sys.byteorder == "little"


class KeyMaterialError(ValueError):
    """Invalid key material (empty secret, bad salt)."""


class ScopeKind(StrEnum):
    TENANT = "tenant"
    GROUP = "group"  # an operator-declared trust group of tenants
    SESSION = "session"  # sensitive: reuse only within one session
    REQUEST = "request"  # sensitive: no reuse at all


@dataclass(frozen=True, slots=True)
class Scope:
    """An isolation scope: only requests of the same scope may share cached blocks."""

    kind: ScopeKind
    name: str

    @property
    def ephemeral(self) -> bool:
        return self.kind in (ScopeKind.SESSION, ScopeKind.REQUEST)

    def canonical(self) -> str:
        return f"{self.kind.value}:{self.name}"

    def routing_key(self) -> str:
        """The scope whose tie rounds and random draws the router keeps for this one's
        requests (D26): its own, but for a per-request scope (``<tenant>/<one-off id>``)
        its tenant's per-request scopes together, ``request:<tenant>``: one request has no
        rounds to keep, and a flood of them would push every tenant's out of the router's
        LRU. Nothing of another tenant's or of a trust group's is shared."""
        if self.kind is ScopeKind.REQUEST:
            return f"{self.kind.value}:{self.name.rpartition('/')[0]}"
        return self.canonical()


def is_kvgate_salt(salt: str) -> bool:
    return salt.startswith(SALT_PREFIX)


def is_ephemeral_salt(salt: str) -> bool:
    return salt.startswith(EPHEMERAL_SALT_PREFIX)


SALT_CACHE_SCOPES = 4096


class SaltMinter:
    """Derives the engine ``cache_salt`` of a scope from server-side secrets.

    Two live secrets allow rotation: the first is primary (used for new traffic); the
    gateway also looks up keys under the second so a rotation does not empty the cache at
    once. The MAC is HMAC-SHA256 (256 bits, as vLLM's docs recommend for salts).
    """

    def __init__(self, secrets: Sequence[bytes]) -> None:
        if not 1 <= len(secrets) <= 2:
            raise KeyMaterialError("one or two live secrets are required")
        for s in secrets:
            if len(s) < 16:
                raise KeyMaterialError("a salt secret must be at least 16 bytes")
        self._secrets = tuple(secrets)
        # salts of long-lived scopes (tenants, groups), computed once: an HMAC per request
        # and secret is measurable on the gateway's hot path; bounded by clearing when full
        self._cache: dict[str, list[str]] = {}

    @property
    def n_secrets(self) -> int:
        return len(self._secrets)

    def salt(self, scope: Scope, secret_index: int = 0) -> str:
        mac = hmac.new(
            self._secrets[secret_index], scope.canonical().encode(), hashlib.sha256
        ).hexdigest()
        return (EPHEMERAL_SALT_PREFIX if scope.ephemeral else SALT_PREFIX) + mac

    def salts(self, scope: Scope) -> list[str]:
        """Salts under every live secret, primary first (a new list each call)."""
        name = scope.canonical()
        cached = self._cache.get(name)
        if cached is None:
            cached = [self.salt(scope, i) for i in range(len(self._secrets))]
            if not scope.ephemeral:  # one-off names (per request) are never cached
                if len(self._cache) >= SALT_CACHE_SCOPES:
                    self._cache.clear()
                self._cache[name] = cached
        return list(cached)


_PACK_MAX = 64  # up to this many ids a precompiled struct packs faster than an array
_PACKERS: dict[int, Callable[..., bytes]] = {}  # n -> struct.Struct(f"<{n}I").pack


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the byte form every key hashes.

    A list of a block's few ids (a decode step's block, keyed by the agent and hashed by
    the engine) goes through a struct made once per length (about twice as fast as an
    array for 16); a longer list through ``array.fromlist`` (a third faster than the array
    constructor's generic sequence loop on a 2,000-id prompt); a uint32 array as it is;
    anything else through the array constructor. The same bytes every way, and an id that
    is no uint32 raises the array's error (OverflowError, TypeError)."""
    if type(tokens) is list:
        n = len(tokens)
        if n <= _PACK_MAX:
            pack = _PACKERS.get(n)
            if pack is None:
                pack = _PACKERS[n] = struct.Struct(f"<{n}I").pack
            try:
                return pack(*tokens)
            except struct.error:
                pass  # not a uint32: fromlist below raises the array's error
        arr = array.array("I")
        arr.fromlist(tokens)
    elif type(tokens) is array.array and tokens.typecode == "I":
        arr = tokens  # the gateway's packed prompt, or a slice of it
    else:
        arr = array.array("I", tokens)  # converts any int array or sequence, checking ids
    if not _NATIVE_LITTLE:  # pragma: no cover - big-endian hosts
        arr = array.array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def root_key(salt: str, model: str, lora: str | None, block_tokens: bytes) -> BlockKey:
    """key_0: length-prefixed fields so no two (salt, model, lora) tuples collide."""
    fields = [salt.encode(), model.encode(), (lora or "").encode()]
    head = b"".join(len(f).to_bytes(4, "little") + f for f in fields)
    return xxhash.xxh3_128_digest(_ROOT_TAG + head + block_tokens)


def chain_key(parent: BlockKey, block_tokens: bytes) -> BlockKey:
    """key_i from key_{i-1} and the block's token bytes."""
    return xxhash.xxh3_128_digest(parent + block_tokens)


def _chained(first: BlockKey, data: bytes, step: int, end: int) -> list[BlockKey]:
    """``first`` (the key of ``data[:step]``) and the key of each further block of
    ``step`` bytes before ``end``: :func:`chain_key` without a call per block."""
    key = first
    out = [key]
    h = xxhash.xxh3_128_digest
    for off in range(step, end, step):
        key = h(key + data[off : off + step])
        out.append(key)
    return out


class BlockKeyer:
    """Computes the chained keys of every full block of a token sequence."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise KeyMaterialError("block_size must be positive")
        self.block_size = block_size

    def keys(
        self,
        tokens: Sequence[int],
        salt: str,
        model: str,
        lora: str | None = None,
        max_blocks: int | None = None,
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``tokens`` (a partial tail block has no key)."""
        n_blocks = len(tokens) // self.block_size
        if max_blocks is not None:
            n_blocks = min(n_blocks, max_blocks)
        if n_blocks == 0:
            return []
        step = self.block_size * 4
        n = n_blocks * self.block_size
        # the whole list unless the cap leaves much of it out (a list slice costs as much as
        # converting a third of it); bytes slices are cheaper than a memoryview's here
        try:
            data = tokens_to_bytes(tokens if 2 * n >= len(tokens) else tokens[:n])
        except (OverflowError, TypeError):
            # an id past the keyed blocks that is no uint32 (an engine's /tokenize reply is
            # not checked): it is never keyed, so it must not fail the keys before it
            data = tokens_to_bytes(tokens[:n])
        return _chained(root_key(salt, model, lora, data[:step]), data, step, n_blocks * step)

    def chain(
        self,
        parent: BlockKey | None,
        tokens: Sequence[int],
        salt: str | None,
        model: str,
        lora: str | None,
    ) -> list[BlockKey]:
        """Keys of consecutive full blocks that follow ``parent`` (the agent's path: a
        BlockStored event carries the parent and the new blocks' tokens). With no parent
        the first block is a root and ``salt`` is required."""
        bs = self.block_size
        if len(tokens) == bs and parent is not None:
            # one block after a known parent (a decode step filled it): most events
            return [chain_key(parent, tokens_to_bytes(tokens))]
        if len(tokens) % bs:
            raise KeyMaterialError("token count is not a multiple of block_size")
        if parent is None and salt is None:
            raise KeyMaterialError("a root block needs the salt")
        data = tokens_to_bytes(tokens)
        if not data:
            return []
        step = bs * 4
        first = data[:step]
        key = (
            root_key(salt or "", model, lora, first) if parent is None else chain_key(parent, first)
        )
        return _chained(key, data, step, len(data))
