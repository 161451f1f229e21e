"""``kvgate policy check FILE...``: validate policy files offline, by the rules the gateway
loads them with at start-up (the schema, each cross-field check, an hf pool's
``tokenizer_dir`` files; an empty file refused), so CI or a deploy can refuse a bad file
before any gateway reads it. What needs the engines (their block sizes, the tokenizers'
alignment) is checked only by a running gateway."""

from __future__ import annotations

import argparse
import sys

from policies.schema import PolicyError, load_policy


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser(
        "check",
        help="validate policy files as the gateway loads them: exit 2 if any is invalid",
        description="Validate policy files as kvgate serve loads them at start-up (a "
        "relative tokenizer_dir is taken from the working directory, as the gateway's).",
    )
    check.add_argument("files", nargs="+", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    """One line per file: ``FILE: valid (...)`` on stdout, or the refusal naming each
    failing field on stderr; exit 2 when any file is invalid."""
    invalid = 0
    for path in args.files:
        try:
            pol = load_policy(path, allow_empty=False)
        except PolicyError as exc:
            invalid += 1
            print(f"kvgate policy: {' '.join(str(exc).split())}", file=sys.stderr)
            continue
        print(
            f"{path}: valid (routing.strategy {pol.routing.strategy.value}, "
            f"{len(pol.tenants)} tenants, {len(pol.trust_groups)} trust groups, "
            f"{len(pol.models.pools)} model pools)"
        )
    return 2 if invalid else 0
