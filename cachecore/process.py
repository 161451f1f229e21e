"""Process-wide runtime settings shared by the long-running kvgate processes (gateway,
replica). Set by entry points only: they change the whole interpreter."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect, then move every object alive after start-up (modules, policy, tokenizer,
    clients, replica tables, an engine's block pool) into the GC's permanent generation
    (``gc.freeze``): full collections then traverse only what requests allocate, which keeps
    their pauses out of the serving tail (a replica's full collection over its start-up heap
    took ~70 ms, a stall of its engine loop; the gateway's showed in its decision p99, see
    docs/benchmarks.md). Frozen objects are still freed by reference counting; only cycles
    among them leak."""
    gc.collect()
    gc.freeze()
