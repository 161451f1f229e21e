"""``kvgate replica``: serve N simulated vLLM-compatible replicas from one process.

Replica i listens on HTTP port P+i, publishes KV events on tcp://EVENTS_HOST:P+1000+i and
answers replay on P+2000+i (P = --base-port). Flags override ``KVGATE_REPLICA_*`` env vars.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import zmq
from pydantic import ValidationError

from cachecore.argtypes import (
    log_level,
    name_variables,
    positive_int,
    settings_variables,
    unknown_settings,
    validation_message,
)
from cachecore.chatformat import CONTENT_FORMAT_OPTIONS
from cachecore.engine import PROFILES, HashAlgo, WireHashFormat
from cachecore.kvevents import Encoding
from cachecore.logs import configure_logging
from cachecore.process import freeze_startup_heap
from cachecore.replica.fleet import plan_rank_ports, run_fleet
from cachecore.replica.settings import ReplicaPorts, ReplicaSettings
from cachecore.tokenizer import HFTokenizer

log = logging.getLogger(__name__)

DEFAULT_BASE_PORT = 9100

# flag dest -> ReplicaSettings field
_SETTINGS_FLAGS = {
    "host": "host",
    "events_host": "events_host",
    "model": "model",
    "profile": "profile",
    "blocks": "num_blocks",
    "block_size": "block_size",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_model_len": "max_model_len",
    "time_scale": "time_scale",
    "hash_algo": "hash_algo",
    "hash_seed": "hash_seed",
    "event_hash_format": "event_hash_format",
    "event_encoding": "event_encoding",
    "events_topic": "events_topic",
    "replay_buffer_steps": "replay_buffer_steps",
    "lora": "lora",
    "tokenizer_dir": "tokenizer_dir",
    "chat_template_content_format": "chat_template_content_format",
    "data_parallel_size": "data_parallel_size",
    "responses_store_max": "responses_store_max",
    "score_template": "score_template",
    "default_chat_template_kwargs": "default_chat_template_kwargs",
    "reasoning_effort_map": "reasoning_effort_map",
    "exclude_tools_when_tool_choice_none": "exclude_tools_when_tool_choice_none",
}


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--count", type=positive_int, default=1, help="number of replicas (default 1)")
    a("--base-port", type=int, default=DEFAULT_BASE_PORT, help="HTTP port of replica 0 (9100)")
    a("--http-ports", help="comma-separated HTTP ports (overrides --base-port)")
    a("--events-ports", help="comma-separated KV-event PUB ports (default P+1000+i)")
    a("--replay-ports", help="comma-separated replay ROUTER ports (default P+2000+i)")
    a("--host", help="HTTP bind host (default 127.0.0.1)")
    a("--events-host", help="ZMQ bind host (default 127.0.0.1; '*' for all interfaces)")
    a("--model", help="served model name (default kvgate-sim-8b)")
    a("--profile", choices=sorted(PROFILES), help="latency profile (default 8b-h100)")
    a("--blocks", type=int, help="KV blocks per replica (default 4096)")
    a("--block-size", type=int, help="tokens per block (default 16)")
    a("--max-num-seqs", type=int, help="max running requests (default: the profile's)")
    a("--max-num-batched-tokens", type=int, help="per-step token budget (default 8192)")
    a("--max-model-len", type=int, help="max prompt+output tokens (default 32768, capped)")
    a("--time-scale", type=float, help="multiply modelled durations (0.1 = 10x faster)")
    a("--hash-algo", choices=[h.value for h in HashAlgo], help="engine block hash (sha256)")
    a("--hash-seed", type=int, help="fixed engine hash seed (default: random per process)")
    a(
        "--event-hash-format",
        choices=[f.value for f in WireHashFormat],
        help="block hashes in events: 64-bit ints (default) or raw digest bytes",
    )
    a(
        "--event-encoding",
        choices=[e.value for e in Encoding],
        help="mixed (default: array batch, map events, as vLLM 0.26-0.33), map or array (older)",
    )
    a("--events-topic", help="ZMQ topic (default kv-events)")
    a("--replay-buffer-steps", type=int, help="batches kept for replay (default 10000)")
    a(
        "--responses-store-max",
        type=positive_int,
        help="stored Responses API responses per replica, least recently used evicted (1000)",
    )
    a(
        "--score-template",
        metavar="FILE",
        help="chat template each /score and /rerank pair is rendered with, as a vLLM "
        "cross-encoder's --chat-template (Qwen3 rerankers; default: the tokenizer's pair "
        "template)",
    )
    a(
        "--default-chat-template-kwargs",
        type=json.loads,
        metavar="JSON",
        help="as vLLM's flag: template variables under every chat request's own "
        "chat_template_kwargs (not a pooling request's), e.g. '{\"enable_thinking\": false}'",
    )
    a(
        "--reasoning-effort-map",
        type=json.loads,
        metavar="JSON",
        help="as vLLM's flag: rewrites a request's reasoning effort before the template "
        'gets it, e.g. \'{"medium": "low"}\'',
    )
    a(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        default=None,
        help="as vLLM's flag: a chat completion's or Responses request's tools are not "
        'rendered when its tool_choice is "none" (/tokenize renders them)',
    )
    a("--legacy-replay-reply", action="store_true", help="reply [b'', seq, payload] on replay")
    a("--no-events", action="store_true", help="do not publish KV events")
    a("--lora", action="append", metavar="NAME", help="serve a LoRA adapter name (repeatable)")
    a(
        "--data-parallel-size",
        type=positive_int,
        help="engine cores per replica behind its one HTTP port, each with its own KV cache "
        "and events on the replica's event/replay port + rank (x --count); requests name a "
        "core in X-data-parallel-rank (default 1)",
    )
    a(
        "--tokenizer-dir",
        help="HF model dir with tokenizer.json + chat template (default: the built-in one)",
    )
    a(
        "--chat-template-content-format",
        choices=CONTENT_FORMAT_OPTIONS,
        help="as vLLM's flag: message contents handed to the chat template as one string or "
        "as a list of parts (default auto: detected from the template)",
    )
    a(
        "--drop-last-hit-block",
        action="store_true",
        help="drop the last matched block of every prefix-cache hit, as vLLM does with "
        "EAGLE/EAGLE3/MTP speculative decoding",
    )
    a("--access-log", action="store_true", help="log every HTTP request (debugging)")
    a("--log-level", type=log_level, default="INFO")
    a("--plain-logs", action="store_true", help="human-readable logs instead of JSON lines")
    # each flag above that sets a setting names its variable (KVGATE_REPLICA_*)
    # (the map build_settings reads, and --no-events, which sets publish_events false)
    renamed = {**_SETTINGS_FLAGS, "no_events": "publish_events"}
    name_variables(parser, ReplicaSettings, renamed, {"publish_events"})


def _ports(arg: str | None, name: str, count: int) -> list[int] | None:
    if arg is None:
        return None
    try:
        ports = [int(p) for p in arg.split(",") if p.strip()]
    except ValueError:
        _usage_error(f"argument --{name}: must be comma-separated integers, got {arg!r}")
    if len(ports) != count:
        _usage_error(f"argument --{name}: needs {count} ports (--count), got {len(ports)}")
    return ports


def _usage_error(message: str) -> NoReturn:
    """A bad flag found after parsing: argparse's form and exit code, as for every other."""
    print(f"kvgate replica: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def build_settings(args: argparse.Namespace) -> ReplicaSettings:
    overrides: dict[str, Any] = {
        field: getattr(args, flag)
        for flag, field in _SETTINGS_FLAGS.items()
        if getattr(args, flag, None) is not None
    }
    if args.legacy_replay_reply:
        overrides["legacy_replay_reply"] = True
    if args.access_log:
        overrides["access_log"] = True
    if args.drop_last_hit_block:
        overrides["drop_last_hit_block"] = True
    if args.no_events:
        overrides["publish_events"] = False
    try:
        return ReplicaSettings(**overrides)
    except ValidationError as exc:  # a value out of its range: the flag's name, no traceback
        err = exc.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        flag = next((f for f, name in _SETTINGS_FLAGS.items() if name == field), field)
        _usage_error(f"argument --{flag.replace('_', '-')}: {validation_message(err)}")


def build_ports(args: argparse.Namespace, dp: int = 1) -> list[ReplicaPorts]:
    n = args.count
    base = [ReplicaPorts.from_base(args.base_port, i) for i in range(n)]
    http = _ports(args.http_ports, "http-ports", n) or [p.http for p in base]
    events = _ports(args.events_ports, "events-ports", n) or [p.events for p in base]
    replay = _ports(args.replay_ports, "replay-ports", n) or [p.replay for p in base]
    for given, name in ((http, "http-ports"), (events, "events-ports"), (replay, "replay-ports")):
        for port in given:
            if not 0 <= port <= 65535:  # the bind would raise OverflowError, a traceback
                flag = name if getattr(args, name.replace("-", "_")) else "base-port"
                _usage_error(f"argument --{flag}: port {port} is out of range (0-65535)")
    planned = [ReplicaPorts(h, e, r) for h, e, r in zip(http, events, replay, strict=True)]
    # one port given twice would fail only at its second bind, as "in use": the HTTP,
    # event and replay ports (and a data-parallel core's own event and replay ports) share
    # the TCP port space; 0 is "any free port", never a clash
    try:
        cores = plan_rank_ports(planned, dp, planned=True)
    except ValueError as exc:  # data-parallel cores' ports (port + rank x count) overlap
        _usage_error(f"argument --data-parallel-size: {exc}")
    seen: dict[int, str] = {}
    for server, ranks in enumerate(cores):
        for rank, core in enumerate(ranks):
            what = f"replica {server}" + (f" core {rank}" if dp > 1 else "")
            roles = [("events", core.events), ("replay", core.replay)]
            if rank == 0:  # the cores share their server's HTTP port
                roles.insert(0, ("HTTP", core.http))
            for role, port in roles:
                if port and port in seen:
                    _usage_error(f"port {port} is both {seen[port]} and {what}'s {role} port")
                seen[port] = f"{what}'s {role} port"
    return planned


def load_tokenizer(settings: ReplicaSettings) -> HFTokenizer | None:
    """The ``--tokenizer-dir`` model's tokenizer, loaded before anything starts; a directory
    it cannot be loaded from is a usage error. None: the built-in one."""
    if not settings.tokenizer_dir:
        return None
    try:
        return HFTokenizer.from_dir(
            Path(settings.tokenizer_dir), content_format=settings.chat_template_content_format
        )
    # the `tokenizers` library raises a bare Exception for a malformed tokenizer.json
    # ("EOF while parsing an object"); it was a traceback, as a bad tokenizer_config.json
    # (JSONDecodeError) was, and a missing file was exit 1
    except Exception as exc:
        _usage_error(f"argument --tokenizer-dir: cannot load {settings.tokenizer_dir}: {exc}")


def _say(line: str) -> None:
    """One whole line in one write: replicas of one fleet share a log (each its own
    process), and with unbuffered output print() wrote the text and its newline apart, so
    two processes' lines ran together and a reader counting ready lines missed one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _serve(
    settings: ReplicaSettings, ports: list[ReplicaPorts], tokenizer: HFTokenizer | None = None
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with run_fleet(settings, len(ports), ports=ports, tokenizer=tokenizer) as fleet:
        freeze_startup_heap()  # a full collection would otherwise stall the engine loops
        for ep in fleet.endpoints:
            rank = "" if ep.dp_rank is None else f" (data-parallel rank {ep.dp_rank})"
            _say(
                f"replica {ep.index}{rank}: {ep.url}  events {ep.events_endpoint}  "
                f"replay {ep.replay_endpoint}  model {ep.model}"
            )
        ready = {
            "profile": settings.profile,
            "time_scale": settings.time_scale,
            "replicas": [e.as_dict() for e in fleet.endpoints],
        }
        _say("ready " + json.dumps(ready))
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, json_format=not args.plain_logs)
    if args.access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    known = settings_variables(ReplicaSettings)
    for warning in unknown_settings(os.environ, known, "KVGATE_REPLICA_", "kvgate replica"):
        log.warning(warning)
    settings = build_settings(args)
    ports = build_ports(args, settings.data_parallel_size)
    tokenizer = load_tokenizer(settings)
    try:
        asyncio.run(_serve(settings, ports, tokenizer))
    except (OSError, zmq.ZMQError) as exc:  # a port in use
        # exit 2, as `kvgate serve` and `kvgate agent` refuse a port they cannot listen on
        print(f"kvgate replica: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # uvicorn exits on a bind error (after logging it)
        return int(exc.code or 1)
    return 0
