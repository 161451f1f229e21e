"""API keys -> tenants. Keys are stored only as SHA-256 hex digests.

Sources: a YAML/JSON file (``keys: [{sha256: <hex>, tenant: <name>}]`` or a plain mapping
``<hex>: <name>``) and/or a Redis hash ``<prefix>:apikeys`` (field = hex digest, value =
tenant), cached in the process for a few seconds so the hot path rarely pays a round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

log = logging.getLogger(__name__)

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
ANONYMOUS = "anonymous"


class KeyFileError(ValueError):
    """A malformed API key file."""


def hash_key(api_key: str) -> str:
    """The stored form of an API key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def parse_key_file(data: Any, source: str = "<keys>") -> dict[str, str]:
    """Validate a key file's content and return ``{sha256 hex: tenant}``."""
    entries: list[tuple[Any, Any]]
    if isinstance(data, Mapping) and "keys" in data:
        raw = data["keys"]
        if not isinstance(raw, list):
            raise KeyFileError(f"{source}: 'keys' must be a list")
        entries = []
        for i, item in enumerate(raw):
            if not isinstance(item, Mapping) or set(item) != {"sha256", "tenant"}:
                raise KeyFileError(f"{source}: keys[{i}] must have exactly sha256 and tenant")
            entries.append((item["sha256"], item["tenant"]))
    elif isinstance(data, Mapping):
        entries = list(data.items())
    else:
        raise KeyFileError(f"{source}: expected a mapping")
    out: dict[str, str] = {}
    for digest, tenant in entries:
        if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
            raise KeyFileError(f"{source}: {digest!r} is not a SHA-256 hex digest")
        if not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise KeyFileError(f"{source}: invalid tenant name {tenant!r}")
        out[digest.lower()] = tenant
    return out


def load_key_file(path: Path) -> dict[str, str]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise KeyFileError(f"{path}: {exc}") from None
    return parse_key_file(data, str(path))


class KeyStore:
    """Resolves a bearer token to a tenant, or None. Constant-time digest comparison is
    unnecessary here (lookup is by digest, and the digest of a guess reveals nothing), but
    the open-access mode is explicit so a misconfigured gateway does not silently open."""

    def __init__(
        self,
        keys: Mapping[str, str] | None = None,
        redis: Redis | RedisCluster | None = None,
        redis_hash: str = "kvg:apikeys",
        open_access: bool = False,
        cache_ttl_s: float = 5.0,
    ) -> None:
        self._keys = dict(keys or {})
        self._redis = redis
        self._redis_hash = redis_hash
        self.open_access = open_access
        self._cache_ttl = cache_ttl_s
        self._warned: set[str] = set()  # keys whose malformed tenant value was logged
        self._cache: dict[str, tuple[str | None, float]] = {}
        self.redis_errors = 0

    @property
    def configured(self) -> bool:
        return self.open_access or bool(self._keys) or self._redis is not None

    def replace_keys(self, keys: Mapping[str, str]) -> None:
        self._keys = dict(keys)

    async def tenant_for(self, authorization: str | None) -> str | None:
        if self.open_access:
            return ANONYMOUS
        token = _bearer(authorization)
        if token is None:
            return None
        digest = hash_key(token)
        tenant = self._keys.get(digest)
        if tenant is not None or self._redis is None:
            return tenant
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        try:
            raw = await self._redis.hget(self._redis_hash, digest)
        # RedisClusterException (no RedisError): a cluster client that reaches no node
        except (RedisError, RedisClusterException, OSError) as exc:
            self.redis_errors += 1
            log.warning("api key lookup in redis failed", extra={"error": str(exc)})
            return hit[0] if hit is not None else None
        # a value that is no UTF-8 is no tenant name either: refused below, not a 500
        value = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        tenant = value if isinstance(value, str) and _TENANT.match(value) else None
        if tenant is None and value is not None and digest not in self._warned:
            # refused like an unknown key: say which entry (never the key itself)
            if len(self._warned) < 10_000:
                self._warned.add(digest)
            log.warning(
                "api key hash entry's value is not a valid tenant name ([A-Za-z0-9._-]{1,64}):"
                " the key is refused",
                extra={"key_sha256": digest[:12], "hash": self._redis_hash},
            )
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (tenant, now + self._cache_ttl)
        return tenant


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_admin(provided: str | None, expected: str | None) -> bool:
    """Admin key check (constant time); no admin key configured means admin is closed."""
    if not expected:
        return False
    token = _bearer(provided) if provided and " " in provided else provided
    return token is not None and hmac.compare_digest(token.encode(), expected.encode())
