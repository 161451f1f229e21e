"""SGLang's KV-cache events against the agent, byte for byte.

The payloads are built here by hand from what SGLang's public source says it publishes
(docs/agent.md, "SGLang's KV events", has the facts and where they were read): the ZMQ
frames and replay protocol of vLLM, an array batch ``[ts, events, attn_dp_rank]``, and per
version:

* to 0.5.x of April 2026: array events ``["BlockStored", hashes, parent, tokens,
  block_size, lora_id, medium]`` and ``["BlockRemoved", hashes, medium]``, one store per
  page, no salt in any event (the engine isolates its cache by ``cache_salt`` but does not
  say so);
* 0.5.18: stores coalesced along a chain; a salted request's store carries a metadata map
  ``{"cache_salt": ...}`` where vLLM has ``lora_name``;
* after that: events as tagged maps (``"type"``), the salt in a ``cache_salt`` field.

Block hashes are SGLang's: a SHA-256 chain over pages (4 little-endian bytes per token),
seeded for a salted request by ``SHA-256(b"sglang-cache-salt-v1\\0" + salt)``, published as
the digest's first 8 bytes read as a signed big-endian int64. Every test then asserts what
the index holds against the keys the gateway's BlockKeyer computes for the same tokens.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from cachecore.agent.frames import parse_live
from cachecore.agent.scrape import parse_metrics
from cachecore.index.layout import engine_hash_field, engine_hash_from_field
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKeyer, Scope, ScopeKind
from cachecore.kvevents import BlockRemoved, BlockStored, MalformedEventError, decode_batch
from cachecore.lifecycle import TIER_MASK, ReplicaMirror, Tier
from tests.test_agent_helpers import BS, MINTER, MODEL, Rig, counter_total, salt

# ------------------------------------------------------------ an SGLang-shaped encoder

_SALT_DOMAIN = b"sglang-cache-salt-v1\x00"


def page_digests(tokens: list[int], page: int, cache_salt: str | None = None) -> list[bytes]:
    """SGLang's chained page digests of a sequence stored from the root."""
    prior = hashlib.sha256(_SALT_DOMAIN + cache_salt.encode()).digest() if cache_salt else b""
    out = []
    for start in range(0, len(tokens), page):
        h = hashlib.sha256(prior)
        for t in tokens[start : start + page]:
            h.update(t.to_bytes(4, "little"))
        prior = h.digest()
        out.append(prior)
    return out


def event_hash(digest: bytes) -> int:
    """What an event carries for a page: the digest's first 64 bits as a signed int."""
    return int.from_bytes(digest[:8], "big", signed=True)


def page_hashes(tokens: list[int], page: int, cache_salt: str | None = None) -> list[int]:
    return [event_hash(d) for d in page_digests(tokens, page, cache_salt)]


def stored_array(
    hashes: list[int],
    parent: int | None,
    tokens: list[int] | list[list[int]],
    page: int,
    medium: str = "GPU",
    cache_salt: str | None = None,
) -> list[Any]:
    ev: list[Any] = ["BlockStored", hashes, parent, tokens, page, None, medium]
    if cache_salt is not None:  # 0.5.18's BlockStoredWithMetadata
        ev.append({"cache_salt": cache_salt})
    return ev


def stored_map(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    page: int,
    medium: str = "GPU",
    cache_salt: str | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": page,
        "lora_id": None,
        "medium": medium,
    }
    if cache_salt is not None:
        ev["cache_salt"] = cache_salt
    if session_id is not None:
        ev["session_id"] = session_id
    return ev


def per_page_stores(
    tokens: list[int], page: int, cache_salt: str | None = None, *, as_map: bool = False
) -> list[Any]:
    """One store per page chained by parent (SGLang before its event coalescing)."""
    hashes = page_hashes(tokens, page, cache_salt)
    build = stored_map if as_map else stored_array
    out = []
    parent = None
    for i, h in enumerate(hashes):
        out.append(build([h], parent, tokens[i * page : (i + 1) * page], page, "GPU", cache_salt))
        parent = h
    return out


def sgl_batch(events: list[Any], rank: int | None = 0, ts: float | None = None) -> bytes:
    body = [time.time() if ts is None else ts, events, rank]
    out: bytes = msgpack.packb(body, use_bin_type=True)
    return out


def toks(start: int, n_pages: int, page: int = BS) -> list[int]:
    return list(range(start, start + n_pages * page))


