"""Deterministic output tokens: the simulated model's "sampling".

Token ``j`` of a request's output is a pure function of the prompt and ``j`` (a splitmix64
mix of a prompt fingerprint and the position), so identical prompts produce identical outputs
(and identical decode blocks, which the prefix cache can then share across turns). Ids are
drawn from the tokenizer's :class:`~cachecore.tokenizer.WordVocabulary`, so decoded text is a
stream of real single-token words. No EOS is ever produced: a request generates exactly
``max_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_NUMPY_MIN = 48  # below this a Python loop beats numpy's call overhead
# the mix's constants as numpy scalars, made once: building them per call cost a third of it
_GOLDEN_U64 = np.uint64(_GOLDEN)
_MIX1_U64 = np.uint64(_MIX1)
_MIX2_U64 = np.uint64(_MIX2)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
# (j + 1) * golden (mod 2**64) for j < _STEP_TABLE_LEN: a chunk's positions' first term is
# one slice plus its start's, instead of an arange and a multiply per call
_STEP_TABLE_LEN = 1024
_STEP_TABLE = np.arange(1, _STEP_TABLE_LEN + 1, dtype=np.uint64) * _GOLDEN_U64


def bytes_fingerprint(prompt_bytes: bytes) -> int:
    """A prompt's fingerprint (what its output tokens are drawn from), from its ids as
    uint32 bytes (:func:`cachecore.keys.tokens_to_bytes`)."""
    return xxhash.xxh3_64_intdigest(prompt_bytes)


class OutputTokens:
    """Maps (prompt fingerprint, output position) to a vocabulary id."""

    def __init__(self, vocab_ids: Sequence[int]) -> None:
        if not vocab_ids:
            raise ValueError("empty output vocabulary")
        self.vocab_ids = tuple(int(i) for i in vocab_ids)
        self._vocab_np = np.asarray(self.vocab_ids, dtype=np.int64)
        self._n = len(self.vocab_ids)
        self._n_u64 = np.uint64(self._n)

    def token(self, fingerprint: int, position: int) -> int:
        x = (fingerprint + (position + 1) * _GOLDEN) & _M64
        x = ((x ^ (x >> 30)) * _MIX1) & _M64
        x = ((x ^ (x >> 27)) * _MIX2) & _M64
        x ^= x >> 31
        return self.vocab_ids[x % self._n]

    def tokens(self, fingerprint: int, start: int, count: int) -> list[int]:
        """Tokens at positions ``start .. start+count-1`` (same values as :meth:`token`)."""
        if count < _NUMPY_MIN:
            tok = self.token
            return [tok(fingerprint, p) for p in range(start, start + count)]
        # in place on one array (uint64 arrays wrap silently, as the masks above do);
        # (start + j + 1) * golden + fp = (j + 1) * golden + (start * golden + fp)
        if count <= _STEP_TABLE_LEN:
            x = _STEP_TABLE[:count] + np.uint64((fingerprint + start * _GOLDEN) & _M64)
        else:
            x = np.arange(start + 1, start + count + 1, dtype=np.uint64)
            x *= _GOLDEN_U64
            x += np.uint64(fingerprint)
        x ^= x >> _S30
        x *= _MIX1_U64
        x ^= x >> _S27
        x *= _MIX2_U64
        x ^= x >> _S31
        x %= self._n_u64
        # every x < n now: its int64 view is the same indices, without astype's copy
        out: list[int] = self._vocab_np[x.view(np.int64)].tolist()
        return out
