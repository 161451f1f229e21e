"""``kvgate bench <what>``: every benchmark behind one command.

Each benchmark is a module with ``configure(parser)`` and ``run(args) -> int`` (or
``configure_<name>`` / ``run_<name>`` when one module holds several) that prints a markdown
table and writes plots where it has them. Results and the exact commands are recorded in
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType
from typing import Any

BENCHMARKS: dict[str, tuple[str, str]] = {
    "keys": ("loadtest.bench_index", "block-key computation cost for 8k/32k-token prompts"),
    "index": ("loadtest.bench_index", "index lookup latency, write throughput, Redis memory"),
    "ingest": ("loadtest.bench_ingest", "agent event ingest rate and event-to-index latency"),
    "gateway": ("loadtest.bench_gateway", "gateway CPU per request by stage and added TTFT"),
    "routers": ("loadtest.bench_routers", "kvgate strategies vs peer routers on one fleet"),
    "tiers": ("cachecore.tiers", "bandwidth/recompute break-even across GPU, host, remote"),
    "soak": ("loadtest.soak", "minutes of mixed traffic and client faults, checked for drift"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    lines = [f"  {name:<8} {text}" for name, (_, text) in BENCHMARKS.items()]
    parser.epilog = "benchmarks:\n" + "\n".join(lines)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("bench", choices=sorted(BENCHMARKS), metavar="BENCHMARK")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's options")


def _hook(module: ModuleType, prefix: str, name: str) -> Any:
    return getattr(module, f"{prefix}_{name}", None) or getattr(module, prefix)


def run(args: argparse.Namespace) -> int:
    name = args.bench
    module_name, help_text = BENCHMARKS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvgate bench {name}", description=help_text)
    _hook(module, "configure", name)(parser)
    return int(_hook(module, "run", name)(parser.parse_args(args.bench_args)) or 0)