def gateway_keys(tokens: list[int], s: str, block_size: int = BS) -> list[bytes]:
    """The keys the gateway looks up for a prompt of ``tokens`` in scope salt ``s``."""
    return BlockKeyer(block_size).keys(tokens, s, MODEL)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r = Rig(MemoryIndex())
    yield r
    await r.close()


# ------------------------------------------------------------------------------ codec


def test_the_encoder_matches_the_documented_hash() -> None:
    """A fixed vector, so a change to the helper above cannot go unnoticed: page 0 of
    tokens 1..4 unsalted is SHA-256 of 01000000 02000000 03000000 04000000."""
    want = hashlib.sha256(bytes.fromhex("01000000020000000300000004000000")).digest()
    assert page_digests([1, 2, 3, 4], 4) == [want]
    h = page_hashes([1, 2, 3, 4], 4)[0]
    assert -(2**63) <= h < 2**63 and h == int(want[:8].hex(), 16) - (
        2**64 if want[0] >= 0x80 else 0
    )
    # salted chains differ from the first page on
    assert page_hashes([1, 2, 3, 4], 4, "a") != page_hashes([1, 2, 3, 4], 4, "b")


def test_decode_an_unsalted_array_batch() -> None:
    tokens = toks(0, 3)
    events = [*per_page_stores(tokens, BS), ["BlockRemoved", page_hashes(tokens, BS)[2:], "GPU"]]
    events.append(["AllBlocksCleared"])
    b = decode_batch(sgl_batch(events, rank=3))
    assert b.data_parallel_rank == 3 and not b.skipped
    s0, s1, _, rem, _ = b.events
    assert isinstance(s0, BlockStored) and isinstance(s1, BlockStored)
    assert isinstance(rem, BlockRemoved)
    assert s0.parent_block_hash is None and s1.parent_block_hash == s0.block_hashes[0]
    assert s0.block_size == BS and s0.medium == "GPU" and s0.lora_name is None
    assert s0.cache_salt is None and s0.extra_keys is None
    assert rem.block_hashes == page_hashes(tokens, BS)[2:]


def test_decode_a_salted_0518_array_store() -> None:
    """SGLang 0.5.18's salted store: a metadata map at vLLM's lora_name position. It used
    to fail the whole batch (``bad_field: lora_name``): a gap, a replay failing the same
    way, a cold clear."""
    s = salt("acme")
    tokens = toks(0, 2)
    hashes = page_hashes(tokens, BS, s)
    meta: dict[str, Any] = {"cache_salt": s, "session_id": "sess-1"}
    ev = [*stored_array(hashes, None, tokens, BS), meta]
    b = decode_batch(sgl_batch([ev, stored_array([99], None, toks(50, 1), BS)]))
    salted, plain = b.events
    assert isinstance(salted, BlockStored) and isinstance(plain, BlockStored)
    assert salted.cache_salt == s and salted.lora_name is None
    assert salted.block_hashes == hashes and plain.cache_salt is None


def test_decode_map_events_carry_the_salt_by_name() -> None:
    s = salt("acme")
    tokens = toks(0, 1)
    ev = stored_map(page_hashes(tokens, BS, s), None, tokens, BS, cache_salt=s, session_id="x")
    draft = {**stored_map([5], None, tokens, BS), "metadata": {"cache_salt": s}}
    b = decode_batch(sgl_batch([ev, draft, {"type": "BlockRemoved", "block_hashes": [5]}]))
    assert [e.cache_salt for e in b.events if isinstance(e, BlockStored)] == [s, s]


@pytest.mark.parametrize(
    "extra", [{"cache_salt": 5}, {"cache_salt": ["kvg1:x"]}, {"metadata": {"cache_salt": 7}}]
)
def test_a_bad_cache_salt_costs_its_store_not_the_batch(extra: dict[str, Any]) -> None:
    """A salt that is no string skips its store (the field was ignored before SGLang's salt
    was read; failing the batch would be a gap, a replay failing alike, a cold clear)."""
    tokens = toks(0, 1)
    good = stored_map([1], None, tokens, BS)
    bad = {**stored_map([2], None, tokens, BS), **extra}
    b = decode_batch(sgl_batch([good, bad]))
    assert b.skipped == ["BlockStored:bad_cache_salt"]
    assert [e.block_hashes for e in b.events if isinstance(e, BlockStored)] == [[1]]
    arr = [*stored_array([3], None, tokens, BS), {"cache_salt": 9}]
    assert decode_batch(sgl_batch([arr])).skipped == ["BlockStored:bad_cache_salt"]


