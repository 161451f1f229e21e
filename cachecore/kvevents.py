"""vLLM KV-cache event wire format: the one codec the simulated engine publishes with and
the cache agent decodes with. SGLang publishes the same frames and batches (its own event
structs, a subset of vLLM's fields plus the extensions listed below; docs/agent.md).

Transport (ZMQ PUB): one multipart message per engine step,
``[topic, seq (8 bytes big-endian), payload (msgpack)]``. Replay (ZMQ ROUTER): a DEALER sends
``[b"", start_seq]`` and receives ``[b"", (topic,) seq, payload]`` per buffered batch, then an end
marker whose seq is -1 with an empty payload.

Payload shapes, all decoded:

* batch as an array ``[ts, events, data_parallel_rank?]`` (vLLM's ``array_like`` structs) or as a
  map ``{"ts", "events", "data_parallel_rank"?}`` (one vLLM snapshot; 0.26 to 0.33 send an
  array batch of map events, the simulated replica's default);
* each event as a positional array whose first element is the tag, or as a map with the tag
  under ``"type"``;
* block hashes as ints or bytes (bytes: the last 8 bytes, big-endian);
* SGLang's request salt: the ``cache_salt`` key of a map event (SGLang after its switch to
  map events), or the metadata map SGLang 0.5.18 appends to an array BlockStored where vLLM
  has ``lora_name`` (``["BlockStored", ..., medium, {"cache_salt": ...}]``), read into
  :attr:`BlockStored.cache_salt`;
* SGLang's EAGLE stores (``token_ids`` of ``[token, next token]`` pairs): skipped, see
  :class:`_SkippedEvent`.

Unknown fields are ignored and missing trailing optional fields default to ``None``. Anything
else raises :class:`MalformedEventError` with a short ``reason`` the agent counts by.
"""

from __future__ import annotations

import array
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack

from cachecore.keys import is_kvgate_salt

END_SEQ = -1
END_SEQ_BYTES = END_SEQ.to_bytes(8, "big", signed=True)
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_TOKENS_PER_EVENT = 4 * 1024 * 1024
MEDIUM_GPU = "GPU"


