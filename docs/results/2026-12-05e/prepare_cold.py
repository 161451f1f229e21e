"""`Gateway.prepare` in-process on 2,048-token token-id completions (one bare replica, the
embedded memory index), per stage on the thread CPU clock: warm, and with a 24 MiB buffer
written between calls so the caches start cold, as on a 2-core VM where the replica and the
client run between the gateway's requests. Two rounds of each.

    PYTHONPATH=. .venv/bin/python docs/results/2026-12-05e/prepare_cold.py 500
"""

import asyncio
import random
import sys
import time

from cachecore.testing import free_port
from gateway.serve import build_gateway
from gateway.settings import GatewaySettings
from loadtest.bench_gateway import MODEL, SALT_SECRET, VOCAB, _start_bare_replica, _wait_health

N = int(sys.argv[1]) if len(sys.argv) > 1 else 500
THRASH = bytearray(24 * 1024 * 1024)


def thrash() -> None:
    THRASH[::64] = bytes(len(THRASH) // 64)  # one write per cache line


async def main() -> None:
    rport = free_port()
    replica = _start_bare_replica(rport)
    try:
        _wait_health(f"http://127.0.0.1:{rport}/health", replica)
        settings = GatewaySettings(
            replicas=[f"r0=http://127.0.0.1:{rport}"], open_access=True,
            salt_secrets=[SALT_SECRET], port=free_port(), seed=1,  # type: ignore[list-item]
        )  # fmt: skip
        gw = build_gateway(settings)
        await gw.start()
        await asyncio.sleep(1.0)
        rng = random.Random(1)
        for mode in ("warm", "cold", "warm", "cold"):
            gw.stages.reset()
            total = 0
            for _ in range(N):
                body = {"model": MODEL, "prompt": [rng.randrange(1, VOCAB) for _ in range(2048)]}
                body["max_tokens"] = 1
                if mode == "cold":
                    thrash()
                t0 = time.thread_time_ns()
                await gw.prepare("completion", "anonymous", body, {}, "bench", True)
                total += time.thread_time_ns() - t0
            stages = " ".join(
                f"{s} {v['cpu_us_mean']:.1f}" for s, v in gw.stages.snapshot().items() if v["count"]
            )
            print(f"{mode}: prepare {total / N / 1e3:.1f} us; {stages}")
        await gw.stop()
    finally:
        replica.terminate()
        replica.wait(10)


asyncio.run(main())
