"""The single kvgate entry point.

Each subcommand lives in its own module exposing ``configure(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs, so
``kvgate --help`` stays fast and a broken optional dependency cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TypeVar

# re-exported: the subcommands import their checks from here
from cachecore.argtypes import nonnegative_float as nonnegative_float
from cachecore.argtypes import nonnegative_int as nonnegative_int
from cachecore.argtypes import positive_float as positive_float
from cachecore.argtypes import positive_int as positive_int
from cachecore.argtypes import tcp_port as tcp_port
from cachecore.argtypes import writable_dir as writable_dir
from cachecore.argtypes import writable_file as writable_file
from cachecore.logs import LogLevelError

T = TypeVar("T")

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "run the OpenAI-compatible routing gateway"),
    "replica": ("cachecore.replica.cli", "serve N simulated vLLM-compatible engine replicas"),
    "agent": ("cachecore.agent.cli", "run a per-replica cache agent (engine events -> index)"),
    "demo": ("loadtest.demo", "fleet + agents + gateway on embedded defaults, with a comparison"),
    "bench": ("loadtest.bench", "benchmarks: index, ingest, gateway, routers, keys, tiers, soak"),
    "simulate": ("loadtest.simulate", "fleet simulation in virtual time (same engine + routing)"),
    "attack": ("loadtest.attack", "isolation attack suite; non-zero exit if an attack succeeds"),
    "trace": ("cachecore.traceanalysis", "analyse a trace: occupancy, duplication, lifetimes"),
    "tokenizer": ("cachecore.tokenizer_cli", "export the built-in tokenizer as an HF model dir"),
    "index": ("gateway.index_cli", "the Redis index per replica: stats, sweep, forget departed"),
    "policy": ("policies.cli", "validate policy files offline: kvgate policy check FILE..."),
}

# servers that drain gracefully on SIGTERM by their own handlers (and exit by the signal)
SERVERS = frozenset({"serve", "agent", "replica"})


class CommandError(Exception):
    """Bad input a command finds only after parsing (a malformed trace file, ...):
    :func:`main` prints it as ``kvgate <cmd>: <message>`` and exits 2, as argparse does."""


# ---------------------------------------------------------------- argparse ``type=`` checks
# They raise ArgumentTypeError so argparse prints its one-line usage error (exit 2) before a
# command starts anything; the numeric ones are cachecore.argtypes' (imported above, and
# re-exported), shared with the subcommands that live in cachecore.


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A ``type=`` for ``a,b,c``: each part checked by ``item``, duplicates dropped (first
    kept: a value given twice would be run and reported twice), at least one."""

    def parse(text: str) -> list[T]:
        out: list[T] = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            value = item(part)
            if value not in out:
                out.append(value)
        if not out:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        return out

    return parse


def one_of(*names: str, what: str = "") -> Callable[[str], str]:
    """A ``type=`` for one of ``names`` (``what`` names the kind in the error)."""
    kind = f"{what} " if what else ""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"unknown {kind}{text!r}; known: {', '.join(names)}")
        return text

    return parse


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:  # no command is a usage error (it exited 0, so `kvgate $CMD` "succeeded")
        build_parser().print_help(sys.stderr)
        return 2
    if args[0] in ("-h", "--help") or args[0] not in SUBCOMMANDS:
        build_parser().parse_args(args)
        return 2
    name, rest = args[0], args[1:]
    module_name, help_text = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvgate {name}", description=help_text)
    module.configure(parser)
    parsed = parser.parse_args(rest)
    if name not in SERVERS:
        # SIGTERM stops a command like Ctrl-C, so its cleanup runs: the benchmarks, the soak
        # and the demo start replicas, gateways and redis-servers that would outlive it
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = module.run(parsed)
    except KeyboardInterrupt:  # its cleanup has run; no traceback for a stop request
        print(f"kvgate {name}: interrupted", file=sys.stderr)
        return 130
    except CommandError as exc:
        print(f"kvgate {name}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except LogLevelError as exc:  # a settings value argparse never saw (KVGATE_LOG_LEVEL)
        print(f"kvgate {name}: {exc} (--log-level or KVGATE_LOG_LEVEL)", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from cachecore.testing import MissingProgram  # imported late: it loads redis

        if not isinstance(exc, MissingProgram):
            raise
        print(f"kvgate {name}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # stdout's reader left (`kvgate ... | head`): stop quietly, as a Unix tool does;
        # stdout goes to devnull so the interpreter's final flush cannot raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    return int(code or 0)


if __name__ == "__main__":
    # ``python -m gateway.cli`` (how fleets start replicas): run the importable module's main,
    # so the CommandError the subcommands raise is the class it catches, not __main__'s copy
    from gateway.cli import main as _main

    sys.exit(_main())