class MalformedEventError(ValueError):
    """A message that is not a valid KV event batch. ``reason`` is a short stable label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class Encoding(StrEnum):
    MAP = "map"  # batch and events as maps (seen in one vLLM snapshot)
    ARRAY = "array"  # older vLLM: array_like batch and events
    MIXED = "mixed"  # vLLM 0.26 to 0.33 (current): array batch, map events


# built per stored block and per evicted block by the engine and the decoder: not frozen
# (a frozen slots dataclass's __init__ is ~3x slower); read-only, never changed after it
@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # vLLM 0.33: LOCAL or REMOTE to the publisher (its STORAGE)
    # SGLang (0.5.18+): the request's cache_salt, on every store of a salted request; vLLM
    # carries the salt in block 0's extra_keys instead. Not positional: written in map
    # encodings only.
    cache_salt: str | None = None


@dataclass(slots=True)  # not frozen, read-only: see BlockStored
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float  # NaN when the engine sent no usable (finite) time
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
    # the events left out, each as its tag (a type this decoder does not know) or
    # "BlockStored:<why>" (a store with nothing to key, see _SkippedEvent): one such event
    # must not cost the rest of its batch (a lost batch is a gap, then a cold clear)
    skipped: list[str] = field(default_factory=list)


_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
)
_STORED_REQUIRED = 4  # block_hashes, parent, token_ids, block_size
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality")
# Fields vLLM declares with a default: omitted from map encoding when they hold it.
_STORED_DEFAULTED = frozenset(
    {"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality"}
)
_REMOVED_DEFAULTED = frozenset({"group_idx", "locality"})


# ---------------------------------------------------------------------------------- encode


def _event_to_wire(ev: KVEvent, as_map: bool) -> Any:
    names: tuple[str, ...]
    if isinstance(ev, BlockStored):
        tag, names, defaulted = "BlockStored", _STORED_FIELDS, _STORED_DEFAULTED
    elif isinstance(ev, BlockRemoved):
        tag, names, defaulted = "BlockRemoved", _REMOVED_FIELDS, _REMOVED_DEFAULTED
    else:
        return {"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"]
    values = [getattr(ev, n) for n in names]
    values = [
        list(v) if n == "extra_keys" and v is not None else v
        for n, v in zip(names, values, strict=True)
    ]
    if as_map:
        out: dict[str, Any] = {"type": tag}
        for n, v in zip(names, values, strict=True):
            if v is None and n in defaulted:
                continue
            out[n] = v
        if isinstance(ev, BlockStored) and ev.cache_salt is not None:
            out["cache_salt"] = ev.cache_salt
        return out
    if isinstance(ev, BlockStored) and ev.cache_salt is not None:
        raise ValueError("cache_salt is written in map encodings only")
    # array_like with omit_defaults drops trailing fields that hold their default
    while values and values[-1] is None and names[len(values) - 1] in defaulted:
        values.pop()
    return [tag, *values]


def encode_batch(batch: EventBatch, encoding: Encoding = Encoding.MAP) -> bytes:
    events_as_map = encoding in (Encoding.MAP, Encoding.MIXED)
    events = [_event_to_wire(e, events_as_map) for e in batch.events]
    body: Any
    if encoding is Encoding.MAP:
        body = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            body["data_parallel_rank"] = batch.data_parallel_rank
    else:
        body = [batch.ts, events]
        if batch.data_parallel_rank is not None:
            body.append(batch.data_parallel_rank)
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def seq_from_bytes(raw: bytes) -> int:
    if len(raw) != 8:
        raise MalformedEventError("bad_seq", f"seq frame of {len(raw)} bytes")
    return int.from_bytes(raw, "big", signed=True)


# ---------------------------------------------------------------------------------- decode


def normalize_hash(value: Any) -> int:
    """Engine block hash as an int: ints as they are, bytes by their last 8 bytes."""
    if isinstance(value, bool):
        raise MalformedEventError("bad_hash", "bool is not a hash")
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray):
        if not value:
            raise MalformedEventError("bad_hash", "empty bytes")
        return int.from_bytes(bytes(value[-8:]), "big")
    raise MalformedEventError("bad_hash", type(value).__name__)


def _salt_field(value: Any) -> str | None:
    """SGLang's ``cache_salt`` of a store: None or a string. Any other value skips the store
    (not the batch: before SGLang's salt was read, such a field was ignored, and failing
    the batch would be a gap, a replay failing alike, then a cold clear); its children
    then drop for their unknown parent, so nothing is indexed under a guessed scope."""
    try:
        return _opt_str(value, "cache_salt")
    except MalformedEventError:
        raise _SkippedEvent("BlockStored:bad_cache_salt") from None


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedEventError("bad_field", name)
    return value


def _opt_str(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError as exc:
            raise MalformedEventError("bad_field", name) from exc
    if not isinstance(value, str):
        raise MalformedEventError("bad_field", name)
    return value


def _fields(raw: Any, names: Sequence[str], required: int) -> list[Any]:
    """The event's fields in ``names`` order (None when absent); raises on a missing
    required one. ``raw`` is a map or a tagged array (the tag at index 0)."""
    if type(raw) is dict or isinstance(raw, Mapping):
        if not all(map(raw.__contains__, names[:required])):
            missing = [n for n in names[:required] if n not in raw]
            raise MalformedEventError("missing_field", ",".join(missing))
        return list(map(raw.get, names))
    values = list(raw[1 : len(names) + 1])
    if len(values) < required:
        raise MalformedEventError("missing_field", ",".join(names[len(values) : required]))
    if len(values) < len(names):
        values += [None] * (len(names) - len(values))
    return values


class _SkippedEvent(Exception):
    """A well-formed event the agent can leave out without harm (its message says which and
    why): one of a type we do not know (a newer engine's), or a store of nothing we can key.
    vLLM 0.33 publishes such stores beside ordinary ones in one batch: a hybrid model's
    sliding-window or Mamba group leaves its masked blocks out of ``block_hashes`` while
    ``token_ids`` still covers them (or every block is masked: no hashes), and CPU
    offloading publishes tier placeholders with no tokens. Leaving a store out only loses
    hits (a block stored after it, chained to it, is dropped for its unknown parent); losing
    the batch instead was a gap, then a replay that failed the same way, then a cold
    clear of the replica's whole index. SGLang under EAGLE speculative decoding publishes
    stores whose ``token_ids`` are ``[token, next token]`` pairs (its radix cache is keyed by
    them): a block's content then depends on the token after it, which our key cannot say,
    so they are left out too."""


def _decode_event(raw: Any, max_tokens: int) -> KVEvent:
    if isinstance(raw, Mapping):
        tag = raw.get("type")
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
    else:
        raise MalformedEventError("bad_event", "event is neither map nor tagged array")
    if isinstance(tag, bytes):
        tag = tag.decode(errors="replace")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        r_hashes, r_medium, r_group, r_locality = _fields(raw, _REMOVED_FIELDS, 1)
        if isinstance(r_hashes, list) and not r_hashes:
            raise _SkippedEvent("BlockRemoved:no_blocks")
        return BlockRemoved(
            block_hashes=_hash_list(r_hashes),
            medium=_opt_str(r_medium, "medium"),
            group_idx=_opt_int(r_group, "group_idx"),
            locality=_opt_str(r_locality, "locality"),
        )
    if tag == "BlockStored":
        (
            raw_hashes,
            parent,
            tokens,
            raw_block_size,
            lora_id,
            medium,
            lora_name,
            extra,
            group_idx,
            spec_kind,
            sliding_window,
            locality,
        ) = _fields(raw, _STORED_FIELDS, _STORED_REQUIRED)
        if isinstance(raw_hashes, list) and not raw_hashes:
            raise _SkippedEvent("BlockStored:no_blocks")  # every block masked
        hashes = _hash_list(raw_hashes)
        if not isinstance(tokens, list) or len(tokens) > max_tokens:
            raise MalformedEventError("bad_field", "token_ids")
        if not tokens:
            raise _SkippedEvent("BlockStored:no_tokens")  # a tier placeholder (offloading)
        try:  # C-speed check that every id is an int in [0, 2**32)
            array.array("I", tokens)
        except (TypeError, OverflowError) as exc:
            if all(isinstance(t, list) and len(t) == 2 for t in tokens):
                # SGLang under EAGLE: its radix cache is keyed by (token, next token) pairs
                # and its stores say so; a page's blocks then hang on the token after it
                raise _SkippedEvent("BlockStored:bigram_tokens") from None
            raise MalformedEventError("bad_field", "token_ids values") from exc
        block_size = _opt_int(raw_block_size, "block_size")
        if block_size is None or block_size <= 0:
            raise MalformedEventError("bad_field", "block_size")
        if len(tokens) != block_size * len(hashes):
            # masked blocks (a hybrid model's sliding-window group): the hashes cannot be
            # matched to their tokens
            raise _SkippedEvent("BlockStored:token_count_mismatch")
        cache_salt: str | None = None
        if isinstance(lora_name, Mapping):
            # SGLang 0.5.18's salted store: its metadata map sits where vLLM has lora_name
            cache_salt = _salt_field(lora_name.get("cache_salt"))
            lora_name = None
        elif isinstance(raw, Mapping):
            # SGLang's map events carry the salt by name (the metadata map: a draft shape)
            meta = raw.get("metadata")
            named = raw.get("cache_salt")
            if named is None and isinstance(meta, Mapping):
                named = meta.get("cache_salt")
            cache_salt = _salt_field(named)
        extra_keys: list[tuple[Any, ...] | None] | None = None
        if extra is not None:
            if not isinstance(extra, list) or len(extra) != len(hashes):
                raise MalformedEventError("bad_field", "extra_keys")
            extra_keys = [tuple(e) if isinstance(e, list | tuple) else None for e in extra]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else normalize_hash(parent),
            token_ids=tokens,
            block_size=block_size,
            lora_id=_opt_int(lora_id, "lora_id"),
            medium=_opt_str(medium, "medium"),
            lora_name=_opt_str(lora_name, "lora_name"),
            extra_keys=extra_keys,
            group_idx=_opt_int(group_idx, "group_idx"),
            kv_cache_spec_kind=_opt_str(spec_kind, "kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=_opt_int(sliding_window, "kv_cache_spec_sliding_window"),
            locality=_opt_str(locality, "locality"),
            cache_salt=cache_salt,
        )
    if isinstance(tag, str) and tag:
        raise _SkippedEvent(tag[:64])
    raise MalformedEventError("unknown_event", str(tag)[:64])


_JUST_INT = {int}


def _hash_list(raw: Any) -> list[int]:
    if not isinstance(raw, list) or not raw:
        raise MalformedEventError("bad_field", "block_hashes")
    if set(map(type, raw)) == _JUST_INT:  # the usual case, checked at C speed
        return raw
    return [normalize_hash(h) for h in raw]


def decode_batch(
    payload: bytes,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    max_tokens_per_event: int = DEFAULT_MAX_TOKENS_PER_EVENT,
) -> EventBatch:
    """Decode one msgpack batch in any of the shapes vLLM has shipped."""
    if len(payload) > max_payload_bytes:
        raise MalformedEventError("oversized", f"{len(payload)} bytes")
    try:
        # the size was checked above; unpackb itself takes no buffer limit
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise MalformedEventError("bad_msgpack", type(exc).__name__) from exc
    except Exception as exc:  # msgpack raises assorted errors on truncated input
        raise MalformedEventError("bad_msgpack", type(exc).__name__) from exc
    if isinstance(body, Mapping):
        ts, events, dp = body.get("ts"), body.get("events"), body.get("data_parallel_rank")
    elif isinstance(body, list) and len(body) >= 2:
        ts, events = body[0], body[1]
        dp = body[2] if len(body) > 2 else None
    else:
        raise MalformedEventError("bad_batch", "batch is neither map nor [ts, events, ...]")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise MalformedEventError("bad_batch", "ts")
    if not isinstance(events, list):
        raise MalformedEventError("bad_batch", "events")
    decoded: list[KVEvent] = []
    skipped: list[str] = []
    for raw in events:
        try:
            decoded.append(_decode_event(raw, max_tokens_per_event))
        except _SkippedEvent as skip:
            skipped.append(str(skip))
    t = float(ts)
    return EventBatch(
        ts=t if math.isfinite(t) else math.nan,
        events=decoded,
        data_parallel_rank=_opt_int(dp, "data_parallel_rank"),
        skipped=skipped,
    )


def root_salt(ev: BlockStored) -> str | None:
    """The kvgate salt of a chain's first block: vLLM's (block 0's ``extra_keys``) or
    SGLang's (its ``cache_salt`` field); None when neither is a kvgate salt, and None when
    a store carries both and they differ (no engine sends two; choosing one could index a
    sensitive request's blocks under a tenant's scope)."""
    salt = salt_from_extra_keys(ev.extra_keys[0] if ev.extra_keys else None)
    named = ev.cache_salt
    if named is None:
        return salt
    if salt is not None:
        return salt if named == salt else None
    return named if is_kvgate_salt(named) else None


def salt_from_extra_keys(extra: tuple[Any, ...] | None) -> str | None:
    """The cache_salt of block 0: vLLM appends it after LoRA and multimodal items, so it is
    the last string item; kvgate salts are recognised by their ``kvg1:`` prefix."""
    if not extra:
        return None
    for item in reversed(extra):
        if isinstance(item, str) and is_kvgate_salt(item):
            return item
    return None
