"""The gateway's memory and CPU for one large non-streamed answer, two source trees side by side.

For each tree (a ``git archive`` export of a commit) and each answer size, a fresh process
runs that tree's gateway (``gateway.serve.build_gateway`` + ``serve_in_loop``, one replica,
open access) in front of a loopback engine (a subprocess of this script, ``--engine``) that
answers every POST with a prebuilt embeddings answer of the given size in vLLM's float
encoding (4,096-dimension vectors, usage last, as vLLM 0.33's ``EmbeddingResponse``). curl
(a subprocess) sends three ``POST /v1/embeddings``: two warm-ups, then the measured one.
Measured over that one: the process's peak RSS growth (``VmHWM`` reset through
``/proc/self/clear_refs`` before it, minus ``VmRSS`` then), the process's CPU time (the
gateway, not the engine or curl), and with ``--trace`` the peak of Python's traced
allocations (tracemalloc; its per-object records inflate RSS: take RSS without it). The
runs alternate A B B A per size, so a drift of the host falls on both trees.

    git archive c033d89 | (mkdir -p /tmp/am/a && tar -x -C /tmp/am/a)
    git archive HEAD | (mkdir -p /tmp/am/b && tar -x -C /tmp/am/b)
    flock /tmp/kvgate-bench.lock .venv/bin/python docs/results/2026-12-08/answer_memory.py \
        /tmp/am/a /tmp/am/b --sizes 1,16,100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

_HEAD = b'{"id":"embd-1","object":"list","created":1,"model":"m","data":['
_TAIL = (
    b'],"usage":{"prompt_tokens":8,"total_tokens":8,"completion_tokens":0,'
    b'"prompt_tokens_details":null}}'
)
_MODELS = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'


def embeddings_answer(size: int) -> bytes:
    """An embeddings answer of about ``size`` bytes: whole 4,096-float vectors."""
    vector = b",".join([b"-0.012345678901234567"] * 4096)
    items: list[bytes] = []
    n = len(_HEAD) + len(_TAIL)
    while True:
        item = b'{"index":%d,"object":"embedding","embedding":[%s]}' % (len(items), vector)
        if items and n + len(item) + 1 > size:
            break
        items.append(item)
        n += len(item) + 1
    return _HEAD + b",".join(items) + _TAIL


async def engine(port: int, size: int) -> None:
    """Answer every POST with the answer, every GET (the gateway's model probe) with a model
    list; print ``ready <bytes>`` once listening."""
    body = embeddings_answer(size)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: one request after another on the connection
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                out = body if head.startswith(b"POST") else _MODELS
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % len(out)
                )
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    print("ready", len(body), flush=True)
    await server.serve_forever()


def _memory_mib() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _reset_peak() -> float:
    """Reset the peak RSS (``VmHWM``) to the current; the current RSS in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _memory_mib()[0]


async def measure(eport: int, size: int, trace: bool) -> str:
    """One measurement, in this process (started with the tree first on sys.path), of the
    engine on ``eport`` answering ``size`` bytes."""
    import tracemalloc

    from pydantic import SecretStr

    from cachecore.testing import free_port
    from gateway.serve import build_gateway, serve_in_loop
    from gateway.settings import GatewaySettings
    from tests.test_gateway_support import SECRET

    settings = GatewaySettings(
        replicas=[f"http://127.0.0.1:{eport}"], port=free_port(), open_access=True,
        salt_secrets=[SecretStr(SECRET)], read_timeout_s=60.0, response_timeout_s=60.0,
    )  # fmt: skip
    async with serve_in_loop(build_gateway(settings)) as url:
        cmd = [
            "curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{size_download}",
            "-H", "content-type: application/json",
            "-d", '{"model":"m","input":"hello there"}', url + "/v1/embeddings",
        ]  # fmt: skip
        r0, t0, out = 0.0, 0.0, b""
        for i in range(3):  # two warm-ups (connections, caches), then the measured one
            if i == 2:
                r0, t0 = _reset_peak(), time.process_time()
                if trace:
                    tracemalloc.start()
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE)
            out, _ = await proc.communicate()
        cpu_ms = (time.process_time() - t0) * 1000
        traced = tracemalloc.get_traced_memory()[1] if trace else 0
        tracemalloc.stop()
        growth = _memory_mib()[1] - r0
    status, received = out.decode().split()
    assert status == "200" and int(received) == size, out
    row = f"{size / 2**20:.1f} | {growth:.0f} | {growth * 2**20 / size:.2f} | {cpu_ms:.0f}"
    if trace:
        row += f" | {traced / 2**20:.0f} ({traced / size:.2f}x)"
    return row


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--engine":
        asyncio.run(engine(int(sys.argv[2]), int(sys.argv[3])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        tree, mib, trace = sys.argv[2], float(sys.argv[3]), sys.argv[4] == "trace"
        sys.path.insert(0, tree)
        from cachecore.testing import free_port

        eport = free_port()
        eng = subprocess.Popen(
            [sys.executable, __file__, "--engine", str(eport), str(int(mib * 2**20))],
            stdout=subprocess.PIPE,
        )
        try:
            assert eng.stdout is not None
            line = eng.stdout.readline()
            assert line.startswith(b"ready"), line
            print(asyncio.run(measure(eport, int(line.split()[1]), trace)))
        finally:
            eng.kill()
            eng.wait()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, help="two exported source trees: A (before), B (after)")
    ap.add_argument("--sizes", default="1,16,100", help="answer sizes in MiB")
    ap.add_argument("--trace", action="store_true", help="also tracemalloc's peak")
    args = ap.parse_args()
    header = "| tree | answer MiB | peak RSS growth MiB | x answer | gateway CPU ms |"
    print(header + (" traced peak MiB |" if args.trace else ""))
    print("|---" * (6 if args.trace else 5) + "|")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    for mib in (float(s) for s in args.sizes.split(",")):
        a, b = ("A", args.trees[0]), ("B", args.trees[1])
        for label, tree in (a, b, b, a):
            argv = [sys.executable, __file__, "--one", tree, str(mib)]
            argv.append("trace" if args.trace else "rss")
            row = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            print(f"| {label} | {row.stdout.strip()} |", flush=True)


if __name__ == "__main__":
    main()
