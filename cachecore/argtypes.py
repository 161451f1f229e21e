"""argparse ``type=`` checks for numbers, shared by every ``kvgate`` subcommand (the
gateway's and the library's own: ``kvgate replica`` and ``kvgate agent`` live in
:mod:`cachecore`, which never imports :mod:`gateway`). They raise ArgumentTypeError so
argparse prints its one-line usage error (exit 2) before a command starts anything."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def finite_float(strictly_positive: bool) -> Callable[[str], float]:
    bound = "> 0" if strictly_positive else ">= 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        ok = value > 0 if strictly_positive else value >= 0
        if not (ok and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)
positive_float = finite_float(strictly_positive=True)
nonnegative_float = finite_float(strictly_positive=False)


def tcp_port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (1-65535): {value}")
    return value
