"""Guards for semantic mutations that no other test caught: keys, scoring, lifecycle,
kvevents and both index backends. Each test names the bug it guards against."""

from __future__ import annotations

import random

import msgpack
import pytest

from cachecore.index.base import PrefixIndex, ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKeyer, KeyMaterialError, SaltMinter, Scope, ScopeKind, root_key
from cachecore.kvevents import (
    BlockRemoved,
    BlockStored,
    MalformedEventError,
    decode_batch,
    normalize_hash,
    salt_from_extra_keys,
)
from cachecore.lifecycle import (
    STORED_BROKEN,
    IndexWrite,
    ReplicaMirror,
    Tier,
    check_entry_values,
    tier_of_medium,
)
from cachecore.scoring import Coefficients, LoadView, OnlineFit, features
from tests.test_index_backends import KEYS, live, make_index

G = int(Tier.GPU)
SECRET = b"s" * 32
SALT = "kvg1:" + "ab" * 32


# ------------------------------------------------------------------------------ keys


def test_salt_cache_tells_scope_kinds_apart() -> None:
    """K4: the salt cache keyed by the scope's name alone would give a group a tenant's salt."""
    tenant, group = Scope(ScopeKind.TENANT, "a"), Scope(ScopeKind.GROUP, "a")
    first = SaltMinter([SECRET])
    assert first.salts(tenant) != first.salts(group)
    assert first.salts(tenant) == [first.salt(tenant)]
    assert first.salts(group) == [first.salt(group)]
    second = SaltMinter([SECRET])
    assert second.salts(group) != second.salts(tenant)
    assert second.salts(group) == [second.salt(group)]
    assert second.salts(tenant) == [second.salt(tenant)]


def test_root_key_length_prefixes_separate_model_and_lora() -> None:
    """K6: without length prefixes (model "m", lora "x") and (model "mx", no lora) collide."""
    block = bytes(16)
    assert root_key(SALT, "m", "x", block) != root_key(SALT, "mx", None, block)
    assert root_key("kvg1:a", "bm", None, block) != root_key("kvg1:ab", "m", None, block)


def test_keys_honour_max_blocks() -> None:
    """K7: max_blocks ignored would key (and look up) the whole prompt."""
    keyer = BlockKeyer(4)
    tokens = list(range(4 * 10 + 2))
    full = keyer.keys(tokens, SALT, "m")
    assert len(full) == 10
    for k in (1, 3, 9, 10):
        assert keyer.keys(tokens, SALT, "m", max_blocks=k) == full[:k]
    assert keyer.keys(tokens, SALT, "m", max_blocks=0) == []


def test_chain_rejects_a_partial_block() -> None:
    """K8: a partial block in a BlockStored would be keyed as if it were full."""
    keyer = BlockKeyer(4)
    with pytest.raises(KeyMaterialError):
        keyer.chain(None, [1, 2, 3, 4, 5], SALT, "m", None)
    assert len(keyer.chain(None, [1, 2, 3, 4], SALT, "m", None)) == 1


def test_salt_secret_needs_16_bytes() -> None:
    """K9: a short (guessable) salt secret accepted."""
    with pytest.raises(KeyMaterialError):
        SaltMinter([b"x" * 15])
    with pytest.raises(KeyMaterialError):
        SaltMinter([b"x" * 16, b"y" * 15])
    assert SaltMinter([b"x" * 16]).n_secrets == 1


# ------------------------------------------------------------------------------ scoring

PRIOR = Coefficients()


def test_online_fit_clamps_coefficients_to_the_prior_box() -> None:
    """S7: an unclamped fit follows an inverted trend (TTFT falling with prefill tokens)
    to a negative prefill cost."""
    fit = OnlineFit(PRIOR, bound=4.0, min_samples=10)
    rng = random.Random(11)
    for i in range(200):
        tokens = 100.0 + 40.0 * i + rng.uniform(0, 20)
        x = features(tokens, 0.0, LoadView())
        fit.update(x, max(1.0, 9000.0 - 1.0 * tokens))
    got, prior = fit.coefficients().as_vector(), PRIOR.as_vector()
    for g, p in zip(got, prior, strict=True):
        assert p / 4 - 1e-9 <= g <= p * 4 + 1e-9, (got, prior)


