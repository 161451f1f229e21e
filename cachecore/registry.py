"""Replica registration and discovery, with an operator allowlist.

Agents register their replica (engine URL, model, block size, capacity, DP rank, agent id)
with a heartbeat TTL and refresh it well within the TTL. On a clean shutdown an agent whose
engine still serves hands its registration over (:meth:`RegistryStore.hand_over`: it stays
for a bounded window, for the replica's next agent to overwrite without a gap), and one
whose engine is gone deregisters it; either only while the registration is its own.
Gateways discover registrations and accept one ONLY if its URL is in the operator-declared
allowlist (:class:`ReplicaAllowlist`): an agent's credentials let it write its own replica's
registration, but a rogue agent must not be able to point the gateway at an attacker's URL
and receive prompts. An allowlist entry may also pin the replica id (``id=URL``), which stops
a compromised agent from claiming another declared replica's URL.

Registrations are untrusted input: they are validated (:class:`Registration`) and malformed
ones are skipped and counted, never raised to the caller.

Stores: :class:`MemoryRegistry` (embedded mode; expiry by the caller's ``now_ms``) and
:class:`RedisRegistry` (``kvg:{r:<id>}:reg``, a JSON string written with ``SET PX``, so the
Redis TTL is authoritative and agent/gateway clock skew does not matter).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cachecore.index.base import IndexError_
from cachecore.index.layout import (
    REPLICA_ID_PATTERN,
    KeyLayout,
    split_dp_replica_id,
    validate_replica_id,
)
from cachecore.index.redis import REDIS_FAILURES, RedisClient, RedisScript, redis_client
from cachecore.urls import split_user_info, url_host

MAX_REGISTRATION_BYTES = 4096
DEFAULT_REGISTRATION_TTL_MS = 10_000


class RegistryError(IndexError_):
    """The registry store failed."""


class InvalidURLError(ValueError):
    """A replica URL that is not a plain http(s)://host[:port][/path]."""


