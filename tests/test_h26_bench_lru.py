"""R1's E2 (twenty-sixth session): the fleet-capacity bound's LRU evicts a request's tail
blocks before its head, as vLLM's block pool (and the simulated engine's) does."""

from __future__ import annotations

from cachecore.traceanalysis import RequestBlocks, lru_bound


def req(keys: str, bs: int = 4) -> RequestBlocks:
    return RequestBlocks([k.encode() for k in keys], len(keys) * bs, bs)


def test_a_full_fleet_evicts_a_chain_tail_first_so_its_prefix_still_hits() -> None:
    """Capacity one request's blocks + 1: the unrelated second request forces out one block
    of the first. Head first (the old order) lost its root a and with it every later hit on
    abc's prefix; tail first loses c and the third request still hits ab."""
    trace = [req("abc"), req("de"), req("abz")]
    r = lru_bound(trace, 4)
    assert r.request_hits == (0, 0, 8) and r.evictions == 2  # c, then e for z
    # with room to spare the order does not matter: the infinite bound is the ceiling
    assert lru_bound(trace, 5).request_hits == lru_bound(trace, None).request_hits == (0, 0, 8)


def test_a_request_that_hits_keeps_its_whole_chain_ahead_of_its_tail() -> None:
    """A hit re-touches the chain tail first too: the shared head stays most recent, so the
    later request's own tail is what pressure takes next, not the prefix both share."""
    trace = [req("ab"), req("abc"), req("xy"), req("abq")]
    r = lru_bound(trace, 4)  # after abc: [c, b, a] newest last; xy pushes out c only
    assert r.request_hits == (0, 8, 0, 8)  # abc's hit is ab (capped at its 2 blocks)
