"""``kvgate demo`` (``make demo``): the whole system on the embedded defaults, in one command.

1. starts 4 simulated vLLM-compatible replicas (``kvgate replica``, a subprocess, 8B/H100
   profile) with their ZMQ KV-event streams;
2. starts the gateway (``kvgate serve``, a subprocess) on 127.0.0.1:8000 with the embedded
   in-memory index and one embedded cache agent per replica;
3. replays a built-in shared-prefix workload (eight assistants, each with a long
   system prompt) through ``round_robin`` and then ``expected_latency``, resetting the
   replicas' caches in between, and prints the comparison (engine-reported token hit rate,
   TTFT p50/p99, predicted-vs-actual cached tokens);
4. keeps serving until Ctrl-C and prints a curl and an ``openai`` SDK example that work as
   shown. With ``DEMO_SERVE=0`` it prints the comparison and exits (for automated checks).

Environment: ``DEMO_SERVE`` (1), ``DEMO_PORT`` (8000), ``DEMO_TIME_SCALE`` (1.0: the engine
model runs in real time), ``DEMO_SEED`` (0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from cachecore.engine.latency import get_profile
from cachecore.replica.fleet import FleetProcess, launch_fleet
from gateway.cli import positive_float, positive_int, tcp_port
from loadtest.harness import (
    MODEL,
    gateway,
    pending_settle_s,
    port_free,
    reset_caches,
    scaled_policy,
    set_strategy,
    write_api_keys,
)
from loadtest.replay import ReplayReport, format_table, replay
from loadtest.workloads import TextSource, Workload, build

DEMO_KEY = "kvgate-demo-key"
DEMO_TENANT = "demo"
REPLICAS = 4
PROFILE = "8b-h100"
SLOTS = get_profile(PROFILE).max_num_seqs  # the policy declares the replicas' sequence slots
# the printed examples' prompt: longer than a few KV blocks, so that after the chat example the
# explain example shows its cached prefix; no quote characters (it sits in shell and JSON quotes)
EXAMPLE_PROMPT = (
    "Explain in two sentences what a KV cache is and why routing requests to the replica "
    "that already holds their prefix saves prefill time."
)


def serve_flag(text: str) -> int:
    if text.strip() not in ("0", "1"):
        raise argparse.ArgumentTypeError(f"must be 0 or 1, got {text!r}")
    return int(text)


def seed_value(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    # string defaults from the environment go through type= too: a bad DEMO_* value is the
    # same one-line error as a bad option (argparse names the option)
    env = os.environ.get
    parser.add_argument(
        "--port", type=tcp_port, default=env("DEMO_PORT", "8000"), help="(env DEMO_PORT)"
    )
    parser.add_argument(
        "--serve",
        type=serve_flag,
        default=env("DEMO_SERVE", "1"),
        help="1: keep serving after the comparison (Ctrl-C to stop); 0: exit (env DEMO_SERVE)",
    )
    parser.add_argument(
        "--time-scale",
        type=positive_float,
        default=env("DEMO_TIME_SCALE", "1.0"),
        help="(env DEMO_TIME_SCALE)",
    )
    parser.add_argument(
        "--seed", type=seed_value, default=env("DEMO_SEED", "0"), help="(env DEMO_SEED)"
    )
    parser.add_argument("--requests", type=positive_int, default=120)


def demo_workload(seed: int, requests: int) -> Workload:
    """Eight assistants (2,048-token system prompts), short questions and answers, Poisson
    arrivals at a rate that keeps four 8B/H100 replicas busy but not saturated."""
    groups = 8
    per = max(1, -(-requests // groups))
    return build(
        "shared-prefix",
        TextSource(),
        groups=groups,
        prompts_per_group=per,
        system_tokens=2048,
        question_tokens=64,
        output_tokens=24,
        rate=5.0,
        seed=seed,
        tenant=DEMO_TENANT,
    ).head(requests)


async def _compare(
    args: argparse.Namespace, fleet: FleetProcess, base: str, admin_key: str
) -> list[tuple[str, ReplayReport]]:
    workload = demo_workload(args.seed, args.requests)
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for strategy in ("round_robin", "expected_latency"):
            await set_strategy(client, base, admin_key, strategy, args.time_scale, SLOTS)
            await reset_caches(client, fleet.urls)
            await asyncio.sleep(pending_settle_s(args.time_scale))  # let pending entries expire
            print(f"replaying {len(workload.items)} requests through {strategy} ...", flush=True)
            report = await replay(
                workload, base, MODEL, {DEMO_TENANT: DEMO_KEY}, time_scale=args.time_scale
            )
            out.append((strategy, report))
    return out


def _print_comparison(results: list[tuple[str, ReplayReport]], replicas: Sequence[str]) -> None:
    """``replicas``: the fleet's replica ids, so one that got no request shows in the
    imbalance."""
    rows = [(name, rep.summary(replicas)) for name, rep in results]
    print()
    print(
        "TTFT in seconds of engine time (wall / time scale); hit rate = engine-reported "
        "cached prompt tokens / prompt tokens"
    )
    print(format_table(rows))
    base, ours = rows[0][1], rows[1][1]
    print()
    print(
        f"expected_latency vs round_robin: hit rate {ours['token_hit_rate']:.1%} vs "
        f"{base['token_hit_rate']:.1%}, TTFT p50 {ours['ttft_p50_s']:.3f} vs "
        f"{base['ttft_p50_s']:.3f} s, p99 {ours['ttft_p99_s']:.3f} vs "
        f"{base['ttft_p99_s']:.3f} s, prefill tokens computed "
        f"{ours['prefill_tokens']:,.0f} vs {base['prefill_tokens']:,.0f}"
    )
    errors = sum(int(s["errors"]) for _, s in rows)
    if errors:
        print(f"WARNING: {errors} requests failed")


def examples_text(port: int, admin_key: str) -> str:
    """The commands printed while the demo serves: each works pasted into a shell as shown
    (the explain names the demo's tenant, whose cached prefixes it then shows)."""
    base = f"http://127.0.0.1:{port}"
    return f"""
kvgate is serving on {base} (4 simulated replicas, embedded index and agents).

  curl -s {base}/v1/chat/completions \\
    -H 'authorization: Bearer {DEMO_KEY}' -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL}", "max_tokens": 16,
         "messages": [{{"role": "user", "content": "{EXAMPLE_PROMPT}"}}]}}'

  .venv/bin/python -c "
from openai import OpenAI
c = OpenAI(base_url='{base}/v1', api_key='{DEMO_KEY}')
r = c.chat.completions.create(model='{MODEL}', max_tokens=16,
    messages=[{{'role': 'user', 'content': '{EXAMPLE_PROMPT}'}}])
print(r.choices[0].message.content, r.usage)"

  metrics (the admin key): curl -s {base}/metrics -H 'x-admin-key: {admin_key}' | grep kvgate_

  why a request would go where (admin key of this run, nothing is sent); after the chat
  request above, the replica that served it shows the prompt's cached blocks (matched_blocks):
  curl -s '{base}/admin/route/explain?tenant={DEMO_TENANT}' -H 'x-admin-key: {admin_key}' \\
    -H 'content-type: application/json' \\
    -d '{{"model": "{MODEL}",
         "messages": [{{"role": "user", "content": "{EXAMPLE_PROMPT}"}}]}}'
Ctrl-C to stop."""


def _print_examples(port: int, admin_key: str) -> None:
    print(examples_text(port, admin_key), flush=True)


def run(args: argparse.Namespace) -> int:
    if not port_free(args.port):
        print(f"kvgate demo: port {args.port} is in use (set DEMO_PORT)", file=sys.stderr)
        return 2
    admin_key = "demo-admin-" + secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="kvgate-demo-") as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(scaled_policy("expected_latency", args.time_scale, SLOTS))
        keys = Path(tmp) / "keys.yaml"
        write_api_keys(keys, {DEMO_TENANT: DEMO_KEY})
        print(
            f"starting {REPLICAS} simulated replicas ({PROFILE}, time scale {args.time_scale}) ...",
            flush=True,
        )
        fleet_args = [
            "--profile",
            PROFILE,
            "--time-scale",
            str(args.time_scale),
            "--model",
            MODEL,
        ]
        with launch_fleet(REPLICAS, fleet_args, log_path=Path(tmp) / "fleet.log") as fleet:
            print(f"starting the gateway on 127.0.0.1:{args.port} ...", flush=True)
            with gateway(fleet, args.port, policy, keys, admin_key) as base:
                results = asyncio.run(_compare(args, fleet, base, admin_key))
                _print_comparison(results, [f"r{e.index}" for e in fleet.endpoints])
                if not args.serve:
                    return 0
                # Ctrl-C (or SIGTERM) from the moment the examples show is the normal end
                with contextlib.suppress(KeyboardInterrupt):
                    _print_examples(args.port, admin_key)
                    while True:
                        time.sleep(3600)
    return 0
