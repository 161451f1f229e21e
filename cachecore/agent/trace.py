"""``--trace-out``: JSON lines of what the agent applied to the index, the cache-event trace
format of :mod:`cachecore.traceanalysis`::

    {"ts": 1712.5, "replica": "r0", "op": "store", "key": "<32 hex>", "tier": "GPU|CPU"}
    {"ts": 1713.0, "replica": "r0", "op": "remove", "key": "<32 hex>", "tier": ""}
    {"ts": 1714.0, "replica": "r0", "op": "clear"}

``store`` is written whenever a key's tier set becomes or stays non-empty (``tier`` names the
complete set), ``remove`` when it becomes empty, ``clear`` when the replica was cleared
(AllBlocksCleared, engine restart, unrecoverable gap). ``ts`` is the engine batch timestamp,
except for a clear no batch carried (agent start, engine restart, gap, new rank): that one
has the agent's wall clock, which can be later than the batches applied after it (a fresh
agent's start-up clear is followed by the engine's replay of older batches). The order of one
replica's records in the file is the order they were applied; readers replay them in that
order (:func:`cachecore.traceanalysis.replay_order`), not sorted by ``ts``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from cachecore.keys import BlockKey
from cachecore.lifecycle import ALL_TIERS


def tier_names(bits: int) -> str:
    return "|".join(t.name or "" for t in ALL_TIERS if bits & int(t))


class TraceWriter:
    """Appends trace records to a file; one writer may serve several replicas (the file is
    opened once, lines are written whole, so records of different replicas never mix)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh: TextIO | None = path.open("a", buffering=1024 * 1024)

    def _written(self) -> None:
        # one flush per index write (writes are coalesced batches), so a reader such as
        # `kvgate trace analyze` sees every applied change while the agent runs
        if self._fh is not None:
            self._fh.flush()

    def blocks(self, ts: float, replica: str, blocks: dict[BlockKey, int]) -> None:
        if self._fh is None:
            return
        lines = []
        for key, bits in blocks.items():
            op = "store" if bits else "remove"
            rec = {
                "ts": ts,
                "replica": replica,
                "op": op,
                "key": key.hex(),
                "tier": tier_names(bits),
            }
            lines.append(json.dumps(rec, separators=(",", ":")))
        if lines:
            self._fh.write("\n".join(lines) + "\n")
            self._written()

    def clear(self, ts: float, replica: str) -> None:
        if self._fh is not None:
            rec = {"ts": ts, "replica": replica, "op": "clear"}
            self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._written()

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
