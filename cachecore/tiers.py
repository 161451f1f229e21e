"""KV tiers and the bandwidth/recompute break-even.

Loading ``n`` cached tokens from a tier beats recomputing them when::

    n * bytes_per_token / bandwidth + t_fixed  <  n * t_prefill_per_token

so a tier pays off for every prefix when its bandwidth exceeds the *break-even bandwidth*
``bytes_per_token / t_prefill_per_token``, and, given that, only for prefixes longer than
``n* = t_fixed / (t_prefill_per_token - bytes_per_token / bandwidth)`` (the fixed lookup cost
dominates short prefixes).

``kvgate bench tiers`` measures, with torch on this machine's CPU (every tensor is a host
tensor, on a GPU node too), the dense matmul throughput that stands in for prefill time and
the copy bandwidths of the tiers it can reach (a host-memory copy; a Redis on loopback
standing in for a remote tier), then prints the break-even table for Llama-3-8B and -70B
shapes both for this machine and for a datasheet H100 (50% of ~1000 TFLOP/s bf16; PCIe 5
x16; 100 Gb/s network: datasheet figures, not measured); with ``--plot FILE`` it also writes
the break-even plot there (no file otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cachecore.argtypes import writable_file


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    params: float  # parameters
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def prefill_flops_per_token(self, context_tokens: int) -> float:
        """~2 x params for the dense part plus the attention score/value term, which grows
        with the context the token attends to (4 x layers x hidden x context)."""
        return 2.0 * self.params + 4.0 * self.layers * self.hidden * context_tokens


LLAMA3_8B = ModelShape("llama-3-8b", 8.03e9, 32, 8, 128, 4096)
LLAMA3_70B = ModelShape("llama-3-70b", 70.6e9, 80, 8, 128, 8192)


@dataclass(frozen=True, slots=True)
class TierLink:
    name: str
    bandwidth_bytes_s: float
    fixed_s: float  # per-lookup fixed latency (metadata round trip, setup)
    measured: bool


def break_even_bandwidth(shape: ModelShape, t_prefill_per_token_s: float) -> float:
    return shape.kv_bytes_per_token / t_prefill_per_token_s


def min_tokens_worth_loading(
    shape: ModelShape, link: TierLink, t_prefill_per_token_s: float
) -> float:
    """Smallest prefix for which loading beats recomputing (inf if never)."""
    per_token_gain = t_prefill_per_token_s - shape.kv_bytes_per_token / link.bandwidth_bytes_s
    if per_token_gain <= 0:
        return math.inf
    return link.fixed_s / per_token_gain


def load_ms_per_token(shape: ModelShape, link: TierLink) -> float:
    """Per-token load cost of a tier in ms: what the routing cost model charges for a
    prefix held on that tier instead of GPU memory."""
    return shape.kv_bytes_per_token / link.bandwidth_bytes_s * 1e3


# ------------------------------------------------------------------------- measurement


def _timeit(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure_matmul_flops(n: int = 1024, repeat: int = 5, dtype: str = "float32") -> float:
    """Dense GEMM throughput (FLOP/s) of this machine's CPU with torch, the quantity that
    sets prefill time per token (prefill is GEMM-bound). CPU tensors only: a GPU's is the
    datasheet row, not measured here."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, dtype=dt)
    b = torch.randn(n, n, dtype=dt)
    seconds = _timeit(lambda: torch.mm(a, b), repeat)
    return 2.0 * n**3 / seconds