def test_two_salts_on_one_root_store_that_disagree_index_nothing() -> None:
    """No engine sends both; if one did, neither scope is trusted: a sensitive request's
    blocks must not land under a tenant's salt (nor a tenant's under another's)."""
    tokens = toks(0, 1)
    acme, other = salt("acme"), salt("other")
    ephemeral = MINTER.salt(Scope(ScopeKind.SESSION, "s1"))
    for named in (ephemeral, other, "foreign"):
        ev = {**stored_map([1], None, tokens, BS, cache_salt=named), "extra_keys": [[acme]]}
        write, _ = ReplicaMirror(BlockKeyer(BS), MODEL).apply(decode_batch(sgl_batch([ev])).events)
        assert not write.blocks, named
    # the same salt twice is one scope
    ev = {**stored_map([1], None, tokens, BS, cache_salt=acme), "extra_keys": [[acme]]}
    write, _ = ReplicaMirror(BlockKeyer(BS), MODEL).apply(decode_batch(sgl_batch([ev])).events)
    assert set(write.blocks) == set(gateway_keys(tokens, acme))


def test_a_topic_with_sglangs_epoch_suffix_is_the_topic() -> None:
    frame = [b"kv-events\0sgl-kv-epoch=3", (7).to_bytes(8, "big"), b"x"]
    assert parse_live(frame, b"kv-events", 10).seq == 7
    for other in (b"kv-events-2", b"kv-events2\0sgl-kv-epoch=3", b"kv\0x"):
        with pytest.raises(MalformedEventError, match="bad_topic"):
            parse_live([other, (7).to_bytes(8, "big"), b"x"], b"kv-events", 10)


def test_decode_eagle_bigram_stores_are_skipped_not_the_batch() -> None:
    """Under EAGLE SGLang publishes a page's tokens as [token, next token] pairs."""
    tokens = toks(0, 1)
    pairs = [[t, t + 1] for t in tokens]
    bigram = stored_array(page_hashes(tokens, BS), None, pairs, BS)
    b = decode_batch(sgl_batch([bigram, stored_array([7], None, tokens, BS)]))
    assert b.skipped == ["BlockStored:bigram_tokens"] and len(b.events) == 1


def test_sglang_int64_hashes_round_trip_the_persisted_mirror() -> None:
    for h in (page_hashes(toks(0, 1), BS)[0], -(2**63), 2**63 - 1, -1):
        assert engine_hash_from_field(engine_hash_field(h)) == h


def test_the_first_format_cannot_be_indexed() -> None:
    """SGLang's first events (May-June 2025) hashed a page with Python's ``hash`` of its
    token tuple (not chained, per process) and gave a root page the parent ``hash(())``:
    every chain's first block has an unknown parent, so nothing is indexed."""
    tokens = toks(0, 2)
    first = hash(tuple(tokens[:BS]))
    events = [
        ["BlockStored", [first], hash(()), tokens[:BS], BS, None],
        ["BlockStored", [hash(tuple(tokens[BS:]))], first, tokens[BS:], BS, None],
    ]
    mirror = ReplicaMirror(BlockKeyer(BS), MODEL)
    write, _ = mirror.apply(decode_batch(msgpack.packb([1.0, events, 0])).events)
    assert not write.blocks and mirror.counters.dropped_unknown_parent == 2


def test_page_size_one_keys_every_token_when_the_policy_says_so() -> None:
    """SGLang's default page size is 1: a store is one block per token (coalesced along a
    chain since 0.5.18). Keyed in 1-token blocks, the index holds exactly the gateway's keys
    for a policy block_size of 1."""
    s = salt("acme")
    tokens = toks(0, 10, page=1)
    hashes = page_hashes(tokens, 1, s)
    mirror = ReplicaMirror(BlockKeyer(1), MODEL)
    b = decode_batch(sgl_batch([stored_array(hashes, None, tokens, 1, cache_salt=s)]))
    write, _ = mirror.apply(b.events)
    assert set(write.blocks) == set(gateway_keys(tokens, s, block_size=1))


