"""``kvgate tokenizer``: export the built-in tokenizer so HF-based peers can load it."""

from __future__ import annotations

import argparse
import sys

from cachecore.argtypes import writable_dir
from cachecore.tokenizer import builtin_tokenizer, export_builtin


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(  # refused in one line up front, not a traceback from mkdir
        "--export", type=writable_dir, metavar="DIR", help="write tokenizer.json etc."
    )
    parser.add_argument("--encode", metavar="TEXT", help="print the token ids of TEXT")


def run(args: argparse.Namespace) -> int:
    if args.export is None and args.encode is None:
        # a usage error, as argparse reports one: stderr, exit 2 (stdout is for the output)
        print(
            "kvgate tokenizer: error: nothing to do: pass --export DIR or --encode TEXT",
            file=sys.stderr,
        )
        return 2
    if args.export is not None:
        try:
            written = export_builtin(args.export)
        # the up-front check passes what only the write can refuse: root under /proc, a
        # read-only mount, a directory where a file goes; this was a traceback, exit 1
        except OSError as exc:
            print(
                f"kvgate tokenizer: error: cannot write --export {args.export}: "
                f"{exc.strerror or exc}",
                file=sys.stderr,
            )
            return 2
        for path in written:
            print(path)
    if args.encode is not None:
        print(builtin_tokenizer().encode(args.encode))
    return 0
