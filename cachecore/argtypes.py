"""argparse ``type=`` checks for numbers and output paths, shared by every ``kvgate``
subcommand (the gateway's and the library's own: ``kvgate replica``, ``kvgate agent`` and
``kvgate bench tiers`` live in :mod:`cachecore`, which never imports :mod:`gateway`). They
raise ArgumentTypeError so argparse prints its one-line usage error (exit 2) before a
command starts anything."""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only its type: argtypes stays cheap to import for every subcommand
    from pydantic import ValidationError
    from pydantic_core import ErrorDetails
    from pydantic_settings import BaseSettings

from cachecore.logs import LogLevelError, check_log_level


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


def float_between(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (each end excluded when ``*_open``): a share, a
    fraction of a CPU."""
    span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        if not (above and below):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {text}")
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


def _check_creatable(text: str, path: Path) -> None:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not a directory")
    if not os.access(probe, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: {probe} is not writable")


def writable_file(text: str) -> Path:
    """An output file that can be written (checked up front: a failed write at the end
    loses the whole run): not a directory, writable if it exists, else its nearest existing
    ancestor is a writable directory (the writer creates the missing ones)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text}: not writable")
        return path
    _check_creatable(text, path.parent)
    return path


def writable_dir(text: str) -> Path:
    """An output directory that is writable, or can be created."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    _check_creatable(text, path)
    return path


def log_level(text: str) -> str:
    """A logging level name (any case); logging itself raised ValueError at start-up."""
    try:
        return check_log_level(text)
    except LogLevelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# KVGATE_* variables that are no setting of the command checking them but pass: the load
# tools' KVGATE_TRACE_DIR, and the gateway's KVGATE_REPLICA_ALLOWLIST, under kvgate
# replica's prefix in a shared environment (cachecore cannot import gateway's settings:
# tests/test_h26_agent_env.py holds this to them)
OTHER_KVGATE_VARIABLES = frozenset({"KVGATE_TRACE_DIR", "KVGATE_REPLICA_ALLOWLIST"})
OTHER_KVGATE_PREFIXES = ("KVGATE_LOCUST_",)


def validation_message(err: ErrorDetails) -> str:
    """A pydantic error's message in its validator's own words: pydantic wraps a ValueError's
    text as "Value error, ..." (the one place every refusal strips it: settings, policies)."""
    return str(err["msg"]).removeprefix("Value error, ")


def settings_error(
    exc: ValidationError, env_prefix: str = "KVGATE_", flags: Mapping[str, str] | None = None
) -> str:
    """A settings refusal in one line (serve, agent, index), each field with its environment
    variable, and its flag where ``flags`` (field -> flag) has one. pydantic's own text spans
    lines and quotes the input, which may hold a Redis URL and its password."""
    parts = []
    for err in exc.errors():
        if not err["loc"]:  # a check across fields: its message names them
            parts.append(validation_message(err))
            continue
        field = ".".join(str(x) for x in err["loc"])
        top = str(err["loc"][0])  # a list's item (replicas.1) is set by the list's variable
        flag = (flags or {}).get(top)
        where = f"{flag}, " if flag else ""
        msg = validation_message(err)
        parts.append(f"{field} ({where}{env_prefix}{top.upper()}): {msg}")
    return "; ".join(parts)


def settings_variables(*classes: type[BaseSettings]) -> set[str]:
    """The environment variable of every field of ``classes`` (their prefix + the name)."""
    return {
        str(cls.model_config.get("env_prefix", "")).upper() + name.upper()
        for cls in classes
        for name in cls.model_fields
    }


def flag_settings(
    parser: argparse.ArgumentParser,
    settings: type[BaseSettings],
    renamed: Mapping[str, str] | None = None,
) -> dict[str, argparse.Action]:
    """field -> the option of ``parser`` that sets it: each option whose dest is a field of
    ``settings``, or whose dest ``renamed`` (dest -> field) maps to one."""
    fields = settings.model_fields
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        field = (renamed or {}).get(action.dest, action.dest)
        if action.option_strings and field in fields:
            out[field] = action
    return out


def long_option(action: argparse.Action) -> str:
    """The option's ``--name`` (its first option string when it has none)."""
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def name_variables(
    parser: argparse.ArgumentParser,
    settings: type[BaseSettings],
    renamed: Mapping[str, str] | None = None,
    negated: Collection[str] = (),
) -> dict[str, str]:
    """Have the help of every option that sets a field of ``settings``
    (:func:`flag_settings`) name the field's environment variable (the model's
    ``env_prefix`` + the field's name), unless it names it already: inside the help's
    closing parenthesis (``(default 16; env KVGATE_REPLICA_BLOCK_SIZE)``), else after it.
    A ``negated`` field's flag sets it false (``--plain-logs``: ``KVGATE_LOG_JSON=false``).
    Written by hand, ``kvgate serve --help`` named the variable of 9 of its 19 such flags,
    ``kvgate agent`` of 3 of 23, ``kvgate replica`` of none. Returns field -> the flag's
    ``--name``."""
    prefix = str(settings.model_config.get("env_prefix", "")).upper()
    found = flag_settings(parser, settings, renamed)
    for field, action in found.items():
        var = prefix + field.upper()
        text = action.help or ""
        if action.help == argparse.SUPPRESS or re.search(rf"\b{var}\b", text):
            continue
        said = f"env {var}=false" if field in negated else f"env {var}"
        if text.endswith(")"):
            action.help = f"{text[:-1]}; {said})"
        else:
            action.help = f"{text} ({said})" if text else said
    return {field: long_option(action) for field, action in found.items()}


def unknown_settings(
    environ: Mapping[str, str], known: Iterable[str], scope: str = "KVGATE_", reader: str = "kvgate"
) -> list[str]:
    """One warning per variable of ``environ`` under ``scope`` that is none of ``known``
    (nor a load tool's), with the nearest known name: pydantic-settings ignores them, so
    ``KVGATE_POLICY_FILE=strict.yaml`` served the default policy and
    ``KVGATE_REPLICA_BLOCKS=100`` ran replicas of 4,096 blocks, without a word. Every
    command that reads settings calls it, ``scope`` its own prefix (``kvgate agent``:
    ``KVGATE_AGENT_``), so another command's variables in a shared environment pass."""
    names = {*known, *OTHER_KVGATE_VARIABLES}
    out = []
    for name in sorted(environ):
        var = name.upper()  # pydantic-settings reads the names case-insensitively
        if not var.startswith(scope) or var in names or var.startswith(OTHER_KVGATE_PREFIXES):
            continue
        near = difflib.get_close_matches(var, sorted(names), n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        out.append(f"{name} is no {reader} setting: ignored{hint}")
    return out
