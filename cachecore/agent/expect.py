"""What the index must hold for one replica, derived from the replica's own block dump.

The simulated replica's ``GET /debug/blocks`` lists every cached block of its engine with
its token ids, parent hash and extra keys. Recomputing our keys from that dump with the
shared :class:`~cachecore.keys.BlockKeyer` gives exactly the keys an exact index holds for
the replica: chains rooted in a kvgate, non-ephemeral salt (sensitive scopes are never
indexed, and blocks of requests without our salt have no key). The agent tests and
``kvgate bench soak`` compare the index against it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from cachecore.keys import BlockKey, BlockKeyer, is_ephemeral_salt, is_kvgate_salt
from cachecore.kvevents import salt_from_extra_keys


class ReplicaNotIdleError(RuntimeError):
    """The replica kept running requests for the whole wait."""


def expected_keys(dump: dict[str, Any], model: str) -> set[BlockKey]:
    """Our keys of every cached block in ``dump`` (a ``/debug/blocks`` answer) that the
    index must hold. Raises ``ValueError`` if a cached block's parent is not cached (the
    engine's prefix cache never holds such a block)."""
    keyer = BlockKeyer(int(dump["block_size"]))
    by_hash = {b["block_hash"]: b for b in dump["blocks"]}
    memo: dict[int, BlockKey | None] = {}

    def lora_of(extra: list[Any] | None) -> str | None:
        for item in extra or ():
            if isinstance(item, str) and not is_kvgate_salt(item):
                return item
        return None

    def key_of(h: int) -> BlockKey | None:
        # iterative over the parent chain: a long prompt's chain is thousands deep
        path: list[int] = []
        x: int | None = h
        while x is not None and x not in memo:
            path.append(x)
            parent = by_hash[x]["parent_block_hash"]
            if parent is not None and parent not in by_hash:
                raise ValueError(f"cached block {x} has a parent {parent} that is not cached")
            x = parent
        for y in reversed(path):
            b = by_hash[y]
            extra = b["extra_keys"]
            parent = b["parent_block_hash"]
            key: BlockKey | None
            if parent is None:
                s = salt_from_extra_keys(tuple(extra) if extra else None)
                if s is None or is_ephemeral_salt(s):
                    key = None
                else:
                    key = keyer.chain(None, b["token_ids"], s, model, lora_of(extra))[0]
            else:
                pk = memo[parent]
                lora = lora_of(extra)
                key = None if pk is None else keyer.chain(pk, b["token_ids"], None, model, lora)[0]
            memo[y] = key
        return memo[h]

    return {k for h in by_hash if (k := key_of(h)) is not None}


async def dump_when_idle(
    client: httpx.AsyncClient, url: str, timeout_s: float = 8.0
) -> dict[str, Any]:
    """The replica's block dump once it runs nothing (no step in flight, no request
    running or waiting), so the dump and the events published so far agree."""
    deadline = time.monotonic() + timeout_s
    while True:
        d: dict[str, Any] = (await client.get(f"{url}/debug/blocks")).json()
        if not d["step_in_flight"] and d["num_running"] == 0 and d["num_waiting"] == 0:
            return d
        if time.monotonic() > deadline:
            raise ReplicaNotIdleError(f"{url} did not go idle within {timeout_s} s")
        await asyncio.sleep(0.02)
