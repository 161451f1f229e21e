"""``kvgate tokenizer``: export the built-in tokenizer so HF-based peers can load it."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cachecore.tokenizer import builtin_tokenizer, export_builtin


def _export_dir(text: str) -> Path:
    # refused in argparse's one line, not as a traceback from mkdir or a copy
    path = Path(text)
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not a directory")
    if not os.access(probe, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not writable")
    return path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--export", type=_export_dir, metavar="DIR", help="write tokenizer.json etc."
    )
    parser.add_argument("--encode", metavar="TEXT", help="print the token ids of TEXT")


def run(args: argparse.Namespace) -> int:
    if args.export is None and args.encode is None:
        print("nothing to do: pass --export DIR or --encode TEXT")
        return 2
    if args.export is not None:
        for path in export_builtin(args.export):
            print(path)
    if args.encode is not None:
        print(builtin_tokenizer().encode(args.encode))
    return 0
