"""The Redis key layout: the one place that names every Redis key kvgate uses.

Every key of a replica shares the hash tag ``{r:<id>}``, so on Redis Cluster all of them live
in one hash slot (one shard) and a replica's atomic scripts never cross slots::

    kvg:{r:<id>}:meta          hash    epoch, state, last_seq, engine_start, updated_ms,
                                       rm_floor                                          (agent)
    kvg:{r:<id>}:b:<epoch>     hash    16-byte block key -> tier bits                    (agent)
    kvg:{r:<id>}:m:<epoch>     hash    engine hash (8 bytes BE) -> mirror record         (agent)
    kvg:{r:<id>}:rm:<epoch>    zset    removed block key -> ms of its removal (capped)   (agent)
    kvg:{r:<id>}:reg           string  registration JSON, SET PX (heartbeat TTL)         (agent)
    kvg:{r:<id>}:load          hash    engine load (running, waiting, kv usage), PEXPIRE (agent)
    kvg:{r:<id>}:gw:p:<epoch>  zset    pending block key -> expiry ms, PEXPIRE            (gateway)
    kvg:{r:<id>}:gw:inflight   hash    <gateway id>:req|tok|exp -> in-flight counts       (gateway)

``(agent)`` keys are written by the replica's cache agent only; its Redis ACL user may read
and write exactly those keys of its own replica (:func:`agent_acl_rules`) and nothing under
``gw:``. ``(gateway)`` keys are written by gateways (:func:`gateway_acl_rules`), which read
everything. Pending entries are epoch-scoped too, so clearing a replica (a new epoch) drops
them without the agent touching a gateway-owned key.

Replica ids are opaque strings matching ``[A-Za-z0-9._@-]{1,64}`` (a DP rank is encoded by the
agent as ``name@dpN``). The alphabet excludes ``{``, ``}``, ``:``, ``*``, ``?``, ``[`` and ``\\``,
so one replica's ACL glob can never match another replica's keys and ids cannot break the tag.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from redis.crc import key_slot

REPLICA_ID_PATTERN = r"[A-Za-z0-9._@-]{1,64}"
_REPLICA_ID_RE = re.compile(REPLICA_ID_PATTERN + r"\Z")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_-]{1,32}\Z")
DEFAULT_PREFIX = "kvg"
CLUSTER_SLOTS = 16384


class InvalidReplicaIdError(ValueError):
    """A replica id outside ``[A-Za-z0-9._@-]{1,64}``."""


def validate_replica_id(replica: str) -> str:
    """Return ``replica`` unchanged if it is a valid replica id, else raise."""
    if not isinstance(replica, str) or _REPLICA_ID_RE.match(replica) is None:
        raise InvalidReplicaIdError(f"invalid replica id {replica!r}")
    return replica


def dp_replica_id(name: str, dp_rank: int | None) -> str:
    """The replica id of one data-parallel rank of an engine (``name@dpN``)."""
    rid = name if dp_rank is None else f"{name}@dp{dp_rank}"
    return validate_replica_id(rid)


_DP_SUFFIX_RE = re.compile(r"(.+)@dp([1-9][0-9]{0,3})\Z")


def split_dp_replica_id(replica: str) -> tuple[str, int | None]:
    """``(name, rank)`` of an id the agents make for a rank (``index_replica_id``):
    ``("R", 2)`` for ``R@dp2``, ``(replica, None)`` for any other id. Rank 0 is ``R``
    itself, so ``R@dp0`` is an ordinary id (an agent whose id it is indexes under it)."""
    m = _DP_SUFFIX_RE.match(replica)
    return (m.group(1), int(m.group(2))) if m else (replica, None)


# ------------------------------------------------------------------------- engine hashes

_U64 = 1 << 64
_WIDE_MARK = b"i"
_WIDE_BYTES = 17


def engine_hash_field(h: int) -> bytes:
    """An engine block hash as a mirror-hash field: 8 bytes big-endian for the usual
    unsigned 64-bit hashes, and a marked 18-byte signed form for anything else (older vLLM
    builtin hashes can be negative), so the mapping is exact both ways."""
    if 0 <= h < _U64:
        return h.to_bytes(8, "big")
    try:
        return _WIDE_MARK + h.to_bytes(_WIDE_BYTES, "big", signed=True)
    except OverflowError:
        raise ValueError(f"engine hash out of range: {h}") from None


def engine_hash_fields(hashes: Collection[int]) -> list[bytes]:
    """:func:`engine_hash_field` of each hash, in order (without a call per hash when
    every hash is a usual unsigned 64-bit one: the agent encodes one per block it writes)."""
    if hashes and min(hashes) >= 0 and max(hashes) < _U64:
        return [h.to_bytes(8, "big") for h in hashes]
    return [engine_hash_field(h) for h in hashes]


def engine_hash_from_field(raw: bytes) -> int:
    if len(raw) == 8:
        return int.from_bytes(raw, "big")
    if len(raw) == _WIDE_BYTES + 1 and raw[:1] == _WIDE_MARK:
        return int.from_bytes(raw[1:], "big", signed=True)
    raise ValueError(f"bad engine hash field of {len(raw)} bytes")


# ----------------------------------------------------------------------------- key names


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Key names under one namespace ``prefix`` (default ``kvg``; tests and benchmarks use
    their own so they never collide with a live deployment)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if _PREFIX_RE.match(self.prefix) is None:
            raise ValueError(f"invalid key prefix {self.prefix!r}")

    def tag(self, replica: str) -> str:
        """``kvg:{r:<id>}:``, the common head of every key of ``replica``."""
        return f"{self.prefix}:{{r:{validate_replica_id(replica)}}}:"

    def meta(self, replica: str) -> str:
        return self.tag(replica) + "meta"

    def blocks(self, replica: str, epoch: int) -> str:
        return f"{self.tag(replica)}b:{epoch}"

    def mirror(self, replica: str, epoch: int) -> str:
        return f"{self.tag(replica)}m:{epoch}"

    def removals(self, replica: str, epoch: int) -> str:
        return f"{self.tag(replica)}rm:{epoch}"

    def registration(self, replica: str) -> str:
        return self.tag(replica) + "reg"

    def load(self, replica: str) -> str:
        return self.tag(replica) + "load"

    def pending(self, replica: str, epoch: int) -> str:
        return f"{self.tag(replica)}gw:p:{epoch}"

    def pending_anchor(self, replica: str) -> str:
        """``kvg:{r:<id>}:gw:p``: the key a pending write declares (a gateway may only
        declare keys it can write); the script appends ``:<epoch>``. Never created."""
        return self.tag(replica) + "gw:p"

    def inflight(self, replica: str) -> str:
        return self.tag(replica) + "gw:inflight"

    # Scripts derive the b:/m:/gw:p: names from the meta (or pending anchor) key and the
    # epoch they read there, so no caller can name a stale epoch's key.

    # ---- scanning
    def api_keys(self) -> str:
        """The gateways' API key hash (field: the key's SHA-256 hex, value: the tenant)."""
        return f"{self.prefix}:apikeys"

    def meta_pattern(self) -> str:
        return f"{self.prefix}:{{r:*}}:meta"

    def registration_pattern(self) -> str:
        return f"{self.prefix}:{{r:*}}:reg"

    def replica_keys_pattern(self) -> str:
        """Matches every key of every replica (``kvgate index`` groups them by replica)."""
        return f"{self.prefix}:{{r:*}}:*"

    def epoch_keys_pattern(self) -> str:
        """Matches every epoch-scoped key (b:, m:, rm:, gw:p:) of every replica."""
        return f"{self.prefix}:{{r:*}}:*:*"

    def parse(self, key: str) -> tuple[str, str, int | None] | None:
        """``(replica, kind, epoch)`` of a key of this layout (kind is ``meta``, ``b``, ``m``,
        ``rm``, ``reg``, ``load``, ``gw:p`` or ``gw:inflight``), or None for a foreign key."""
        head = f"{self.prefix}:{{r:"
        if not key.startswith(head):
            return None
        end = key.find("}:", len(head))
        if end < 0:
            return None
        replica, rest = key[len(head) : end], key[end + 2 :]
        if _REPLICA_ID_RE.match(replica) is None:
            return None
        for kind in ("b", "m", "rm", "gw:p"):
            if rest.startswith(kind + ":"):
                tail = rest[len(kind) + 1 :]
                return (replica, kind, int(tail)) if tail.isdigit() else None
        if rest in ("meta", "reg", "load", "gw:inflight"):
            return replica, rest, None
        return None

    # ---- cluster
    def slot(self, replica: str) -> int:
        """The Redis Cluster hash slot of every key of ``replica`` (CRC16 of the tag)."""
        return int(key_slot(self.meta(replica).encode()))


def group_by_shard(
    replicas: Iterable[str], layout: KeyLayout, shard_of_slot: Callable[[int], str]
) -> dict[str, list[str]]:
    """Group replicas by the shard that owns their hash slot, keeping request order within a
    group: on Redis Cluster a lookup sends one script call per group, concurrently.
    ``shard_of_slot`` maps a slot to a shard name (the node's ``host:port``)."""
    groups: dict[str, list[str]] = {}
    for rid in replicas:
        groups.setdefault(shard_of_slot(layout.slot(rid)), []).append(rid)
    return groups


# ----------------------------------------------------------------------------------- ACLs

# Commands an agent needs: its own scripts (apply, clear, mirror load), plain reads of its
# keys for resync and debugging, registration/load writes, and INFO for Redis run_id (a
# changed run_id means Redis restarted and the agent must rewrite its mirror) and for
# maxmemory_policy (allkeys-* evicts the index: agents and gateways warn). No CONFIG: its
# GET reads passwords too (RedisIndex.eviction_policies reads INFO first). On Redis
# Cluster, redis-py's client loads the slot map (CLUSTER SLOTS) and the command table
# (COMMAND) when it connects, and reports "cluster mode is not enabled" when refused.
_CLUSTER_CLIENT_COMMANDS: tuple[str, ...] = ("+cluster|slots", "+command")
_AGENT_COMMANDS: tuple[str, ...] = (
    *_CLUSTER_CLIENT_COMMANDS,
    "+ping", "+hello", "+client|setname", "+client|id", "+select", "+info",
    "+evalsha", "+eval", "+evalsha_ro", "+eval_ro", "+script|load", "+script|exists",
    "+hset", "+hget", "+hmget", "+hgetall", "+hscan", "+hdel", "+hlen", "+hincrby", "+hexists",
    "+zadd", "+zcard", "+zrange", "+zremrangebyrank",
    "+get", "+set", "+del", "+unlink", "+exists", "+pexpire", "+expire", "+pttl", "+time",
)  # fmt: skip
_GATEWAY_COMMANDS: tuple[str, ...] = (
    *_CLUSTER_CLIENT_COMMANDS,
    "+ping", "+hello", "+client|setname", "+client|id", "+select", "+info",
    "+evalsha", "+eval", "+evalsha_ro", "+eval_ro", "+script|load", "+script|exists",
    "+scan", "+time",
    "+get", "+mget", "+exists", "+pttl", "+hget", "+hmget", "+hgetall", "+hscan", "+hlen",
    "+zscore", "+zmscore", "+zcard", "+zrange",
    "+zadd", "+zremrangebyscore", "+zremrangebyrank", "+hset", "+hincrby", "+hdel",
    "+pexpire", "+del", "+unlink",
)  # fmt: skip


def agent_acl_rules(replica: str, layout: KeyLayout | None = None) -> list[str]:
    """ACL rules (Redis >= 7.0) for the agent of ``replica``: read/write on its own meta,
    b:*, m:*, rm:*, reg and load keys, nothing else (in particular not ``gw:*`` and no other
    replica). Use as ``ACL SETUSER <name> on ><password> resetkeys resetchannels -@all
    <rules...>``. Redis checks these on every command a Lua script issues too."""
    lay = layout or KeyLayout()
    tag = lay.tag(replica)
    keys = [f"%RW~{tag}{suffix}" for suffix in ("meta", "b:*", "m:*", "rm:*", "reg", "load")]
    return ["resetkeys", "resetchannels", "-@all", *_AGENT_COMMANDS, *keys]


def gateway_acl_rules(layout: KeyLayout | None = None, sweeper: bool = False) -> list[str]:
    """ACL rules for a gateway: read every kvgate key, write only gateway-owned keys
    (``gw:*``). With ``sweeper`` it may also delete agents' old-epoch keys (the orphan
    sweeper, :meth:`cachecore.index.redis.RedisIndex.sweep_orphans`)."""
    lay = layout or KeyLayout()
    keys = [f"%R~{lay.prefix}:*", f"%RW~{lay.prefix}:{{r:*}}:gw:*"]
    if sweeper:
        keys.append(f"%RW~{lay.prefix}:*")
    return ["resetkeys", "resetchannels", "-@all", *_GATEWAY_COMMANDS, *keys]


def acl_setuser_args(user: str, password: str, rules: Sequence[str]) -> list[str]:
    """Arguments of ``ACL SETUSER`` creating an enabled user with one password."""
    if not re.match(r"[A-Za-z0-9._@-]{1,128}\Z", user):
        raise ValueError(f"invalid ACL user name {user!r}")
    return ["ACL", "SETUSER", user, "reset", "on", f">{password}", *rules]