def test_scrape_reads_sglang_cache_config_info() -> None:
    """SGLang since February 2026 says its page size and page count only as labels of an
    info gauge (no ``sglang:page_size`` series)."""
    text = (
        "# TYPE sglang:cache_config_info gauge\n"
        'sglang:cache_config_info{num_pages="5000",page_size="16"} 1.0\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m",dp_rank="0"} 2.0\n'
    )
    snap = parse_metrics(text)
    assert (snap.block_size, snap.num_gpu_blocks, snap.running) == (16, 5000, 2.0)
    gauges = (
        'sglang:page_size{dp_rank="0"} 32.0\n'
        'sglang:num_pages{dp_rank="0"} 100.0\n'
        'sglang:cache_config_info{num_pages="5000",page_size="16"} 1.0\n'
    )
    assert (parse_metrics(gauges).block_size, parse_metrics(gauges).num_gpu_blocks) == (32, 100)


# ----------------------------------------------------------------------- through the agent


async def test_salted_0518_array_stores_index_the_gateway_keys(rig: Rig) -> None:
    """Per-page and coalesced salted stores, removals of SGLang's salted hashes, a host
    (CPU_PINNED) copy: the index holds the gateway's keys for the same tokens, on the
    right tiers, and nothing is dropped."""
    agent = await rig.start()
    s = salt("acme")
    a, b = toks(0, 3), toks(100, 2)
    hb = page_hashes(b, BS, s)
    coalesced = stored_array(hb, None, b, BS, cache_salt=s)
    await rig.source.publish_payload(sgl_batch([*per_page_stores(a, BS, s), coalesced]))
    await rig.settle()
    assert await rig.index_keys() == set(gateway_keys(a, s)) | set(gateway_keys(b, s))
    # HiCache backs b's first page up to host memory, then the GPU evicts b's pages
    host = stored_array(hb[:1], None, b[:BS], BS, medium="CPU_PINNED", cache_salt=s)
    await rig.source.publish_payload(sgl_batch([host, ["BlockRemoved", hb, "GPU"]]))
    await rig.settle()
    blocks = await rig.index.replica_blocks("r0")
    kb = gateway_keys(b, s)
    assert set(blocks) == set(gateway_keys(a, s)) | {kb[0]}
    assert blocks[kb[0]] & TIER_MASK == Tier.CPU
    assert counter_total(agent.metrics.messages_dropped) == 0


async def test_salted_map_stores_index_the_gateway_keys(rig: Rig) -> None:
    agent = await rig.start()
    s = salt("acme")
    tokens = toks(0, 4)
    hashes = page_hashes(tokens, BS, s)
    first = stored_map(hashes[:2], None, tokens[: 2 * BS], BS, cache_salt=s, session_id="s1")
    rest = stored_map(hashes[2:], hashes[1], tokens[2 * BS :], BS, cache_salt=s)
    await rig.source.publish_payload(sgl_batch([first, rest]))
    await rig.settle()
    assert await rig.index_keys() == set(gateway_keys(tokens, s))
    removed = {"type": "BlockRemoved", "block_hashes": hashes[3:], "medium": "GPU"}
    await rig.source.publish_payload(sgl_batch([removed]))
    await rig.settle()
    assert await rig.index_keys() == set(gateway_keys(tokens, s)[:3])
    assert counter_total(agent.metrics.messages_dropped) == 0


async def test_tenants_with_the_same_prompt_stay_apart(rig: Rig) -> None:
    """Two scopes, one prompt: SGLang's salted hashes differ, each chain is indexed under
    its own scope's keys, and evicting one tenant's copy leaves the other's."""
    await rig.start()
    sa, sb = salt("a"), salt("b")
    tokens = toks(0, 2)
    await rig.source.publish_payload(
        sgl_batch([*per_page_stores(tokens, BS, sa), *per_page_stores(tokens, BS, sb)])
    )
    await rig.settle()
    assert await rig.index_keys() == set(gateway_keys(tokens, sa)) | set(gateway_keys(tokens, sb))
    await rig.source.publish_payload(sgl_batch([["BlockRemoved", page_hashes(tokens, BS, sa)]]))
    await rig.settle()
    assert await rig.index_keys() == set(gateway_keys(tokens, sb))


