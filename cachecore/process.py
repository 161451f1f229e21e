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


def batch_gc() -> None:
    """For a batch process that allocates millions of short-lived objects and keeps a
    large, growing heap (the simulator: engine block pools, the index): collect the young
    generation every 20,000 net allocations instead of 700, and the older ones 20x less
    often than that. The default thresholds spent ~8% of a simulation in collections that
    found almost nothing (measured: 20,000 requests at 64 replicas, 14.0-14.3x -> 15.2-15.6x
    real time, the same as with the GC off); cycles are still collected."""
    gc.set_threshold(20_000, 20, 20)
