"""Review R-F of H205 (841fde1, a background Responses run judged at its watch's end) and
H199's fidelity commits."""

from __future__ import annotations

import sys
import time

import pytest

from cachecore.index.base import PrefixMatch, ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKeyer, Scope, ScopeKind
from cachecore.lifecycle import IndexWrite, Tier
from gateway.core import Dispatch
from gateway.routing import Decision, Strategy
from tests.test_gateway_faults import checked
from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(60)


def _claim(rid: str, keys: list[bytes], bs: int, lookup_ms: int, watched: bool) -> Dispatch:
    """A request looked up at ``lookup_ms`` whose index claimed its 4 blocks on ``rid``."""
    match = PrefixMatch({Tier.GPU: 4}, stored_blocks=4, pending_blocks=0)
    return Dispatch(
        request_id="r1", tenant="t", endpoint="responses", path="/v1/responses", body={},
        stream=False, client_wants_usage=False, model="m", prompt_tokens=bs * 4 + 1,
        block_size=bs, scope=Scope(ScopeKind.TENANT, "t"), salts=["s"], keys=[keys],
        matches=[{rid: match}], index_source="primary", candidates=[],
        decision=Decision(rid, Strategy.EXPECTED_LATENCY, "test", ()), lookup_ms=lookup_ms,
        background=True, watched=watched,
    )  # fmt: skip


async def test_a_background_runs_late_check_the_log_cannot_tell_quarantines_nothing() -> None:
    """A background run is judged at its watch's end, up to KVGATE_BACKGROUND_WATCH_MAX_S
    (an hour) after its lookup: an honest removal log is trimmed past that lookup by a
    churn of 16,384 removals an hour (or an engine reset, an agent's rewrite, in between),
    so "cannot tell" is what an honest replica's late checks read. Counted on the
    unverifiable track, max_unverifiable of them quarantined a healthy replica (D22 sized
    that track for the seconds from a lookup to a synchronous answer's verdict). Now such a
    check of a watched run is skipped; a synchronous one still counts as before."""
    policy = (
        "quarantine: {missing_fraction: 0.5, k: 3, m: 5, min_claimed_blocks: 2,"
        " settle_s: 0.05, max_unverifiable: 1}"
    )
    async with stack(count=1, policy=policy) as st:
        gw, rid = st.gw, st.replica_id(0)
        assert gw.index is not None and isinstance(gw.index.primary, MemoryIndex)
        primary, bs = gw.index.primary, 16
        keys = BlockKeyer(bs).keys(list(range(bs * 4 + 1)), "kvg1:t", "m")
        now = int(time.time() * 1000)
        lookup_ms = now - 3_600_000  # the POST's lookup, an hour before its run ended
        # its agent's claim; a clear after the lookup (the log's floor: its time), and
        # the run's own prefill stored the blocks again: the claim stands at the check
        epoch = await primary.clear_replica(rid, ReplicaState.LIVE, lookup_ms - 10)
        await primary.apply(rid, epoch, IndexWrite(dict.fromkeys(keys, 1)), lookup_ms - 5)
        epoch = await primary.clear_replica(rid, ReplicaState.LIVE, now - 60_000)
        await primary.apply(rid, epoch, IndexWrite(dict.fromkeys(keys, 1)), now - 50_000)
        late = _claim(rid, keys, bs, lookup_ms, watched=True)
        late.target = gw.pool.get(rid) if gw.pool is not None else None
        gw._check_claims(late, 0)  # the engine served none of the 4 claimed
        got = await checked(gw, rid, 1)
        assert got["unverifiable"] == 0 and got["skipped"] == 1, got
        assert not gw.quarantine.is_quarantined(rid)
        # a synchronous answer's check the log cannot tell still counts (D22)
        sync = _claim(rid, keys, bs, now - 1_000, watched=False)
        sync.target = late.target
        await primary.clear_replica(rid, ReplicaState.LIVE, now - 500)
        epoch = await primary.clear_replica(rid, ReplicaState.LIVE, now - 400)
        await primary.apply(rid, epoch, IndexWrite(dict.fromkeys(keys, 1)), now - 300)
        gw._check_claims(sync, 0)
        got = await checked(gw, rid, 2)
        assert got["unverifiable"] == 1, got
        assert gw.quarantine.is_quarantined(rid)


def _held_bytes(d: Dispatch) -> int:
    """What ``d``'s kept claim keys hold: their lists and key objects, or their pack."""
    held = sum(sys.getsizeof(ks) + sum(map(sys.getsizeof, ks)) for ks in d.keys)
    return held + sys.getsizeof(getattr(d, "claim_keys", b""))


async def test_a_watched_run_keeps_its_claims_keys_packed() -> None:
    """A watch keeps its claim check's keys for up to an hour, up to
    KVGATE_BACKGROUND_WATCH_MAX (1024) of them: as a list of 16-byte bytes objects that
    was 57 bytes a key (a 49-byte object and its list slot), 478 MB for 1024 watches of a
    128k-token prompt's 8,192 blocks, as much as the prompts the watch drops. Packed: 16
    bytes a key (134 MB), and the check reads the same keys (evicted_restored: its lookup
    and its removal-log read of the first missing block)."""
    async with stack(count=1, policy="quarantine: {settle_s: 0.05, min_claimed_blocks: 2}") as st:
        gw, rid = st.gw, st.replica_id(0)
        assert gw.index is not None and isinstance(gw.index.primary, MemoryIndex)
        primary, bs = gw.index.primary, 16
        n = 8_192
        big = _claim(rid, BlockKeyer(bs).keys(list(range(bs * n + 1)), "kvg1:t", "m"), bs, 0, True)
        big.prompt_tokens = bs * n + 1
        big.matches = [{rid: PrefixMatch({Tier.GPU: n}, stored_blocks=n, pending_blocks=0)}]
        gw._keep_claim(big)
        assert _held_bytes(big) < 20 * n, _held_bytes(big) / n
        # the check reads the kept keys: the first block was evicted after the lookup and
        # stored again by the run itself
        now = int(time.time() * 1000)
        keys = BlockKeyer(bs).keys(list(range(bs * 4 + 1)), "kvg1:t", "m")
        epoch = await primary.clear_replica(rid, ReplicaState.LIVE, now - 2_000)
        await primary.apply(rid, epoch, IndexWrite(dict.fromkeys(keys, 1)), now - 1_500)
        d = _claim(rid, keys, bs, now - 1_000, watched=True)
        d.target = gw.pool.get(rid) if gw.pool is not None else None
        await primary.apply(rid, epoch, IndexWrite({keys[0]: 0}), now - 500)
        await primary.apply(rid, epoch, IndexWrite({keys[0]: 1}), now - 400)
        gw._keep_claim(d)
        gw._check_claims(d, 0)
        got = await checked(gw, rid, 1)
        assert got == {"evicted_restored": 1}, got
