"""``kvgate index``: what the shared Redis index holds per replica, and its clean-up.

    kvgate index stats [--json]                       per replica, and totals
    kvgate index sweep [--max-keys N]                 old epochs' orphaned keys
    kvgate index forget REPLICA... [--idle-for 10m]   every key of departed replicas
    kvgate index forget --departed --idle-for 24h     every unregistered replica idle that long

Idle: neither its agent (meta ``updated_ms``) nor a gateway (a pending entry's or in-flight
record's expiry) wrote for it within ``--idle-for``; a replica with no agent has only the
latter. Ages are read against the Redis server's clock (``TIME``), not this host's: an
operator's machine or job whose clock runs ahead judged a live replica idle.

A replica that leaves the fleet for good leaves its index keys (meta, its epoch's block and
mirror hashes, removal log) in Redis for ever; its registration and load keys expire. The
Redis URL, Cluster flag and key prefix are the gateway's settings (``KVGATE_REDIS_URL``,
``KVGATE_REDIS_CLUSTER``, ``KVGATE_KEY_PREFIX``), overridden by the flags; no other
``KVGATE_*`` variable is read. Everything it sends is within the sweeper ACL
(``gateway_acl_rules(sweeper=True)``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachecore.argtypes import positive_int
from cachecore.index.base import IndexError_
from cachecore.index.layout import (
    DEFAULT_PREFIX,
    InvalidReplicaIdError,
    KeyLayout,
    validate_replica_id,
)
from cachecore.index.redis import (
    REDIS_FAILURES,
    ForgetResult,
    RedisIndex,
    ReplicaInspection,
    check_redis_url,
)

DEFAULT_IDLE_S = 600.0
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """A ``type=`` for a duration in seconds: ``90``, ``90s``, ``10m``, ``24h``, ``2d``."""
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 10m, 24h)") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite duration >= 0, got {text!r}")
    return value


def _replica_id(text: str) -> str:
    try:
        return validate_replica_id(text)
    except InvalidReplicaIdError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _age(ms: float) -> str:
    """``ms`` as the largest whole unit: 42s, 7m, 3h, 2d."""
    s = max(0.0, ms / 1000.0)
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if s >= size:
            return f"{int(s // size)}{unit}"
    return f"{int(s)}s"


def configure(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--redis", dest="redis_url", metavar="URL",
        help="redis://[user:password@]host:port/db of the index (env KVGATE_REDIS_URL)",
    )  # fmt: skip
    common.add_argument(
        "--redis-cluster", action="store_true",
        help="--redis is a seed node of a Redis Cluster (env KVGATE_REDIS_CLUSTER)",
    )  # fmt: skip
    common.add_argument("--key-prefix", help="Redis key namespace (env KVGATE_KEY_PREFIX; 'kvg')")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    stats = sub.add_parser(
        "stats", parents=[common], help="per replica: state, epoch, entries, pending, age"
    )
    stats.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    sweep = sub.add_parser(
        "sweep", parents=[common], help="unlink epoch keys no replica's meta points at"
    )
    sweep.add_argument(
        "--max-keys", type=positive_int, default=100_000,
        help="examine at most this many keys per run (%(default)s)",
    )  # fmt: skip
    forget = sub.add_parser(
        "forget", parents=[common], help="unlink every key of replicas that left for good"
    )
    forget.add_argument(
        "replicas", nargs="*", type=_replica_id, metavar="REPLICA", help="replica ids"
    )
    forget.add_argument(
        "--departed", action="store_true",
        help="every replica that is not registered and idle for --idle-for",
    )  # fmt: skip
    forget.add_argument(
        "--idle-for", type=duration, default=DEFAULT_IDLE_S, metavar="DURATION",
        help="refuse a replica its agent or a gateway wrote for more recently (90s, 10m, 24h; 10m)",
    )  # fmt: skip
    forget.add_argument(
        "--force", action="store_true",
        help="forget even a registered or recently updated replica (its agent rebuilds it)",
    )  # fmt: skip
    forget.add_argument("--dry-run", action="store_true", help="say what would go; unlink none")


@dataclass(frozen=True, slots=True)
class _Target:
    url: str
    cluster: bool
    prefix: str


class _Refused(Exception):
    """A usage or setup problem, printed as one line (exit 2)."""


class IndexSettings(BaseSettings):
    """The gateway's settings this command uses, read as ``GatewaySettings`` reads them
    and nothing more: with all of them, an unrelated bad variable (``KVGATE_PORT=abc``, a
    malformed ``KVGATE_CORS_*``) refused the command."""

    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="ignore")

    redis_url: str | None = None
    redis_cluster: bool = False
    key_prefix: str = Field(default=DEFAULT_PREFIX, min_length=1)

    @field_validator("redis_url", mode="before")
    @classmethod
    def _redis_url(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            raise ValueError("empty: give a redis:// URL")
        return check_redis_url(value) if isinstance(value, str) else value

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        KeyLayout(value)  # raises on a prefix Redis keys cannot carry
        return value


def _target(args: argparse.Namespace) -> _Target:
    """The gateway's Redis settings (``KVGATE_REDIS_URL``, ...), the flags over them."""
    overrides: dict[str, Any] = {}
    if args.redis_url is not None:
        overrides["redis_url"] = args.redis_url
    if args.key_prefix is not None:
        overrides["key_prefix"] = args.key_prefix
    if args.redis_cluster:
        overrides["redis_cluster"] = True
    try:
        settings = IndexSettings(**overrides)
    except ValidationError as exc:
        from cachecore.argtypes import settings_error

        raise _Refused(settings_error(exc)) from None
    except ValueError as exc:  # pydantic-settings' SettingsError: an environment value unparsed
        raise _Refused(str(exc)) from None
    if not settings.redis_url:
        raise _Refused("no Redis given: pass --redis URL (or set KVGATE_REDIS_URL)")
    return _Target(settings.redis_url, settings.redis_cluster, settings.key_prefix)


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "forget":
            if bool(args.replicas) == bool(args.departed):
                raise _Refused("forget takes REPLICA ids or --departed (one of them)")
            if args.departed and args.force:  # it would forget a replica that just came back
                raise _Refused("--departed forgets only idle unregistered replicas: no --force")
        target = _target(args)
        try:
            index = RedisIndex.from_url(
                target.url,
                KeyLayout(target.prefix),
                cluster=target.cluster,
                socket_timeout_s=10.0,
                connect_timeout_s=5.0,
                max_connections=8,
            )
        except ValueError as exc:  # the URL's own problem (the URL is not quoted)
            raise _Refused(f"--redis (KVGATE_REDIS_URL): {exc}") from None
        return asyncio.run(_run(index, args))
    except _Refused as exc:
        print(f"kvgate index: {exc}", file=sys.stderr)
        return 2
    except IndexError_ as exc:  # unreachable, refused (ACL, auth, not a cluster), ...
        print(f"kvgate index: Redis failed: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


async def _run(index: RedisIndex, args: argparse.Namespace) -> int:
    try:
        if args.action == "stats":
            return await _stats(index, args.json)
        if args.action == "sweep":
            return await _sweep(index, args.max_keys)
        return await _forget(index, args)
    finally:
        await index.close()


class _Clock:
    """The Redis server's clock in ms: its ``TIME`` once, then this host's monotonic time
    since. The stamps judged (the agents' ``updated_ms``, the gateways' expiries) come from
    the fleet's clocks, which share Redis; this host's wall clock (an operator's laptop, a
    job's container) is no part of them."""

    def __init__(self, redis_ms: int) -> None:
        self._at, self._base = time.monotonic(), redis_ms

    @classmethod
    async def of(cls, index: RedisIndex) -> _Clock:
        try:
            sec, usec = await index.client.time()
        except REDIS_FAILURES as exc:
            raise IndexError_(f"time: {exc}") from exc
        return cls(int(sec) * 1000 + int(usec) // 1000)

    def now_ms(self) -> int:
        return self._base + int((time.monotonic() - self._at) * 1000)


async def _inspect(
    index: RedisIndex, clock: _Clock
) -> tuple[dict[str, list[bytes]], list[ReplicaInspection], set[str]]:
    """Every replica's keys, what the index holds for it, and the ids validly registered."""
    from cachecore.registry import RedisRegistry

    keys = await index.keys_by_replica()
    infos = await index.inspect_replicas(sorted(keys))
    registry = RedisRegistry(index.client, index.layout)  # shares the client: not closed
    registered = {reg.replica_id for reg in await registry.discover(clock.now_ms(), sorted(keys))}
    return keys, infos, registered


async def _routed_ms(index: RedisIndex, keys: dict[str, list[bytes]]) -> dict[str, int]:
    """Per replica, the newest expiry of a gateway's pending entry (``gw:p:*``, any epoch)
    or in-flight liveness (``gw:inflight``'s ``<gateway>:x``): what the forget script
    judges a replica's gateway activity by, and all an agentless replica has. Plain reads,
    a pipeline per 1000; a key of the wrong type reads as none, as in the script."""
    asks: list[tuple[str, str]] = []  # (replica, key) of each command
    for rid, names in keys.items():
        for raw in names:
            name = raw.decode()
            parsed = index.layout.parse(name)
            if parsed is not None and parsed[1] in ("gw:p", "gw:inflight"):
                asks.append((rid, name))
    newest: dict[str, int] = {}
    for at in range(0, len(asks), 1000):
        part = asks[at : at + 1000]
        pipe = index.client.pipeline(transaction=False)
        for _rid, name in part:
            if name.endswith(":gw:inflight"):
                pipe.hgetall(name)
            else:
                pipe.zrange(name, -1, -1, withscores=True)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except REDIS_FAILURES as exc:
            raise IndexError_(f"routed: {exc}") from exc
        for (rid, _name), reply in zip(part, replies, strict=True):
            if isinstance(reply, Exception):
                if str(reply).startswith("WRONGTYPE"):
                    continue
                raise IndexError_(f"routed: {reply}")
            if isinstance(reply, dict):
                stamps = [v for k, v in reply.items() if str(k, "utf-8", "replace").endswith(":x")]
            else:
                stamps = [score for _member, score in reply]
            for v in stamps:
                try:
                    ms = int(float(v))
                except (TypeError, ValueError):
                    continue  # a field no gateway writes
                newest[rid] = max(ms, newest.get(rid, ms))
    return newest


def _registered(info: ReplicaInspection, registered: set[str]) -> str:
    if info.replica in registered:
        return "yes"
    return "invalid" if info.registration else "no"  # a key no gateway accepts


def _updated_age_ms(info: ReplicaInspection, now_ms: int) -> int | None:
    if not info.has_meta or info.meta.updated_ms <= 0:
        return None
    return now_ms - info.meta.updated_ms


async def _stats(index: RedisIndex, as_json: bool) -> int:
    clock = await _Clock.of(index)
    keys, infos, registered = await _inspect(index, clock)
    routed = await _routed_ms(index, keys)
    used = await index.used_memory()
    now = clock.now_ms()
    rows: list[dict[str, Any]] = []
    for info in infos:
        age = _updated_age_ms(info, now)
        last = routed.get(info.replica)
        rows.append(
            {
                "replica": info.replica,
                "state": info.meta.state.value if info.has_meta else None,
                "epoch": info.meta.epoch if info.has_meta else None,
                "stored": info.stored,
                "mirror": info.mirror,
                "pending": info.pending,
                "removals": info.removals,
                "keys": len(keys[info.replica]),
                "updated_age_s": None if age is None else round(age / 1000.0, 3),
                # since its gateways' newest entry lapsed; < 0: still live for that long
                "routed_age_s": None if last is None else round((now - last) / 1000.0, 3),
                "registered": _registered(info, registered),
                "unreadable": info.wrong_type or bool(info.meta.unreadable),
            }
        )
    totals = {
        "replicas": len(rows),
        "registered": sum(r["registered"] == "yes" for r in rows),
        "stored": sum(info.stored for info in infos),
        "mirror": sum(info.mirror for info in infos),
        "pending": sum(info.pending for info in infos),
        "keys": sum(len(k) for k in keys.values()),
    }
    if as_json:
        print(json.dumps({"replicas": rows, "totals": totals, "used_memory": used}))
        return 0
    head = ("REPLICA", "STATE", "EPOCH", "STORED", "MIRROR", "PENDING", "REMOVALS", "KEYS",
            "UPDATED", "ROUTED", "REGISTERED")  # fmt: skip
    table: list[tuple[str, ...]] = [head]
    for r in rows:
        age, last = r["updated_age_s"], r["routed_age_s"]
        state = r["state"] or "(no meta)"
        table.append(
            (
                r["replica"],
                state + ("!" if r["unreadable"] else ""),
                "-" if r["epoch"] is None else str(r["epoch"]),
                *(str(r[k]) for k in ("stored", "mirror", "pending", "removals", "keys")),
                "-" if age is None else _age(age * 1000.0) + " ago",
                "-" if last is None else "now" if last < 0 else _age(last * 1000.0) + " ago",
                r["registered"],
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if any(r["unreadable"] for r in rows):
        print("! a key or meta field no agent writes (read as empty); its agent rebuilds it")
    if any(r["updated_age_s"] is None for r in rows):
        print(
            "UPDATED -: no agent stamp (no agent: a replica only gateways route to, or its"
            " meta is lost); ROUTED: when its gateways' newest pending entry or in-flight"
            " record lapsed (now: one is live)"
        )
    print(
        f"{totals['replicas']} replicas ({totals['registered']} registered), "
        f"{totals['stored']} stored entries, {totals['pending']} pending, "
        f"{totals['keys']} keys; Redis used_memory {used / 2**20:.1f} MiB"
    )
    return 0


async def _sweep(index: RedisIndex, max_keys: int) -> int:
    result = await index.sweep_orphan_keys(max_keys)
    for key in result.removed:
        print(f"removed {key}")
    print(f"removed {len(result.removed)} orphaned keys of {result.examined} examined")
    if not result.complete:
        print(f"stopped at --max-keys {max_keys} with keys left to examine: run it again")
    return 0


def _refusal(
    info: ReplicaInspection | None, registered: set[str], now_ms: int, idle_s: float
) -> str | None:
    """Why ``forget`` leaves a replica alone (without --force), or None. The forget script
    checks the same again as it unlinks (an agent may come back in between)."""
    if info is None:
        return "holds no keys under this prefix (a typo, or another --key-prefix?)"
    if info.registration:
        what = "registered" if info.replica in registered else "has a registration key"
        return (
            f"it is {what} (its agent runs, stopped less than its TTL ago, or stopped "
            "cleanly while its engine served, leaving it to a next agent for its hand-over "
            "window: stop the engine first, or the agent with --deregister-on-stop always)"
        )
    age = _updated_age_ms(info, now_ms)
    if age is not None and age < idle_s * 1000.0:
        return f"its meta was updated {_age(age)} ago (under --idle-for {_age(idle_s * 1000)})"
    return None


def _active(result: ForgetResult, now_ms: int, idle_s: float) -> str:
    """Why the forget script refused a replica its gateways route to."""
    until = result.active_ms or 0
    if until > now_ms:
        return f"gateways are routing to it (their entries for it live {_age(until - now_ms)} more)"
    idle = _age(idle_s * 1000)
    return f"gateways routed to it {_age(now_ms - until)} ago (under --idle-for {idle})"


async def _in_use(
    index: RedisIndex,
    info: ReplicaInspection,
    keys: list[bytes],
    args: argparse.Namespace,
    clock: _Clock,
) -> str | None:
    """Why the forget script would refuse ``info``'s replica now, or None: the gateways'
    writes for it (pending entries, in-flight records), which :func:`_refusal` cannot see,
    judged where the real forget judges them."""
    now = clock.now_ms()
    result = await index.forget_replica(
        info.replica, keys, now_ms=now, idle_ms=int(args.idle_for * 1000), check=True
    )
    if not result.refused:
        return None
    if result.refused == "active":
        return _active(result, now, args.idle_for)
    return "it registered or its meta was updated just now"


def _summary(info: ReplicaInspection, nkeys: int) -> str:
    epoch = f"epoch {info.meta.epoch}, " if info.has_meta else "no meta, "
    keys = "1 key" if nkeys == 1 else f"{nkeys} keys"
    return f"{keys} ({epoch}{info.stored} stored entries, {info.pending} pending)"


async def _forget(index: RedisIndex, args: argparse.Namespace) -> int:
    clock = await _Clock.of(index)
    keys, infos, registered = await _inspect(index, clock)
    by_id = {info.replica: info for info in infos}
    now = clock.now_ms()
    idle_ms = int(args.idle_for * 1000)
    if args.departed:
        chosen = [
            info
            for info in infos
            if _refusal(info, registered, now, args.idle_for) is None
            and await _in_use(index, info, keys[info.replica], args, clock) is None
        ]
        if not chosen:
            print(f"no departed replica (unregistered, idle for {_age(idle_ms)})")
            return 0
    else:
        refusals = []
        for rid in dict.fromkeys(args.replicas):  # once each, in the order given
            info = by_id.get(rid)
            why = _refusal(info, registered, now, args.idle_for)
            if why is None and info is not None and not args.force:
                why = await _in_use(index, info, keys[rid], args, clock)
            if why is not None and not (args.force and rid in by_id):
                refusals.append(f"{rid}: {why}")
        if refusals:
            for line in refusals:
                print(f"kvgate index forget: not forgetting {line}", file=sys.stderr)
            print("kvgate index forget: nothing forgotten (--force to override)", file=sys.stderr)
            return 2
        chosen = [by_id[rid] for rid in dict.fromkeys(args.replicas)]
    code = 0
    for info in chosen:
        rid = info.replica
        if args.dry_run:
            print(f"would forget {rid}: {_summary(info, len(keys[rid]))}")
            continue
        result = await index.forget_replica(
            rid, keys[rid], now_ms=clock.now_ms(), idle_ms=idle_ms, force=args.force
        )
        if result.refused:  # it came back since the look above
            why = {
                "registered": "it registered just now",
                "recent": "its meta was updated just now",
            }.get(result.refused) or _active(result, clock.now_ms(), args.idle_for)
            print(f"kvgate index forget: not forgetting {rid}: {why}", file=sys.stderr)
            code = 2
            continue
        print(f"forgot {rid}: {_summary(info, result.unlinked)}")
    return code
