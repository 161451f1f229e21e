"""``kvgate attack``: the isolation attack suite against real replicas, agents and gateways.

Six attacks (docs/security.md), each with its defence on and, where the attack is a
statistical probe, a positive control that must fire (otherwise the row reads NO POWER):

1. timing probe (KS on TTFT; N from a power calculation), plus the gateway's own path;
2. routing probe (Fisher's exact test on where B's probes of A's prefixes land);
3. poisoning (Redis ACL against a rogue agent; false claims -> quarantine, also under a
   raised removal-log floor; stale replays);
4. salt spoofing (a client ``cache_salt``, even the victim's real one, has no effect);
5. malformed-event flood (the agent survives, drops are counted, the index stays exact);
6. cache flooding by one tenant (the other tenants' hit rate within a stated bound).

Exit status: 0 when every row holds, 1 when any attack succeeded (BROKEN), 3 when none did
but some probe had no power (2 is a usage error, as for every command).
``--unsafe-shared-scope`` runs attacks 1, 2 and 4 against a deliberately misconfigured
gateway (scoping off) to show the suite catches a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from cachecore.argtypes import log_level
from cachecore.logs import configure_logging
from gateway.cli import writable_file
from loadtest.attacks.common import AttackResult, Outcome, format_table
from loadtest.attacks.flooding import FloodConfig, run_flooding
from loadtest.attacks.node import NodeConfig, run_node
from loadtest.attacks.routing import RoutingConfig, run_routing
from loadtest.attacks.spoofing import SpoofConfig, run_spoofing
from loadtest.attacks.timing import TimingConfig, run_timing

log = logging.getLogger(__name__)

ATTACKS = {
    1: "timing probe",
    2: "routing probe",
    3: "poisoning (ACL, false claims, rogue floor, stale replay)",
    4: "salt spoofing",
    5: "malformed-event flood",
    6: "cache flooding by one tenant",
}


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes of one run. ``quick`` is what the test suite and ``--quick`` use (under 45 s:
    37 s measured on this 2-core VM in a fast phase);
    the full run raises the power target and sample caps, uses more replicas and prompts,
    and measures each flooding defence on its own as well as combined."""

    timing: TimingConfig
    routing: RoutingConfig
    node: NodeConfig
    spoof: SpoofConfig
    flood: FloodConfig

    @classmethod
    def quick(cls, seed: int = 0, unsafe_shared_scope: bool = False) -> SuiteConfig:
        return cls(
            TimingConfig(seed=seed, unsafe_shared_scope=unsafe_shared_scope),
            RoutingConfig(seed=seed, unsafe_shared_scope=unsafe_shared_scope),
            NodeConfig(),
            SpoofConfig(seed=seed, unsafe_shared_scope=unsafe_shared_scope),
            FloodConfig(seed=seed),
        )

    @classmethod
    def full(cls, seed: int = 0, unsafe_shared_scope: bool = False) -> SuiteConfig:
        q = cls.quick(seed, unsafe_shared_scope)
        return cls(
            replace(q.timing, power=0.999, n_max=120, pilot=32, gateway_path_n=60),
            replace(q.routing, replicas=8, power=0.999, n_max=120),
            replace(
                q.node,
                flood_rounds=100,
                flood_requests=64,
                floor_rogues=("raised", "tracking", "future"),
            ),
            replace(q.spoof, prompts=32),
            replace(q.flood, duration_s=6.0, defences=("budget", "confine", "budget+confine")),
        )