def normalize_url(url: str) -> str:
    """Canonical form used to compare URLs with the allowlist: lower-case scheme and host,
    explicit port, no trailing slash. An IPv6 zone id keeps its case (interface names are
    case-sensitive) and is written bare, ``[fe80::1%eth0]``, RFC 6874's ``%25eth0`` read as
    the same (:func:`~cachecore.urls.url_host`: ``%25`` is always the encoded delimiter, so
    a zone id that begins with ``25``, which has no bare form, and an empty one are
    refused). User info, query and fragment are refused
    (they are the usual ways to make a URL look like another)."""
    info = split_user_info(url)  # errors are logged and answered: never the password
    if info is not None:
        raise InvalidURLError(f"URL must not carry user info: {info.redacted!r}")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise InvalidURLError(f"bad URL {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidURLError(f"URL scheme must be http or https: {url!r}")
    if parts.query or parts.fragment:
        raise InvalidURLError(f"URL must not carry a query or fragment: {url!r}")
    host = parts.hostname or ""  # lower-cased, zone id and all
    if not host:
        raise InvalidURLError(f"URL has no host: {url!r}")
    if parts.netloc.startswith("["):  # an IPv6 literal as written: only its address lowered
        address, pct, zone_id = parts.netloc[1 : parts.netloc.index("]")].partition("%")
        try:
            host = url_host(f"[{address.lower()}{pct}{zone_id}]", zone="bare")
        except ValueError as exc:  # a zone id with no bare form that reads back as itself
            raise InvalidURLError(f"bad URL {url!r}: {exc}") from None
    if port is None:
        port = 443 if scheme == "https" else 80
    path = parts.path.rstrip("/")
    return f"{scheme}://{host}:{port}{path}"


class Registration(BaseModel):
    """One replica's registration, as its agent writes it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    replica_id: str = Field(pattern="^" + REPLICA_ID_PATTERN + "$")
    url: str = Field(max_length=512)
    model: str = Field(min_length=1, max_length=256)
    block_size: int = Field(ge=1, le=4096)
    capacity_blocks: int = Field(ge=0)
    dp_rank: int | None = Field(default=None, ge=0, le=4096)
    agent_id: str = Field(pattern="^" + REPLICA_ID_PATTERN + "$")
    registered_ms: int = Field(ge=0)

    @field_validator("url")
    @classmethod
    def _url_is_plain(cls, v: str) -> str:
        normalize_url(v)  # raises InvalidURLError (a ValueError: pydantic reports it)
        return v

    @property
    def normalized_url(self) -> str:
        return normalize_url(self.url)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Registration:
        """Parse untrusted bytes; raises ValueError (pydantic's ValidationError is one)."""
        if len(raw) > MAX_REGISTRATION_BYTES:
            raise ValueError("registration too large")
        return cls.model_validate_json(raw)


@dataclass(frozen=True, slots=True)
class Rejection:
    replica_id: str
    url: str
    # "not_allowlisted" | "pinned_to_other_id" | "rank_mismatch" | "url_conflict" | "bad_url"
    reason: str


class ReplicaAllowlist:
    """Operator-declared replica URLs; ``id=URL`` entries also pin the replica id. A pin
    names an engine: ``R`` (or ``R@dpN``) at a URL admits that engine's data-parallel
    ranks there too, ``R`` and ``R@dpN`` (its agents' ids), and no other id."""

    def __init__(self, specs: Iterable[str]) -> None:
        self._urls: set[str] = set()
        self._pinned: dict[str, set[str]] = {}  # normalized URL -> pinned engine names
        for spec in specs:
            spec = spec.strip()
            if not spec:
                continue
            rid, sep, url = spec.partition("=")
            if sep and "://" not in rid:
                norm = normalize_url(url)
                name = split_dp_replica_id(validate_replica_id(rid))[0]
                self._pinned.setdefault(norm, set()).add(name)
            else:
                norm = normalize_url(spec)
            self._urls.add(norm)

    def __len__(self) -> int:
        return len(self._urls)

    def allows(self, reg: Registration) -> str | None:
        """None if ``reg`` is acceptable, else the rejection reason."""
        try:
            norm = reg.normalized_url
        except InvalidURLError:
            return "bad_url"
        if norm not in self._urls:
            return "not_allowlisted"
        name, rank = split_dp_replica_id(reg.replica_id)
        if (rank or 0) != (reg.dp_rank or 0):
            return "rank_mismatch"  # an agent's id carries its rank (index_replica_id)
        pinned = self._pinned.get(norm)
        if pinned is not None and name not in pinned:
            return "pinned_to_other_id"
        return None

    def accept(
        self, registrations: Iterable[Registration]
    ) -> tuple[list[Registration], list[Rejection]]:
        """Split into accepted and rejected. Two registrations claiming the same URL and DP
        rank cannot both be right: both are rejected (pin the ids to resolve it). Logging
        the rejections is the caller's (discovery logs each once while it persists)."""
        ok: list[Registration] = []
        rejected: list[Rejection] = []
        for reg in registrations:
            reason = self.allows(reg)
            if reason is None:
                ok.append(reg)
            else:
                rejected.append(Rejection(reg.replica_id, reg.url, reason))
        claims: dict[tuple[str, int], list[Registration]] = {}
        for reg in ok:
            # no rank is rank 0 (as allows() reads it): one engine, one claim
            claims.setdefault((reg.normalized_url, reg.dp_rank or 0), []).append(reg)
        accepted: list[Registration] = []
        for regs in claims.values():
            if len(regs) == 1:
                accepted.append(regs[0])
            else:
                rejected.extend(Rejection(r.replica_id, r.url, "url_conflict") for r in regs)
        accepted.sort(key=lambda r: r.replica_id)
        return accepted, rejected


@runtime_checkable
class RegistryStore(Protocol):
    malformed: int  # registrations skipped because they did not validate

    async def register(self, reg: Registration, ttl_ms: int, now_ms: int) -> None:
        """Agent: (re)write its registration, valid for ``ttl_ms``; call again as the
        heartbeat."""
        ...

    async def deregister(self, replica_id: str, agent_id: str) -> bool:
        """Agent, on clean shutdown: remove the registration if it is still its own."""
        ...

    async def hand_over(self, replica_id: str, agent_id: str, ttl_ms: int, now_ms: int) -> bool:
        """Agent, on a clean shutdown while its engine serves: keep the registration for
        ``ttl_ms`` from now (shortened or lengthened), if it is still its own, so the
        replica's next agent takes it over (its first heartbeat overwrites it) with no
        gap in discovery. False when it is another agent's (a successor already
        registered) or gone."""
        ...

    async def discover(
        self, now_ms: int, replica_ids: Sequence[str] | None = None
    ) -> list[Registration]:
        """Gateway: every valid unexpired registration (of ``replica_ids``, or all). Not
        filtered by the allowlist: pass the result to :meth:`ReplicaAllowlist.accept`."""
        ...

    async def close(self) -> None: ...


class MemoryRegistry:
    """In-process :class:`RegistryStore`."""

    def __init__(self) -> None:
        self._regs: dict[str, tuple[bytes, int]] = {}  # id -> (json, expires_ms)
        self.malformed = 0

    async def register(self, reg: Registration, ttl_ms: int, now_ms: int) -> None:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        self._regs[reg.replica_id] = (reg.to_json(), now_ms + ttl_ms)

    def put_raw(self, replica_id: str, raw: bytes, expires_ms: int) -> None:
        """Store raw bytes as a registration (tests: a rogue or broken agent)."""
        self._regs[validate_replica_id(replica_id)] = (raw, expires_ms)

    def _owned(self, replica_id: str, agent_id: str) -> tuple[bytes, int] | None:
        """``replica_id``'s registration (raw, expiry ms) if ``agent_id`` wrote it."""
        cur = self._regs.get(replica_id)
        if cur is None:
            return None
        try:
            owner = Registration.from_json(cur[0]).agent_id
        except ValueError:
            return None
        return cur if owner == agent_id else None

    async def deregister(self, replica_id: str, agent_id: str) -> bool:
        if self._owned(replica_id, agent_id) is None:
            return False
        del self._regs[replica_id]
        return True

    async def hand_over(self, replica_id: str, agent_id: str, ttl_ms: int, now_ms: int) -> bool:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        cur = self._owned(replica_id, agent_id)
        if cur is None or cur[1] <= now_ms:
            return False
        self._regs[replica_id] = (cur[0], now_ms + ttl_ms)
        return True

    async def discover(
        self, now_ms: int, replica_ids: Sequence[str] | None = None
    ) -> list[Registration]:
        ids = sorted(self._regs) if replica_ids is None else list(replica_ids)
        out: list[Registration] = []
        for rid in ids:
            item = self._regs.get(rid)
            if item is None or item[1] <= now_ms:
                continue
            reg = _parse(item[0], rid)
            if reg is None:
                self.malformed += 1
            else:
                out.append(reg)
        return out

    async def close(self) -> None:
        return None


# KEYS[1] reg key. ARGV[1] agent id. Delete only our own registration.
_DEREGISTER_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, reg = pcall(cjson.decode, raw)
if ok and type(reg) == 'table' and reg['agent_id'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] reg key. ARGV[1] agent id, ARGV[2] TTL ms. Set the TTL of our own registration
# only: a successor that registered already keeps its own TTL (its heartbeats renew it).
_HAND_OVER_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, reg = pcall(cjson.decode, raw)
if ok and type(reg) == 'table' and reg['agent_id'] == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisRegistry:
    """:class:`RegistryStore` on Redis (``kvg:{r:<id>}:reg``)."""

    def __init__(self, client: RedisClient, layout: KeyLayout | None = None) -> None:
        self.client = client
        self.layout = layout or KeyLayout()
        self.malformed = 0
        self._deregister = RedisScript(_DEREGISTER_LUA)
        self._hand_over = RedisScript(_HAND_OVER_LUA)

    @classmethod
    def from_url(
        cls,
        url: str,
        layout: KeyLayout | None = None,
        *,
        cluster: bool = False,
        socket_timeout_s: float = 1.0,
        connect_timeout_s: float = 1.0,
    ) -> RedisRegistry:
        """Connect to ``redis://...``, or with ``cluster`` to the Redis Cluster it seeds
        (``discover`` then scans every primary: redis-py's cluster ``scan_iter`` does). The
        timeouts bound one heartbeat or discovery poll (each is retried at the next one);
        a correctness test's are patient."""
        client = redis_client(
            url,
            cluster=cluster,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        return cls(client, layout)

    async def register(self, reg: Registration, ttl_ms: int, now_ms: int) -> None:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        try:
            await self.client.set(
                self.layout.registration(reg.replica_id), reg.to_json(), px=ttl_ms
            )
        except REDIS_FAILURES as exc:
            raise RegistryError(f"register {reg.replica_id}: {exc}") from exc

    async def deregister(self, replica_id: str, agent_id: str) -> bool:
        key = self.layout.registration(replica_id)
        try:
            return bool(await self._deregister.call(self.client, [key], [agent_id]))
        except REDIS_FAILURES as exc:
            raise RegistryError(f"deregister {replica_id}: {exc}") from exc

    async def hand_over(self, replica_id: str, agent_id: str, ttl_ms: int, now_ms: int) -> bool:
        if ttl_ms <= 0:
            raise ValueError("ttl_ms must be positive")
        key = self.layout.registration(replica_id)
        try:  # the TTL on Redis's clock, as register's SET PX: now_ms is not needed
            return bool(await self._hand_over.call(self.client, [key], [agent_id, ttl_ms]))
        except REDIS_FAILURES as exc:
            raise RegistryError(f"hand over {replica_id}: {exc}") from exc

    async def discover(
        self, now_ms: int, replica_ids: Sequence[str] | None = None
    ) -> list[Registration]:
        try:
            if replica_ids is None:
                keys = [
                    k
                    async for k in self.client.scan_iter(
                        match=self.layout.registration_pattern(), count=1000
                    )
                ]
                keys.sort()
            else:
                keys = [self.layout.registration(r).encode() for r in replica_ids]
            if not keys:
                return []
            pipe = self.client.pipeline(transaction=False)  # GETs: cluster-safe, one trip
            for k in keys:
                pipe.get(k)
            # each GET's own error: an agent may turn its own reg key into a hash (its ACL
            # allows DEL and HSET there), which must not fail every replica's discovery
            values = await pipe.execute(raise_on_error=False)
            for raw in values:
                if isinstance(raw, Exception) and not str(raw).startswith("WRONGTYPE"):
                    raise raw
        except REDIS_FAILURES as exc:
            raise RegistryError(f"discover: {exc}") from exc
        out: list[Registration] = []
        for k, raw in zip(keys, values, strict=True):
            if raw is None:
                continue
            if isinstance(raw, Exception):  # WRONGTYPE: no registration a gateway can read
                self.malformed += 1
                continue
            parsed = self.layout.parse(k.decode() if isinstance(k, bytes) else k)
            reg = _parse(raw, parsed[0] if parsed else None)
            if reg is None:
                self.malformed += 1
            else:
                out.append(reg)
        return out

    async def close(self) -> None:
        with contextlib.suppress(*REDIS_FAILURES):
            await self.client.aclose()


def _parse(raw: bytes, key_replica: str | None) -> Registration | None:
    """A validated registration whose id matches the key it was stored under, else None."""
    try:
        reg = Registration.from_json(raw)
    except (ValueError, ValidationError, json.JSONDecodeError):
        return None
    if key_replica is not None and reg.replica_id != key_replica:
        return None
    return reg
