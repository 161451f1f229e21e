"""Time and fingerprint workload builds (twenty-third session): every workload's items, by
name at its defaults and scaled as ``kvgate simulate`` scales them, hashed field by field.

    PYTHONPATH=<tree> KVGATE_TRACE_DIR=/work/shared/traces .venv/bin/python \\
        docs/results/2026-12-06c/workload_build.py [REPLICAS REQUESTS]

With REPLICAS and REQUESTS: only the simulator's shared-prefix workload at that fleet size
(rate 1.017 req/s per replica, seed 0). Run it on two trees to compare: the digests must be
equal, the seconds are the build's wall time."""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable

from loadtest.simulate import scaled_workload
from loadtest.workloads import WORKLOADS, TextSource, Workload, build


def digest(w: Workload) -> str:
    h = hashlib.sha256()
    for it in w.items:
        fields = (it.t, it.api, it.prompt, it.messages, it.tenant, it.session, it.max_tokens)
        h.update(repr((*fields, it.group, it.sensitive)).encode())
    return h.hexdigest()[:16]


def timed(make: Callable[[], Workload]) -> tuple[Workload, float]:
    t0 = time.perf_counter()
    w = make()
    return w, time.perf_counter() - t0


def main() -> None:
    if len(sys.argv) == 3:
        n, requests = int(sys.argv[1]), int(sys.argv[2])
        w, dt = timed(
            lambda: scaled_workload("shared-prefix", requests, n, 1.017 * n, 0, TextSource())
        )
        print(f"shared-prefix {n} replicas {len(w.items)} requests {digest(w)} {dt:.2f} s")
        return
    total = hashlib.sha256()
    text = TextSource()
    for name in sorted(WORKLOADS):
        w, dt = timed(lambda name=name: build(name, text))
        total.update(digest(w).encode())
        print(f"{name:22s} {len(w.items):6d} {digest(w)} {dt:.2f} s")
    for name in ("shared-prefix", "hot-prefix", "short-unique", "tenant-mix", "rag"):
        w, dt = timed(lambda name=name: scaled_workload(name, 20000, 64, 65.1, 1, TextSource()))
        total.update(digest(w).encode())
        print(f"scaled {name:15s} {len(w.items):6d} {digest(w)} {dt:.2f} s")
    print("TOTAL", total.hexdigest()[:16])


if __name__ == "__main__":
    main()
