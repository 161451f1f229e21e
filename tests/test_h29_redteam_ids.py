"""Red team (H29): the ids the gateway makes up must not be predictable by a tenant.

The gateway drew the engine's request id suffix (``<client id>-<16 hex>``, which vLLM and
the simulated replica answer back in the completion's ``id``) and the ``x-request-id`` of a
request that sent none (32 hex) from Python's global ``random``: a Mersenne Twister, whose
whole state is 624 consecutive 32-bit outputs. Tenant b read them off 312 of its own
answers (two seconds on a 2-core VM), cloned the generator, and from then on counted the
words drawn between two of its requests: every other tenant's request, exactly (two words
each, six when it sent no id of its own), timed to b's polling, and it could tell every
other client the request id the gateway would give it. /health stopped carrying the
in-flight count for less (docs/security.md). The ids now come from ``os.urandom``.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from tests.test_gateway_support import stack, words
from tests.test_isolation import auth, chat_body, key_store

pytestmark = pytest.mark.timeout(120)

MT_WORDS = 624  # 32-bit outputs that fix a Mersenne Twister's state


def _unshift_right(y: int, s: int) -> int:
    r = y
    for _ in range(32 // s + 1):
        r = y ^ (r >> s)
    return r & 0xFFFFFFFF


def _unshift_left(y: int, s: int, mask: int) -> int:
    r = y
    for _ in range(32 // s + 1):
        r = y ^ ((r << s) & mask)
    return r & 0xFFFFFFFF


def _untemper(y: int) -> int:
    y = _unshift_right(y, 18)
    y = _unshift_left(y, 15, 0xEFC60000)
    y = _unshift_left(y, 7, 0x9D2C5680)
    return _unshift_right(y, 11)


def clone_mt(outputs: list[int]) -> random.Random:
    """The generator that drew ``outputs`` (624 consecutive 32-bit words), positioned after
    them."""
    state = tuple(_untemper(o) for o in outputs[-MT_WORDS:])
    r = random.Random()
    r.setstate((3, (*state, MT_WORDS), None))
    return r


def mt_words(hex_value: str) -> list[int]:
    """The 32-bit words ``getrandbits(4 * len(hex_value))`` drew, in drawing order."""
    v = int(hex_value, 16)
    return [(v >> (32 * i)) & 0xFFFFFFFF for i in range(len(hex_value) // 8)]


def words_until(clone: random.Random, seen: list[int], limit: int = 5_000) -> int | None:
    """How many words ``clone`` draws before ``seen`` (None: not within ``limit``)."""
    window = [clone.getrandbits(32) for _ in seen]
    for skipped in range(limit):
        if window == seen:
            return skipped
        window = [*window[1:], clone.getrandbits(32)]
    return None


def test_the_clone_works() -> None:
    """The instrument itself: it clones a generator from its 64-bit draws and counts."""
    gen = random.Random(11)
    seen: list[int] = []
    for _ in range(MT_WORDS // 2):
        seen += mt_words(f"{gen.getrandbits(64):016x}")
    clone = clone_mt(seen)
    for _ in range(5):  # another client's five requests
        gen.getrandbits(64)
    assert words_until(clone, mt_words(f"{gen.getrandbits(64):016x}")) == 10


async def _collect(h: httpx.AsyncClient, model: str, n: int, own_id: bool) -> list[int]:
    """The words drawn for tenant b's ``n`` requests, read off each answer: the engine id's
    suffix in its ``id`` (``cmpl-<b's id>-<suffix>``) and, for a request that sent no id,
    the ``x-request-id`` the gateway made up before it (also in the ``id``)."""
    out = []
    for i in range(n):
        body: dict[str, Any] = {"model": model, "prompt": "hello there", "max_tokens": 1}
        headers = auth("sk-b") | ({"x-request-id": f"b{i}"} if own_id else {})
        r = await h.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        _, rid, suffix = r.json()["id"].rsplit("-", 2)
        assert len(suffix) == 16
        if not own_id:
            assert len(rid) == 32 and r.headers["x-request-id"] == rid
            out += mt_words(rid)
        out += mt_words(suffix)
    return out


@pytest.mark.parametrize("source", ["engine_id_suffix", "made_up_request_id"])
async def test_a_tenant_cannot_clone_the_id_generator_to_count_others_requests(
    source: str,
) -> None:
    own_id = source == "engine_id_suffix"
    async with (
        stack(count=1, build={"key_store": key_store()}, open_access=False) as st,
        st.http() as h,
    ):
        seen = await _collect(h, st.model, MT_WORDS // (2 if own_id else 6), own_id)
        assert len(seen) == MT_WORDS and len(set(seen)) == len(seen)
        clone = clone_mt(seen)
        # tenant a sends three requests (with ids of its own: two words each, before)
        for j in range(3):
            body = chat_body(st.model, words(40, j), "a private question")
            headers = auth("sk-a") | {"x-request-id": f"a{j}"}
            assert (await h.post("/v1/chat/completions", json=body, headers=headers)).is_success
        counted = words_until(clone, await _collect(h, st.model, 1, own_id))
        # before: 6 in both (a's three requests, exactly); a word count to search is no defence
        assert counted is None, f"b counted {counted} words drawn by other tenants' requests"