async def test_unsalted_stores_are_dropped_and_said_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang to April 2026 (and any request that bypassed the gateway): no salt in the
    events. Nothing is indexed (tenant isolation), the drop is counted, and one warning
    names the cause."""
    agent = await rig.start()
    with caplog.at_level(logging.WARNING, logger="cachecore.agent.sync"):
        await rig.source.publish_payload(sgl_batch(per_page_stores(toks(0, 3), BS)))
        await rig.source.publish_payload(sgl_batch(per_page_stores(toks(200, 2), BS)))
        await rig.settle()
    assert await rig.index_keys() == set()
    # the counter counts the blocks of the stores that start a chain (one page each here)
    assert counter_total(agent.metrics.blocks_dropped, reason="unscoped") == 2
    said = [r for r in caplog.records if "no kvgate salt" in r.getMessage()]
    assert len(said) == 1 and "SGLang before 0.5.18" in said[0].getMessage()


async def test_foreign_and_sensitive_salts_are_not_indexed(rig: Rig) -> None:
    agent = await rig.start()
    ephemeral = MINTER.salt(Scope(ScopeKind.SESSION, "sess-9"))
    foreign = "tenant-a"  # a client's own salt, not the gateway's
    await rig.source.publish_payload(
        sgl_batch(
            [*per_page_stores(toks(0, 2), BS, ephemeral), *per_page_stores(toks(0, 2), BS, foreign)]
        )
    )
    await rig.settle()
    assert await rig.index_keys() == set()
    # each chain's first page is counted; the page chained after it inherits its fate
    assert counter_total(agent.metrics.blocks_dropped, reason="ephemeral") == 1
    assert counter_total(agent.metrics.blocks_dropped, reason="unscoped") == 1


async def test_page_size_one_against_the_policy_block_size_is_said_once(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """An SGLang left at its default page size (1) behind a gateway keyed in larger blocks:
    its stores cannot be keyed; each is dropped and counted, and one warning says why and
    what to set."""
    agent = await rig.start()
    s = salt("acme")
    tokens = toks(0, 8, page=1)
    with caplog.at_level(logging.WARNING, logger="cachecore.agent.sync"):
        for _ in range(2):
            hashes = page_hashes(tokens, 1, s)
            await rig.source.publish_payload(
                sgl_batch([stored_array(hashes, None, tokens, 1, cache_salt=s)])
            )
            tokens = [t + 1000 for t in tokens]
        await rig.settle()
    assert await rig.index_keys() == set()
    assert counter_total(agent.metrics.messages_dropped, reason="block_size_mismatch") == 2
    said = [r for r in caplog.records if "--page-size" in r.getMessage()]
    assert len(said) == 1 and f"blocks of 1 tokens but this replica is keyed in blocks of {BS}" in (
        said[0].getMessage()
    )


async def test_an_eagle_store_costs_only_itself(rig: Rig) -> None:
    agent = await rig.start()
    clears = counter_total(agent.metrics.clears)
    s = salt("acme")
    a, b = toks(0, 2), toks(300, 1)
    bigram = stored_array(page_hashes(a, BS, s), None, [[t, t + 1] for t in a], BS, cache_salt=s)
    await rig.source.publish_payload(sgl_batch([bigram, *per_page_stores(b, BS, s)]))
    await rig.settle()
    assert await rig.index_keys() == set(gateway_keys(b, s))
    assert counter_total(agent.metrics.events_skipped) == 1
    assert counter_total(agent.metrics.clears) == clears


async def test_an_attention_dp_rank_is_its_own_index_replica(rig: Rig) -> None:
    """Each DP-attention rank publishes on its own port with its rank in the batch."""
    await rig.start()
    s = salt("acme")
    tokens = toks(0, 2)
    await rig.source.publish_payload(sgl_batch(per_page_stores(tokens, BS, s), rank=1))
    await rig.settle()
    assert await rig.index_keys("r0@dp1") == set(gateway_keys(tokens, s))
    assert await rig.index_keys("r0") == set()


async def test_a_gap_is_replayed_in_sglangs_replay_layout() -> None:
    """SGLang answers a replay with ``[b"", seq, payload]`` (no topic frame) and ends with
    seq -1 and an empty payload."""
    r = Rig(MemoryIndex(), old_replay_format=True)
    try:
        agent = await r.start()
        s = salt("acme")
        a, b = toks(0, 2), toks(100, 1)
        await r.source.publish_payload(sgl_batch(per_page_stores(a, BS, s)), send=False)
        await r.source.publish_payload(sgl_batch(per_page_stores(b, BS, s)))
        await r.settle()
        assert await r.index_keys() == set(gateway_keys(a, s)) | set(gateway_keys(b, s))
        assert counter_total(agent.metrics.replays, outcome="ok") >= 1
    finally:
        await r.close()
