# ruff: noqa: E501  (a measurement script kept as it was run)
"""Responses API chains through each router, side by side on ONE simulated fleet.

One ``kvgate replica`` fleet (4 replicas by default, 8b-h100 profile, time scale 0.1) serves
every system in turn: kvgate ``expected_latency`` (``kvgate serve`` as ``kvgate bench
routers`` starts it: ``loadtest.harness.gateway``, the scaled policy, an API key),
vllm-router ``round_robin`` / ``cache_aware`` / ``kv_aware`` and sglang-router
``cache_aware`` (``loadtest.peers.router_command``, started fresh for each). Before each
system every replica's prefix cache is flushed (``loadtest.harness.reset_caches``); the
replicas' Responses stores cannot be reset (no endpoint), so each system's chains make
their own response ids (the replica makes a fresh one per response).

Per system: K three-turn chains with the ``openai`` SDK, a few at a time; chain i's turns
share the instructions of group i // group_size (~1,000 tokens), each turn's input is its
own ~60-token text, turns 2 and 3 name the last turn's id as ``previous_response_id``. A
chain stops at its first failed turn. Not streamed: the times are end-to-end wall times of
each non-streamed request (ms; engine time = wall / time scale). After each peer's run the
replicas' stores are asked (``GET /v1/responses/{id}`` on each replica, directly) which
replica holds each answered turn, so a follow-up's replica can be compared with its
previous response's (the gateway's ids are sealed: the replicas do not know them).

    nice -n 10 .venv/bin/python docs/results/2026-12-07g/responses_chains.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import openai

from cachecore.engine.latency import get_profile
from cachecore.replica.fleet import FleetProcess, launch_fleet
from cachecore.testing import free_port, free_ports
from cachecore.traceanalysis import percentile
from loadtest.harness import (
    MODEL,
    gateway,
    pending_settle_s,
    reset_caches,
    scaled_policy,
    write_api_keys,
)
from loadtest.peers import (
    EVENTS_TOPIC,
    PEERS_DIR,
    ensure_peers,
    ensure_tokenizer,
    placement_lookups,
    router_command,
    running_router,
    wait_router_ready,
)
from loadtest.workloads import TextSource

BLOCK_SIZE = 16
SYSTEMS = (
    "kvgate:expected_latency",
    "vllm-router:round_robin",
    "vllm-router:cache_aware",
    "vllm-router:kv_aware",
    "sglang-router:cache_aware",
)
TURNS = 3


@dataclass
class Turn:
    chain: int
    turn: int
    status: str  # "200", "404", another status, or an exception's name
    wall_s: float
    input_tokens: int = 0
    cached_tokens: int = 0
    rid: str | None = None
    prev: str | None = None
    detail: str = ""


@dataclass
class Run:
    system: str
    status: str = "ok"
    turns: list[Turn] = field(default_factory=list)
    chains_done: int = 0
    chains_tried: int = 0
    wall_s: float = 0.0
    holders: dict[str, list[int]] = field(default_factory=dict)  # rid -> replica indexes
    note: str = ""


async def chains(
    base: str, api_key: str, args: argparse.Namespace, text: TextSource, run: Run
) -> None:
    client = openai.AsyncOpenAI(
        base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=args.request_timeout
    )
    sem = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        async with sem:
            run.chains_tried += 1
            groups = max(1, args.chains // args.group_size)
            group = i % groups if args.interleave else i // args.group_size
            instructions = text.block(f"responses-chains-group-{group}", 1000)
            prev: str | None = None
            for t in range(1, TURNS + 1):
                turn_text = text.once(f"responses-chains-{i}-turn-{t}", 60)
                if args.control and t > 1:  # nothing of turn 1's text: only the id links them
                    instructions = text.once(f"responses-chains-control-{i}-turn-{t}", 1000)
                t0 = time.perf_counter()
                try:
                    kw = {} if prev is None else {"previous_response_id": prev}
                    r = await client.responses.create(
                        model=MODEL,
                        instructions=instructions,
                        input=turn_text,
                        max_output_tokens=args.max_output_tokens,
                        **kw,
                    )
                except openai.APIStatusError as exc:
                    wall = time.perf_counter() - t0
                    run.turns.append(
                        Turn(i, t, str(exc.status_code), wall, prev=prev, detail=str(exc)[:160])
                    )
                    return
                except (openai.APIError, httpx.HTTPError) as exc:
                    wall = time.perf_counter() - t0
                    run.turns.append(
                        Turn(i, t, type(exc).__name__, wall, prev=prev, detail=str(exc)[:160])
                    )
                    return
                wall = time.perf_counter() - t0
                u = r.usage
                cached = 0
                if u is not None and u.input_tokens_details is not None:
                    cached = u.input_tokens_details.cached_tokens or 0
                run.turns.append(
                    Turn(i, t, "200", wall, u.input_tokens if u else 0, cached, r.id, prev)
                )
                prev = r.id
            run.chains_done += 1

    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(i)) for i in range(args.chains)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.system_timeout)
    except TimeoutError:
        run.note = f"stopped at the {args.system_timeout:.0f} s bound"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        run.wall_s = time.perf_counter() - t0
        await client.close()


async def find_holders(http: httpx.AsyncClient, fleet: FleetProcess, run: Run) -> None:
    """Which replicas' stores hold each answered turn's id (asked directly)."""
    for t in run.turns:
        if t.rid is None:
            continue
        held = []
        for e in fleet.endpoints:
            r = await http.get(f"{e.url}/v1/responses/{t.rid}")
            if r.status_code == 200:
                held.append(e.index)
        run.holders[t.rid] = held


async def run_kvgate(
    args: argparse.Namespace,
    fleet: FleetProcess,
    tmp: Path,
    text: TextSource,
    http: httpx.AsyncClient,
    name: str = "kvgate:expected_latency",
) -> Run:
    run = Run(name)
    strategy = name.split(":", 1)[1]
    ts = args.time_scale
    keys = {"default": "chains-default-" + secrets.token_hex(6)}
    keys_path = tmp / "keys.yaml"
    write_api_keys(keys_path, keys)
    policy = tmp / "policy.yaml"
    policy.write_text(scaled_policy(strategy, ts, get_profile(args.profile).max_num_seqs))
    admin = "chains-admin-" + secrets.token_hex(8)
    topic = {"KVGATE_AGENT_TOPIC": EVENTS_TOPIC}
    with gateway(fleet, free_port(), policy, keys_path, admin, extra_env=topic) as base:
        await reset_caches(http, fleet.urls)
        await asyncio.sleep(pending_settle_s(ts))
        await chains(base, keys["default"], args, text, run)
    return run


async def run_peer(
    name: str,
    args: argparse.Namespace,
    fleet: FleetProcess,
    tmp: Path,
    text: TextSource,
    http: httpx.AsyncClient,
    peers: dict,
    tokenizer_dir: Path | None,
) -> Run:
    peer, policy = name.split(":")
    run = Run(name)
    st = peers.get(peer)
    if st is None or not st.ok or tokenizer_dir is None:
        run.status = st.message if st is not None else "skipped: not set up"
        return run
    port, prom = free_ports(2)
    cmd, env = router_command(
        peer, policy, st.venv, port, prom, fleet.endpoints, tokenizer_dir, MODEL
    )
    base = f"http://127.0.0.1:{port}"
    log = tmp / f"{name.replace(':', '-')}.log"
    with running_router(cmd, env, log) as proc:
        try:
            await asyncio.to_thread(wait_router_ready, base, proc)
        except (RuntimeError, TimeoutError) as exc:
            tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-2:])
            run.status = f"failed: {exc} ({tail[:200]})"
            return run
        await reset_caches(http, fleet.urls)
        await chains(base, "none", args, text, run)
        if policy == "kv_aware":
            with contextlib.suppress(httpx.HTTPError):
                r = await http.get(f"http://127.0.0.1:{prom}/metrics")
                looks = placement_lookups(r.text)
                run.note = (
                    (run.note + "; " if run.note else "")
                    + "placement lookups: "
                    + (", ".join(f"{k} {v:.0f}" for k, v in sorted(looks.items())) or "none")
                )
    await find_holders(http, fleet, run)
    return run


def row(run: Run, ts: float) -> str:
    if run.status != "ok":
        return f"| {run.system} | {run.status} | | | | | | | |"
    first = [t for t in run.turns if t.turn == 1]
    follow = [t for t in run.turns if t.turn > 1]
    ok1 = sum(t.status == "200" for t in first)
    ok = [t for t in follow if t.status == "200"]
    n404 = sum(t.status == "404" for t in follow)
    other = len(follow) - len(ok) - n404

    def share(ts_: list[Turn]) -> str:
        vals = [
            t.cached_tokens / t.input_tokens for t in ts_ if t.status == "200" and t.input_tokens
        ]
        return f"{statistics.fmean(vals):.1%}" if vals else "–"

    walls = [t.wall_s * 1000 for t in ok]
    times = f"{percentile(walls, 50):.0f} / {percentile(walls, 99):.0f}" if walls else "–"
    if run.holders:
        same = sum(
            1
            for t in run.turns
            if t.turn > 1
            and t.prev is not None
            and set(run.holders.get(t.prev, [])) & set(run.holders.get(t.rid or "", []))
        )
        placed = f"{same} / {len(ok)}"
        # a follow-up that got a 404: no replica it reached held its previous response
    else:
        placed = "by construction (sealed id)"
    return (
        f"| {run.system} | {run.chains_done} / {run.chains_tried} "
        f"| {ok1} / {len(first)} | {len(ok)} / {n404} / {other} | {share(ok)} | {share(first)} "
        f"| {times} | {placed} | {run.wall_s:.1f} |"
    )


async def main_async(args: argparse.Namespace, fleet: FleetProcess, tmp: Path) -> list[Run]:
    text = TextSource()
    peers = ensure_peers(
        sorted({s.split(":")[0] for s in args.systems if not s.startswith("kvgate")}),
        args.peers_dir,
        install=False,
    )
    for st in peers.values():
        print(f"peer {st.name}: {st.message}", flush=True)
    tokenizer_dir = ensure_tokenizer(args.peers_dir) if any(p.ok for p in peers.values()) else None
    runs = []
    async with httpx.AsyncClient(timeout=10.0) as http:
        for name in args.systems:
            print(f"  {name} ...", flush=True)
            try:
                if name.startswith("kvgate"):
                    run = await run_kvgate(args, fleet, tmp, text, http, name)
                else:
                    run = await run_peer(name, args, fleet, tmp, text, http, peers, tokenizer_dir)
            except Exception as exc:  # one system's failure must not lose the others
                run = Run(name, status=f"failed: {type(exc).__name__}: {str(exc)[:200]}")
            runs.append(run)
            errs = [t for t in run.turns if t.status != "200"]
            print(
                f"    {run.status}; {len(run.turns)} turns, {len(errs)} failed {run.note}",
                flush=True,
            )
            for t in errs[:2]:
                print(f"    e.g. chain {t.chain} turn {t.turn}: {t.status} {t.detail}", flush=True)
    return runs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=0.1)
    p.add_argument("--profile", default="8b-h100")
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--chains", type=int, default=24)
    p.add_argument("--group-size", type=int, default=4, help="chains sharing one instructions text")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="chain i in group i %% groups (not i // group-size): chains run together belong to different groups",
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument("--system-timeout", type=float, default=180.0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    p.add_argument(
        "--control",
        action="store_true",
        help="turns 2-3 send their own instructions (shared with nothing): a router can "
        "place them with their previous response only by its id or its own history",
    )
    p.add_argument("--json", type=Path, default=None, help="write every turn here")
    args = p.parse_args()
    args.systems = args.systems.split(",")

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds the context managers: peers, gateway, fleet

    signal.signal(signal.SIGTERM, stop)
    fleet_args = [
        "--profile", args.profile, "--time-scale", str(args.time_scale), "--model", MODEL,
        "--blocks", str(args.blocks), "--block-size", str(BLOCK_SIZE), "--log-level", "WARNING",
        "--events-topic", EVENTS_TOPIC,
    ]  # fmt: skip
    t0 = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="kvgate-responses-chains-") as tmp,
        launch_fleet(
            args.replicas, fleet_args, log_path=Path(tmp) / "fleet.log", process_per_replica=True
        ) as fleet,
    ):
        runs = asyncio.run(main_async(args, fleet, Path(tmp)))
    wall = time.perf_counter() - t0
    print()
    print(
        f"{args.replicas} replicas ({args.profile}, time scale {args.time_scale}), {args.chains} chains x {TURNS} turns "
        f"per system, {args.concurrency} chains at a time, {args.chains // args.group_size} instruction groups "
        f"(~1,000 tokens) of {args.group_size} chains, max_output_tokens {args.max_output_tokens}, not streamed "
        f"({wall:.0f} s wall)\n"
    )
    print(
        "| system | chains completed / attempted | turn 1 200 / sent | follow-ups 200 / 404 / other "
        "| cached share, turns 2-3 | cached share, turn 1 | e2e p50 / p99, turns 2-3 (wall ms) "
        "| follow-up on its previous's replica | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(row(r, args.time_scale))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))
    for r in runs:
        if r.note:
            print(f"\n{r.system}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
