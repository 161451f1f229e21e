from __future__ import annotations

import array
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachecore.keys import (
    KEY_BYTES,
    BlockKeyer,
    KeyMaterialError,
    SaltMinter,
    Scope,
    ScopeKind,
    is_ephemeral_salt,
    tokens_to_bytes,
)

SECRET = b"s" * 32


def test_keys_are_chained_and_prefix_stable() -> None:
    k = BlockKeyer(16)
    toks = [random.Random(1).randrange(8000) for _ in range(100)]
    a = k.keys(toks, "kvg1:x", "m")
    b = k.keys(toks[:64] + [1, 2, 3] * 12, "kvg1:x", "m")
    assert len(a) == 6 and all(len(x) == KEY_BYTES for x in a)
    assert a[:4] == b[:4] and a[4] != b[4]


@pytest.mark.parametrize(
    "other",
    [("kvg1:y", "m", None), ("kvg1:x", "m2", None), ("kvg1:x", "m", "lora-a")],
)
def test_salt_model_lora_change_every_key(other: tuple[str, str, str | None]) -> None:
    k = BlockKeyer(16)
    toks = list(range(64))
    base = k.keys(toks, "kvg1:x", "m", None)
    changed = k.keys(toks, *other)
    assert not set(base) & set(changed)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200), st.integers(1, 40))
def test_agent_chain_equals_gateway_keys(tokens: list[int], block_size: int) -> None:
    k = BlockKeyer(block_size)
    full = k.keys(tokens, "kvg1:s", "model", "l")
    n = len(full)
    if n == 0:
        return
    cut = n // 2
    head = k.chain(None, tokens[: cut * block_size], "kvg1:s", "model", "l") if cut else []
    tail = k.chain(
        head[-1] if head else None,
        tokens[cut * block_size : n * block_size],
        None if head else "kvg1:s",
        "model",
        "l",
    )
    assert head + tail == full
    for i in range(1, n):  # one block after its parent: the agent's decode-block path
        one = k.chain(full[i - 1], tokens[i * block_size : (i + 1) * block_size], None, "m", "l")
        assert one == [full[i]]


def test_salts_scope_separation_and_rotation() -> None:
    m = SaltMinter([SECRET, b"t" * 32])
    a = m.salt(Scope(ScopeKind.TENANT, "a"))
    assert a.startswith("kvg1:") and len(a) == 5 + 64
    assert a != m.salt(Scope(ScopeKind.TENANT, "b"))
    assert a != m.salt(Scope(ScopeKind.GROUP, "a"))
    assert m.salts(Scope(ScopeKind.TENANT, "a"))[0] == a
    assert m.salts(Scope(ScopeKind.TENANT, "a"))[1] != a
    e = m.salt(Scope(ScopeKind.SESSION, "s1"))
    assert is_ephemeral_salt(e) and not is_ephemeral_salt(a)


def test_bad_key_material() -> None:
    with pytest.raises(KeyMaterialError):
        SaltMinter([])
    with pytest.raises(KeyMaterialError):
        SaltMinter([b"short"])
    with pytest.raises(KeyMaterialError):
        BlockKeyer(0)
    with pytest.raises(KeyMaterialError):
        BlockKeyer(4).chain(None, [1, 2, 3, 4], None, "m", None)


def test_an_id_past_the_keyed_blocks_is_never_read() -> None:
    """Ids after the last keyed block are not key material: an out-of-range one there (an
    engine's /tokenize reply is not validated) must not fail the keys before it, as it
    never did before the whole-list conversion; one inside a keyed block still does."""
    k = BlockKeyer(4)
    good = list(range(8))
    assert k.keys([*good, 2**40], "s", "m") == k.keys(good, "s", "m")
    assert k.keys([*good, 1, 2, 3, -1], "s", "m", max_blocks=2) == k.keys(good, "s", "m")
    with pytest.raises(OverflowError):
        k.keys([0, 1, 2, 2**40, *good], "s", "m")


@pytest.mark.parametrize("typecode", ["l", "q", "i", "H", "L", "I"])
@pytest.mark.parametrize("n", [3, 16, 100])
def test_tokens_to_bytes_of_any_int_array_equals_the_list(typecode: str, n: int) -> None:
    """Every input form packs to the same bytes (the review of the struct/fromlist paths:
    an array of another typecode longer than the struct's limit was refused)."""
    ids = list(range(n))
    want = array.array("I", ids).tobytes()
    assert tokens_to_bytes(array.array(typecode, ids)) == want
    assert tokens_to_bytes(ids) == tokens_to_bytes(tuple(ids)) == want
    keyer = BlockKeyer(16)
    assert keyer.keys(array.array(typecode, ids), "s", "m") == keyer.keys(ids, "s", "m")


def test_tokens_to_bytes_refuses_what_is_no_uint32_with_the_arrays_errors() -> None:
    for bad in ([1, -2], [1, 2**32], [*range(70), -1], array.array("i", [1, -2])):
        with pytest.raises(OverflowError):
            tokens_to_bytes(bad)
    with pytest.raises(TypeError):
        tokens_to_bytes([1, "2"])  # type: ignore[list-item]