def measure_copy_link(nbytes: int = 64 * 1024 * 1024, repeat: int = 5) -> TierLink:
    """Host-memory (CPU to CPU) copy bandwidth for a KV-sized tensor, and the fixed cost of
    a one-block copy: the host tier's link as a CPU-only engine sees it. Not the PCIe
    host-to-device copy a GPU engine loads a host tier through (a host memcpy, on any
    machine): that link is the datasheet row's."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = _timeit(lambda: dst.copy_(src), repeat)
    small_src = torch.empty(4096, dtype=torch.uint8)
    small_dst = torch.empty_like(small_src)
    fixed = _timeit(lambda: small_dst.copy_(small_src), 200)
    return TierLink("host memory copy", nbytes / seconds, fixed, True)


def measure_redis_link(url: str, chunk_bytes: int = 2 * 1024 * 1024, chunks: int = 16) -> TierLink:
    """A remote tier through Redis on loopback (LMCache supports redis:// backends):
    GET of ``chunks`` KV chunks, pipelined, plus one small GET for the fixed latency."""
    import redis

    # bounded: an address that drops packets fails in seconds instead of hanging the bench
    client = redis.Redis.from_url(url, socket_connect_timeout=5.0, socket_timeout=60.0)
    try:
        client.ping()  # unreachable: raise before the cleanup below would try again
    except BaseException:
        client.close()
        raise
    payload = b"\x01" * chunk_bytes
    keys = [f"kvgate:tierbench:{i}" for i in range(chunks)]
    try:
        client.mset(dict.fromkeys(keys, payload))

        def fetch() -> None:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            pipe.execute()

        seconds = _timeit(fetch, 3)
        client.set("kvgate:tierbench:small", b"x")
        fixed = _timeit(lambda: client.get("kvgate:tierbench:small"), 50)
        return TierLink("remote (redis, loopback)", chunk_bytes * chunks / seconds, fixed, True)
    finally:
        # best effort: a cleanup error must not replace the error that got us here
        with contextlib.suppress(redis.RedisError):
            client.delete(*keys, "kvgate:tierbench:small")
        client.close()


# ---------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class Platform:
    name: str
    flops: float  # achieved dense FLOP/s
    links: Sequence[TierLink]


DATASHEET_H100 = Platform(
    "H100 datasheet (50% of ~1000 TFLOP/s bf16)",
    0.5 * 1000e12,
    (
        TierLink("host DRAM over PCIe 5 x16", 50e9, 50e-6, False),
        TierLink("local NVMe", 6e9, 200e-6, False),
        TierLink("remote over 100 Gb/s", 12.5e9, 1e-3, False),
        TierLink("remote over 10 Gb/s", 1.25e9, 1e-3, False),
    ),
)


def _gbps(v: float) -> str:
    return f"{v / 1e9:.3g}"


def report_rows(platform: Platform, shapes: Sequence[ModelShape], context: int) -> list[str]:
    rows = []
    for shape in shapes:
        t_tok = shape.prefill_flops_per_token(context) / platform.flops
        be = break_even_bandwidth(shape, t_tok)
        for link in platform.links:
            n_star = min_tokens_worth_loading(shape, link, t_tok)
            verdict = (
                "never" if math.isinf(n_star) else f"prefixes >= {max(1, math.ceil(n_star))} tok"
            )
            rows.append(
                f"| {platform.name} | {shape.name} | {t_tok * 1e6:.4g} | {_gbps(be)} | "
                f"{link.name}{'' if link.measured else ' (datasheet)'} | "
                f"{_gbps(link.bandwidth_bytes_s)} | {link.fixed_s * 1e6:.0f} | "
                f"{load_ms_per_token(shape, link) * 1e3:.2f} | {verdict} |"
            )
    return rows


HEADER = (
    "| platform | model | prefill us/token | break-even GB/s | tier link | link GB/s | "
    "fixed us | load us/token | loading wins for |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def plot_break_even(
    platforms: Sequence[Platform], shape: ModelShape, context: int, out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(platforms), figsize=(6 * len(platforms), 4.2))
    if len(platforms) == 1:
        axes = [axes]
    ns = [2**i for i in range(4, 18)]
    for ax, platform in zip(axes, platforms, strict=True):
        t_tok = shape.prefill_flops_per_token(context) / platform.flops
        ax.plot(ns, [n * t_tok * 1e3 for n in ns], "k-", lw=2, label="recompute")
        for link in platform.links:
            t = [
                (n * shape.kv_bytes_per_token / link.bandwidth_bytes_s + link.fixed_s) * 1e3
                for n in ns
            ]
            ax.plot(ns, t, "--", label=f"load: {link.name}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prefix tokens")
        ax.set_ylabel("ms")
        ax.set_title(f"{shape.name} on {platform.name}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=4096, help="context for attention FLOPs")
    parser.add_argument(
        "--redis",
        default=None,
        help="redis URL for the remote-tier link (default: start a private redis-server)",
    )
    # checked up front: a write that fails after the measurements loses them
    parser.add_argument(
        "--plot", type=writable_file, default=None, help="write the break-even plot here"
    )
    parser.add_argument("--gemm", type=int, default=1024, help="GEMM size for FLOP/s")


def _fail(what: str) -> int:
    print(f"kvgate bench tiers: {what}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from redis import RedisError

    from cachecore.testing import RedisServer

    if args.gemm <= 0:
        return _fail(f"--gemm must be > 0 (the GEMM matrix size), got {args.gemm}")
    if args.context < 0:
        return _fail(f"--context must be >= 0 tokens, got {args.context}")
    # the remote tier first: an unreachable --redis fails before the slower measurements
    server: RedisServer | None = None
    url = args.redis
    try:
        if url is None:
            try:
                server = RedisServer().start()
            except (RuntimeError, TimeoutError, OSError) as exc:
                return _fail(f"cannot start a private redis-server ({exc}); pass --redis URL")
            url = server.url
        remote = measure_redis_link(url)
    except (RedisError, ValueError) as exc:  # ValueError: a URL redis-py refuses
        return _fail(f"--redis: {exc}")  # not the URL itself: it may hold a password
    finally:
        if server is not None:
            server.close()
    try:
        flops = measure_matmul_flops(args.gemm)
    except (RuntimeError, MemoryError) as exc:  # torch's allocation failure (CPU or CUDA)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return _fail(f"--gemm {args.gemm}: cannot run the GEMM ({reason}); pick a smaller one")
    host = measure_copy_link()
    here = Platform(
        f"this machine (torch fp32 GEMM {flops / 1e9:.0f} GFLOP/s)",
        flops,
        (host, remote),
    )
    print(
        f"measured: GEMM {flops / 1e9:.1f} GFLOP/s, "
        f"host copy {_gbps(host.bandwidth_bytes_s)} GB/s, "
        f"redis loopback {_gbps(remote.bandwidth_bytes_s)} GB/s "
        f"(fixed {remote.fixed_s * 1e6:.0f} us)"
    )
    print(
        f"KV bytes/token: 8B {LLAMA3_8B.kv_bytes_per_token:,}, "
        f"70B {LLAMA3_70B.kv_bytes_per_token:,}; attention context {args.context}"
    )
    print()
    print(HEADER)
    for platform in (here, DATASHEET_H100):
        for row in report_rows(platform, (LLAMA3_8B, LLAMA3_70B), args.context):
            print(row)
    if args.plot is not None:  # no file unless asked for (it used to land in the cwd)
        plot_break_even((here, DATASHEET_H100), LLAMA3_8B, args.context, args.plot)
        print(f"\nplot: {args.plot}")
    return 0