def test_online_fit_rejects_a_single_outlier() -> None:
    """S8: outlier rejection off lets one 100x sample (a GC pause) move the model."""
    fit = OnlineFit(PRIOR, min_samples=20)
    rng = random.Random(5)
    for _ in range(50):
        load = LoadView(queued_prefill_tokens=rng.uniform(0, 4000), running=rng.randrange(8))
        x = features(rng.uniform(0, 2000), 0.0, load)
        y = sum(a * b for a, b in zip(PRIOR.as_vector(), x, strict=True)) + rng.gauss(0, 2.0)
        assert fit.update(x, y)
    before = fit.coefficients()
    x = features(1000.0, 0.0, LoadView())
    y = sum(a * b for a, b in zip(PRIOR.as_vector(), x, strict=True))
    assert fit.update(x, 100.0 * y) is False
    assert fit.coefficients() == before


# ------------------------------------------------------------------------------ lifecycle


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_removing_a_middle_block_breaks_the_stored_run(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """L1: STORED_BROKEN never set would let a lookup count a chain through a removed block."""
    mirror = ReplicaMirror(BlockKeyer(4), "m")
    keys = BlockKeyer(4).keys(list(range(12)), SALT, "m")
    idx = make_index(kind, request)
    try:
        await live(idx, "a")
        stored = BlockStored([1, 2, 3], None, list(range(12)), 4, extra_keys=[(SALT,), None, None])
        write, _ = mirror.apply([stored])
        await idx.apply("a", 0, write, 1)
        assert (await idx.lookup(keys, ["a"], 2))["a"].stored_blocks == 3
        write, _ = mirror.apply([BlockRemoved([2])])
        await idx.apply("a", 0, write, 3)
        assert (await idx.lookup(keys, ["a"], 4))["a"].stored_blocks == 1
        assert mirror._value[keys[2]] & STORED_BROKEN
        assert (await idx.replica_blocks("a"))[keys[2]] & STORED_BROKEN
    finally:
        await idx.close()


def test_entry_values_reject_broken_bits_of_tiers_not_held() -> None:
    """L9: a "run broken on CPU" bit on a GPU-only block (0x21) accepted as an entry value."""
    bad = G | (int(Tier.CPU) << 4)
    assert bad == 0x21
    with pytest.raises(ValueError):
        check_entry_values([bad])
    with pytest.raises(ValueError):
        check_entry_values([0x11, bad])
    check_entry_values([0x11, 0x111, G])


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_index_apply_rejects_broken_bits_of_tiers_not_held(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """L9: an index storing a value whose broken bits name a tier the block is not on."""
    idx = make_index(kind, request)
    try:
        await live(idx, "a")
        with pytest.raises(ValueError):
            await idx.apply("a", 0, IndexWrite({KEYS[0]: 0x21}), 1)
        assert await idx.replica_blocks("a") == {}
    finally:
        await idx.close()


def test_unknown_medium_is_the_remote_tier() -> None:
    """L4: an unknown medium must count as the slowest tier, not a fast one."""
    assert tier_of_medium("FOO") is Tier.REMOTE
    assert tier_of_medium("foo") is Tier.REMOTE


# ------------------------------------------------------------------------------ index backends


async def _pending(idx: PrefixIndex, key: bytes, now_ms: int) -> int:
    return (await idx.lookup([key], ["a"], now_ms))["a"].pending_blocks


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_pending_cap_trims_whole_expiry_groups(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """R13: trimming the pending set by rank splits a request's keys (one expiry group)."""
    idx = make_index(kind, request, max_pending_per_replica=3)
    try:
        await live(idx, "a")
        await idx.add_pending("a", KEYS[:1], 100, 0)  # expiry 100, in two adds
        await idx.add_pending("a", KEYS[1:2], 100, 0)
        await idx.add_pending("a", KEYS[2:4], 200, 0)  # expiry 200: over the cap of 3
        got = [await _pending(idx, k, 1) for k in KEYS[:4]]
        assert got == [0, 0, 1, 1]
    finally:
        await idx.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_clear_resets_the_removal_log_floor(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """M10/R10: a clear that keeps the old removal-log floor says "cannot tell" forever.
    Since 0b29039 the clear is the new log's floor (R5 of the twenty-fifth session): asked
    since after the clear, the log tells; since it or before, it cannot."""
    idx = make_index(kind, request, removal_log=2)
    try:
        await live(idx, "a")
        await idx.apply("a", 0, IndexWrite({k: G for k in KEYS[:3]}), 1)
        for i in range(3):  # removals at 10, 11, 12; the log keeps 2: floor 10
            await idx.apply("a", 0, IndexWrite({KEYS[i]: 0}), 10 + i)
        assert await idx.removed_since("a", KEYS[:3], 5) is None
        epoch = await idx.clear_replica("a", ReplicaState.LIVE, 20)
        assert await idx.removed_since("a", KEYS[:3], 21) == [False, False, False]
        assert await idx.removed_since("a", KEYS[:3], 5) is None  # before the clear
        await idx.apply("a", epoch, IndexWrite({KEYS[0]: G}), 21)
        await idx.apply("a", epoch, IndexWrite({KEYS[0]: 0}), 22)
        assert await idx.removed_since("a", KEYS[:2], 21) == [True, False]
        if isinstance(idx, MemoryIndex):
            idx.check_invariants()
    finally:
        await idx.close()


# ------------------------------------------------------------------------------ kvevents


def _batch(event: dict[str, object]) -> bytes:
    return msgpack.packb({"ts": 1.0, "events": [event]}, use_bin_type=True)  # type: ignore[no-any-return]


def test_extra_keys_must_match_the_block_count() -> None:
    """E4: extra_keys shorter than the hashes would shift salts onto the wrong blocks."""
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "extra_keys": [[SALT]],
    }
    with pytest.raises(MalformedEventError) as err:
        decode_batch(_batch(event))
    assert err.value.reason == "bad_field"
    event["extra_keys"] = [[SALT], None]
    assert len(decode_batch(_batch(event)).events) == 1


def test_decode_batch_enforces_the_payload_limit() -> None:
    """E5: the payload size limit not enforced (an 11-byte payload under a 10-byte limit)."""
    payload = msgpack.packb([1.0, []], use_bin_type=True)  # a valid, empty batch
    assert len(payload) == 11
    with pytest.raises(MalformedEventError) as err:
        decode_batch(payload, max_payload_bytes=10)
    assert err.value.reason == "oversized"
    assert decode_batch(payload, max_payload_bytes=11).events == []
    ok = msgpack.packb([1, []], use_bin_type=True)
    assert decode_batch(ok, max_payload_bytes=len(ok)).events == []


def test_salt_is_the_last_kvgate_item() -> None:
    """E3: the salt taken from the first kvgate-looking item instead of the last."""
    assert salt_from_extra_keys(("kvg1:a", "kvg1:b")) == "kvg1:b"
    assert salt_from_extra_keys(("kvg1:a", "lora", 7)) == "kvg1:a"


def test_a_bool_is_not_a_block_hash() -> None:
    """E7: True accepted as block hash 1."""
    with pytest.raises(MalformedEventError) as err:
        normalize_hash(True)
    assert err.value.reason == "bad_hash"
    assert normalize_hash(1) == 1


def test_restore_refuses_records_no_mirror_writes() -> None:
    """A persisted mirror that no mirror wrote (a record of another length, or one key's
    records naming two parents: a corrupt or foreign index) was restored as it was: garbage
    keys, and children linked under one parent while the values followed the other."""
    from cachecore.lifecycle import MirrorRecordError

    keys = BlockKeyer(4).keys(list(range(8)), SALT, "m")
    gpu = bytes([1, 0, 0, 0])
    good = {1: keys[0] + gpu, 2: keys[1] + keys[0] + gpu}
    mirror = ReplicaMirror(BlockKeyer(4), "m")
    mirror.restore(good)
    mirror.check_invariants()
    assert mirror.blocks().keys() == {keys[0], keys[1]}
    other_parent = bytes(16)
    for bad in (
        {**good, 3: b"\x01" * 10},  # neither 4, 20 nor 36 bytes
        {**good, 3: b"\x01"},
        {**good, 3: keys[1] + other_parent + gpu},  # keys[1] under two parents
        {**good, 3: keys[1] + gpu},  # keys[1] both a root and a child
        {1: keys[0] + keys[0] + gpu},  # its own parent
    ):
        with pytest.raises(MirrorRecordError):
            mirror.restore(bad)
        assert len(mirror) == 0 and mirror.snapshot() == {}  # nothing half-restored
    mirror.restore(good)  # and usable again
    mirror.check_invariants()