async def run_suite(cfg: SuiteConfig, only: set[int]) -> list[AttackResult]:
    """Run the selected attacks one after another (each starts and stops its own fleet,
    agents and gateway, so none sees another's state)."""

    async def timing() -> list[AttackResult]:
        return (await run_timing(cfg.timing))[0]

    async def routing() -> list[AttackResult]:
        return (await run_routing(cfg.routing))[0]

    async def spoof() -> list[AttackResult]:
        return (await run_spoofing(cfg.spoof))[0]

    async def flood() -> list[AttackResult]:
        return (await run_flooding(cfg.flood))[0]

    async def node(which: set[int]) -> list[AttackResult]:
        rows = await run_node(cfg.node)
        return [r for r in rows if int(r.attack.split()[0]) in which]

    plan: list[tuple[set[int], Callable[[], Awaitable[list[AttackResult]]]]] = [
        ({1}, timing),
        ({2}, routing),
        ({4}, spoof),
        ({3, 5}, lambda: node(only & {3, 5})),
        ({6}, flood),
    ]
    rows: list[AttackResult] = []
    for ids, fn in plan:
        if not ids & only:
            continue
        t0 = time.perf_counter()
        got = await fn()
        log.info(
            "attack done",
            extra={"attacks": sorted(ids & only), "wall_s": round(time.perf_counter() - t0, 2)},
        )
        rows.extend(got)
    return sorted(rows, key=lambda r: int(r.attack.split()[0]))


def exit_code(rows: list[AttackResult]) -> int:
    if any(r.outcome is Outcome.BROKEN for r in rows):
        return 1
    if any(r.outcome is Outcome.NO_POWER for r in rows):
        return 3  # not 2: argparse's usage error, which a CI job must tell apart
    return 0


def _only(text: str) -> set[int]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts:  # it read "unknown attack numbers []"
        raise argparse.ArgumentTypeError("no attack number given, e.g. 1,4 (known 1-6)")
    ids: set[int] = set()
    for part in parts:
        try:
            ids.add(int(part))
        except ValueError:  # it quoted Python's "invalid literal for int() with base 10"
            raise argparse.ArgumentTypeError(
                f"not an attack number: {part!r} (known 1-6)"
            ) from None
    bad = ids - set(ATTACKS)
    if bad:
        raise argparse.ArgumentTypeError(f"unknown attack numbers {sorted(bad)}; known 1-6")
    return ids


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "attacks:\n" + "\n".join(f"  {k}  {v}" for k, v in ATTACKS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes, the test suite's (under 45 s; 37 s on a 2-core VM)",
    )
    parser.add_argument("--only", type=_only, default=set(ATTACKS), help="e.g. 1,4 (default all)")
    parser.add_argument("--seed", type=int, default=0)
    # checked up front: a write that fails after the suite's run loses its rows
    parser.add_argument(
        "--json", type=writable_file, default=None, help="write the rows as JSON here"
    )
    parser.add_argument(
        "--unsafe-shared-scope",
        action="store_true",
        help="misconfigure the defended gateways (scoping off): attacks 1, 2, 4 must then "
        "report BROKEN (a self-test of the suite; never a deployment setting)",
    )
    parser.add_argument("--log-level", type=log_level, default="WARNING")


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, json_format=False)
    make = SuiteConfig.quick if args.quick else SuiteConfig.full
    cfg = make(args.seed, args.unsafe_shared_scope)
    t0 = time.perf_counter()
    rows = asyncio.run(run_suite(cfg, args.only))
    wall = time.perf_counter() - t0
    print(format_table(rows))
    code = exit_code(rows)
    verdict = {0: "every attack held", 1: "AN ATTACK SUCCEEDED", 3: "a probe had no power"}
    print(f"\n{len(rows)} rows in {wall:.1f} s: {verdict[code]}")
    for r in rows:
        if "plan" in r.details:
            print(f"timing power plan: {r.details['plan']}")
    if args.json is not None:
        payload = {
            "quick": args.quick,
            "seed": args.seed,
            "unsafe_shared_scope": args.unsafe_shared_scope,
            "wall_s": wall,
            "exit_code": code,
            "rows": [
                {
                    "attack": r.attack,
                    "trials": r.trials,
                    "outcome": r.outcome.value,
                    "figures": r.figures,
                    "details": r.details,
                }
                for r in rows
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    sys.stdout.flush()
    return code
