"""API keys -> tenants. Keys are stored only as SHA-256 hex digests.

Sources: a YAML/JSON file (``keys: [{sha256: <hex>, tenant: <name>}]`` or a plain mapping
``<hex>: <name>``), reloaded when it changes or on ``POST /admin/keys/reload``, and/or a
Redis hash ``<prefix>:apikeys`` (field = hex digest, value = tenant), cached in the process
for a few seconds so the hot path rarely pays a round trip.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import heapq
import hmac
import ipaddress
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from cachecore.index.redis import REDIS_FAILURES
from cachecore.tasks import cancel_and_wait
from gateway.filewatch import SettledChange, file_version
from gateway.limits import TokenBucket
from policies.schema import TENANT_NAME as _TENANT  # one rule for keys and policy tenants

log = logging.getLogger(__name__)

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
ANONYMOUS = "anonymous"
_CACHE_MAX = 10_000  # Redis answers kept (a made-up key's refusal is one too)
_REDIS_RETRY_S = 1.0  # after a failed Redis lookup, the next one waits this long
# client addresses whose budget of refused lookups is tracked (least recently checked out
# first: an address dropped had its budget back anyway unless it was spent just now)
_ADDRESSES_MAX = 65_536
_SLOT_WAIT_S = 1.0  # how long a key Redis never confirmed waits for a lookup slot


class KeyFileError(ValueError):
    """A malformed API key file."""


class KeyCheckError(Exception):
    """A key the store did not resolve; ``reason`` (a metric label) when it was refused
    before any Redis lookup."""

    reason: str | None = None


class KeyStoreUnavailable(KeyCheckError):
    """The key cannot be checked: Redis cannot be asked, and no answer of it for this key is
    recent enough to stand in (the client gets a 503, not a 401: its key may be valid)."""


class KeyLookupsBusy(KeyStoreUnavailable):
    """Every Redis key lookup slot stayed taken for :data:`_SLOT_WAIT_S` (a flood of
    unknown keys from many addresses): a retryable 503, like Redis being unreachable."""

    reason = "lookup_cap"


class KeyLookupRefused(KeyCheckError):
    """The client's address has spent its budget of refused Redis lookups: an unknown key
    from it is not looked up (a 429 with ``retry_after_s``)."""

    reason = "miss_budget"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class KeyLookupRefusedGlobal(KeyLookupRefused):
    """All client addresses together have spent the budget of refused Redis lookups (a
    flood from many addresses): an unknown key is not looked up (a 429)."""

    reason = "miss_budget_global"


def hash_key(api_key: str) -> str:
    """The stored form of an API key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def parse_key_file(data: Any, source: str = "<keys>") -> dict[str, str]:
    """Validate a key file's content and return ``{sha256 hex: tenant}``."""
    entries: list[tuple[Any, Any]]
    if data is None:  # e.g. read between a truncation and the rewrite
        raise KeyFileError(f"{source}: the file is empty")
    if isinstance(data, Mapping) and "keys" in data:
        if len(data) > 1:  # the other entries would be ignored without a word
            raise KeyFileError(
                f"{source}: a 'keys' list and other top-level entries: use one form (a "
                "'keys' list, or a mapping of digests to tenants)"
            )
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
    for n, (digest, tenant) in enumerate(entries, 1):
        if not isinstance(digest, str) or not _HEX64.match(digest.lower()):
            # never the value: it may be the API key itself, pasted where its digest
            # belongs, and this message reaches the log and /admin/keys
            what = f"{len(digest)} characters" if isinstance(digest, str) else type(digest).__name__
            raise KeyFileError(
                f"{source}: entry {n} (tenant {tenant!r}) is not a SHA-256 hex digest ({what}, "
                "not shown): the file holds each key's sha256, never the key"
            )
        if tenant is None or isinstance(tenant, bool | int | float):
            raise KeyFileError(
                f"{source}: tenant name {tenant!r} of {digest.lower()[:12]}... was read as "
                f"{type(tenant).__name__} (YAML): quote it"
            )
        if not isinstance(tenant, str) or not _TENANT.match(tenant):
            raise KeyFileError(f"{source}: invalid tenant name {tenant!r}")
        known = out.setdefault(digest.lower(), tenant)
        if known != tenant:  # which tenant the key got would be the file order's accident
            raise KeyFileError(
                f"{source}: key {digest.lower()[:12]}... is listed twice, for tenants "
                f"{known!r} and {tenant!r}"
            )
    return out


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping key that comes twice with another value:
    PyYAML keeps the last without a word (a second ``keys:`` list dropped the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            value = value_node.value if isinstance(value_node, yaml.ScalarNode) else value_node
            if seen.setdefault(key_node.value, value) != value:
                # not the key: it may be an API key pasted where its digest belongs
                raise yaml.constructor.ConstructorError(
                    None, None, "a key is listed twice, for different tenants", key_node.start_mark
                )
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error without PyYAML's snippet of the offending line: the line may hold an API
    key pasted where its digest belongs, and this message reaches the log and /admin/keys."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return f"not YAML ({type(exc).__name__})"
    parts = [p for p in (exc.context, exc.problem) if p]
    mark = exc.problem_mark or exc.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{'; '.join(parts) or 'not YAML'}{where}"


def load_key_file(path: Path, finished: bool = False) -> dict[str, str]:
    """The file's keys. With ``finished`` (a reload of a file modified just now) a file
    whose last line has no end is refused: a write caught mid-line can end in a tenant name
    cut short ("acme" of "acme-prod") that names another tenant. A JSON file needs none
    (its brace ends it)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        if finished and text.strip() and not text.rstrip(" \t").endswith(("\n", "}", "]")):
            raise KeyFileError(
                f"{path}: the last line has no end (a write in progress?): end the file "
                "with a newline"
            )
        data = yaml.load(text, Loader=_StrictLoader)
    # ValueError: UnicodeDecodeError, a file that is no text (a binary file, a torn write)
    except KeyFileError:
        raise
    except yaml.YAMLError as exc:
        raise KeyFileError(f"{path}: {_yaml_problem(exc)}") from None
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{path}: {exc}") from None
    except RecursionError:  # PyYAML builds nested collections recursively
        raise KeyFileError(f"{path}: nested too deeply to be a key file") from None
    return parse_key_file(data, str(path))


@dataclass(frozen=True)
class KeyReload:
    """What a key file reload changed (counts of key digests)."""

    keys: int
    added: int
    removed: int
    retenanted: int

    def as_dict(self) -> dict[str, int]:
        return {
            "keys": self.keys,
            "added": self.added,
            "removed": self.removed,
            "retenanted": self.retenanted,
        }


class KeyStore:
    """Resolves a bearer token to a tenant, or None. Constant-time digest comparison is
    unnecessary here (lookup is by digest, and the digest of a guess reveals nothing), but
    the open-access mode is explicit so a misconfigured gateway does not silently open.

    With ``key_file`` the keys are read from it (unless ``keys`` is given) and
    :meth:`reload_file` reads it again: the new set replaces the old in one reference swap,
    so a lookup sees either set whole (keys added, removed and moved to another tenant
    together) and costs no more than before.

    ``owns_redis``: :meth:`close` closes ``redis`` (the client build_gateway made for the
    store); a client the caller passed in without it stays the caller's to close.

    ``redis_timeout_s``: how long one Redis lookup may take in all (None: as long as the
    client takes). A Cluster client retries a command that timed out and refreshes its view
    of the nodes first, so without it a lookup on a stalled shard waited 10+ timeouts."""

    def __init__(
        self,
        keys: Mapping[str, str] | None = None,
        redis: Redis | RedisCluster | None = None,
        redis_hash: str = "kvg:apikeys",
        open_access: bool = False,
        cache_ttl_s: float = 5.0,
        stale_s: float = 60.0,
        key_file: Path | None = None,
        miss_rate: float = 10.0,
        miss_burst: float = 100.0,
        lookups_max: int = 64,
        miss_rate_global: float = 1000.0,
        miss_burst_global: float = 1000.0,
        owns_redis: bool = False,
        redis_timeout_s: float | None = None,
    ) -> None:
        self.key_file = Path(key_file) if key_file is not None else None
        # taken before the read: a change during it shows as a new version next time
        self._watch = SettledChange(file_version(self.key_file))
        # a file modified longer ago than this is whole even if its last line has no end
        # (the watcher's poll interval, set by start)
        self.settle_s = 2.0
        if keys is None and self.key_file is not None:
            keys = load_key_file(self.key_file)
        self._keys = dict(keys or {})
        self._redis = redis
        self._owns_redis = owns_redis
        self._redis_timeout_s = redis_timeout_s
        self._redis_hash = redis_hash
        self.open_access = open_access
        self._cache_ttl = cache_ttl_s
        # how long after Redis last answered for a key that answer may stand in while
        # Redis cannot be asked (never less than the cache's own TTL)
        self._stale_bound = max(cache_ttl_s, stale_s)
        self._warned: set[str] = set()  # keys whose malformed tenant value was logged
        self._cache: dict[str, tuple[str | None, float]] = {}  # digest -> (tenant, at)
        self.redis_errors = 0
        self._retry_at = 0.0  # no Redis lookup before this (monotonic): it failed just now
        self._down_since: float | None = None  # the first failure of the current outage
        self.reloads = 0
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        # per client address, a budget of Redis lookups that Redis answered "no such key"
        # (0: none): a flood of made-up keys from one address is one HGET each no longer.
        # The global one bounds the rate of all addresses together (0: none).
        self._miss_rate = miss_rate
        self._miss_burst = max(1.0, miss_burst)
        self._misses: OrderedDict[str, TokenBucket] = OrderedDict()
        self._misses_global = (
            TokenBucket(miss_rate_global, max(1.0, miss_burst_global), time.monotonic())
            if miss_rate_global > 0
            else None
        )
        # Redis key lookups in flight, all addresses together; one per key (singleflight)
        self._slots = asyncio.Semaphore(lookups_max)
        self._lookups: dict[str, asyncio.Task[str | None]] = {}

    @property
    def configured(self) -> bool:
        return self.open_access or bool(self._keys) or self._redis is not None

    @property
    def file_keys(self) -> int:
        return len(self._keys)

    def has_tenant(self, tenant: str) -> bool:
        """Whether a key of the key file (or of the keys given) maps to ``tenant``; keys
        in Redis cannot be listed, so False says nothing of them."""
        return tenant in self._keys.values()

    def replace_keys(self, keys: Mapping[str, str]) -> KeyReload:
        new = dict(keys)
        old = self._keys
        self._keys = new  # the one swap: lookups see the old set or the new one, whole
        return KeyReload(
            keys=len(new),
            added=sum(1 for d in new if d not in old),
            removed=sum(1 for d in old if d not in new),
            retenanted=sum(1 for d, t in new.items() if d in old and old[d] != t),
        )

    def reload_file(self, settled: bool = False) -> KeyReload:
        """Read the key file again, apply it and log the outcome. Raises
        :class:`KeyFileError` (and keeps the old keys) on a file that cannot be read, is
        invalid or empty, or changed while it was read, or ends inside a line while it is
        new (``settled``: it has kept still for a poll interval, the watcher saw it)."""
        if self.key_file is None:
            raise KeyFileError("the gateway was started without an API key file (--api-keys)")
        before = file_version(self.key_file)
        self._watch.reading(before)
        # a last line with no end is a write caught mid-line only while the file is new:
        # one that has kept still for a poll interval (``settled``: the watcher saw it so)
        # is whole, as the start-up read took it (a Kubernetes secret made from a literal,
        # printf without its newline); else every later change of it was refused
        fresh = not settled and (before is None or time.time_ns() - before[0] < self.settle_s * 1e9)
        try:
            keys = load_key_file(self.key_file, finished=fresh)
            if file_version(self.key_file) != before:
                # a writer was at work: what was read may be a part (fewer keys, or a
                # tenant name cut short). The next look sees the new version and retries.
                raise KeyFileError(f"{self.key_file}: changed while it was read")
            if not keys and self._redis is None:
                # as at start-up: a key file with no key (and no Redis keys) opens nothing
                raise KeyFileError(f"{self.key_file}: no keys (every client would get 401)")
        except KeyFileError as exc:
            self.last_error = str(exc)
            log.error(
                "api key file reload refused; keeping the old keys",
                extra={"path": str(self.key_file), "error": str(exc), "keys": len(self._keys)},
            )
            raise
        result = self.replace_keys(keys)
        self.reloads += 1
        self.last_error = None
        log.info("api key file reloaded", extra={"path": str(self.key_file), **result.as_dict()})
        return result

    def poll_file(self) -> KeyReload | None:
        """One look at the file: reload it once it has changed and then kept still since
        the previous look (a writer that truncates and rewrites it in place is given that
        time to finish; an atomic replace, a rename over it, is as still as can be). None
        when nothing was applied; raises :class:`KeyFileError` on a refused reload."""
        if not self._watch.due(file_version(self.key_file)):
            return None
        return self.reload_file(settled=True)

    async def watch(
        self, interval_s: float, on_result: Callable[[KeyReload | None, str], None]
    ) -> None:
        """:meth:`poll_file` every ``interval_s``; ``on_result(reload, "")`` after a reload,
        ``(None, error)`` after a refused one (the old keys kept)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                result = self.poll_file()
            except KeyFileError as exc:  # logged by reload_file
                on_result(None, str(exc))
                continue
            except Exception as exc:  # a watcher that ended would never reload again
                log.exception("api key file reload failed; keeping the old keys")
                on_result(None, repr(exc))
                continue
            if result is not None:
                on_result(result, "")

    def start(self, interval_s: float, on_result: Callable[[KeyReload | None, str], None]) -> None:
        self.settle_s = interval_s
        if self._task is None and self.key_file is not None:
            self._task = asyncio.get_running_loop().create_task(self.watch(interval_s, on_result))

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def close(self) -> None:
        """Close the Redis client if the store owns it (``owns_redis``); Gateway.stop calls
        it last. Key lookups run before a request counts as in flight, in shielded tasks the
        drain does not wait for: one still in flight here fails as Redis down (a 503)."""
        if self._redis is None or not self._owns_redis:
            return
        try:
            await self._redis.aclose()
        except REDIS_FAILURES:  # Redis gone: nothing to close
            log.debug("api key redis close failed", exc_info=True)

    async def tenant_for(self, authorization: str | None, client: str | None = None) -> str | None:
        """The key's tenant, or None. ``client``: the peer address, whose budget of refused
        Redis lookups (and the global one) a key Redis refuses spends (None: no budget, an
        admin's request).

        Raises :class:`KeyLookupRefused` when the address has spent it
        (:class:`KeyLookupRefusedGlobal`: all addresses together have), and
        :class:`KeyStoreUnavailable` when the key cannot be checked now."""
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
        hit = self._cache.get(digest)  # (tenant or None, when Redis last answered for it)
        if hit is not None and now - hit[1] < self._cache_ttl:
            return hit[0]
        if now < self._retry_at:  # Redis failed a moment ago: not every request waits on it
            return self._without_redis(hit, now)
        lookup = self._lookups.get(digest)
        if lookup is None:
            confirmed = hit is not None and hit[0] is not None
            if confirmed and self._slots.locked():
                # a key Redis confirmed never queues behind unknown keys: its answer stands
                # in as it does while Redis is down (past the stale bound it waits its turn)
                assert hit is not None
                if now - hit[1] <= self._stale_bound:
                    return hit[0]
            budgets = () if confirmed or client is None else self._budgets(client)
            _check_budgets(budgets, now)  # a spent budget: 429 at once, no slot waited for
            lookup = asyncio.get_running_loop().create_task(self._lookup(digest, hit, budgets))
            self._lookups[digest] = lookup
            lookup.add_done_callback(functools.partial(self._lookup_done, digest))
        # shielded: a client that leaves does not cancel the answer the others wait for
        return await asyncio.shield(lookup)

    def _budgets(self, client: str) -> tuple[tuple[TokenBucket, type[KeyLookupRefused]], ...]:
        """The budgets of refused lookups an unknown key from ``client`` is checked against
        and, once Redis refuses it, spends: its address's (LRU table) and the global one."""
        out: list[tuple[TokenBucket, type[KeyLookupRefused]]] = []
        if self._miss_rate > 0:
            address = budget_address(client)
            bucket = self._misses.get(address)
            if bucket is None:
                bucket = TokenBucket(self._miss_rate, self._miss_burst, time.monotonic())
                self._misses[address] = bucket
                if len(self._misses) > _ADDRESSES_MAX:
                    self._misses.popitem(last=False)
            else:
                self._misses.move_to_end(address)
            out.append((bucket, KeyLookupRefused))
        if self._misses_global is not None:
            out.append((self._misses_global, KeyLookupRefusedGlobal))
        return tuple(out)

    @property
    def budget_addresses(self) -> int:
        """Client addresses whose budget of refused lookups is tracked (bounded)."""
        return len(self._misses)

    def _lookup_done(self, digest: str, task: asyncio.Task[str | None]) -> None:
        if self._lookups.get(digest) is task:
            del self._lookups[digest]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have left

    async def _lookup(
        self,
        digest: str,
        hit: tuple[str | None, float] | None,
        budgets: tuple[tuple[TokenBucket, type[KeyLookupRefused]], ...],
    ) -> str | None:
        """One Redis lookup in one of the slots; :class:`KeyLookupsBusy` when none frees
        within :data:`_SLOT_WAIT_S` (a burst of new clients waits, a flood is shed).

        ``budgets`` are checked again once the slot is held and spent only when Redis says
        "no such key": waiting for a slot holds none (a herd of valid keys from one address
        is never refused), and the lookups that can pass a check before an earlier one is
        spent are those in the slots, so a budget overshoots by the slot count at most."""
        try:
            async with asyncio.timeout(_SLOT_WAIT_S):
                await self._slots.acquire()
        except TimeoutError:
            raise KeyLookupsBusy(
                "too many API keys are being checked at once; retry later"
            ) from None
        try:
            _check_budgets(budgets, time.monotonic())
            tenant = await self._ask_redis(digest, hit)
            if tenant is None:
                # one refused lookup, taken even below zero: lookups in flight passed their
                # check before it (a debt of at most the slot count, repaid by the refill)
                now = time.monotonic()
                for bucket, _ in budgets:
                    bucket.charge(1.0, now)
            return tenant
        finally:
            self._slots.release()

    async def _ask_redis(self, digest: str, hit: tuple[str | None, float] | None) -> str | None:
        assert self._redis is not None
        now = time.monotonic()
        try:
            # the client's own retries (kept: they reconnect a connection Redis closed)
            # and a Cluster client's topology refresh all within the one deadline
            async with asyncio.timeout(self._redis_timeout_s):
                raw = await self._redis.hget(self._redis_hash, digest)
        # REDIS_FAILURES holds RedisClusterException (no RedisError: a cluster client that
        # reaches no node) and OSError (the deadline's TimeoutError)
        except REDIS_FAILURES as exc:
            self.redis_errors += 1
            failed_at = time.monotonic()
            self._retry_at = failed_at + _REDIS_RETRY_S
            if self._down_since is None:  # once per outage, not per request
                self._down_since = failed_at
                log.warning(
                    "api key lookups in redis fail: each key's last answer stands in for"
                    " up to KVGATE_API_KEYS_STALE_S after redis gave it, then the key fails"
                    " closed (503)",
                    extra={"error": str(exc), "stale_s": self._stale_bound},
                )
            return self._without_redis(hit, failed_at)
        if self._down_since is not None:
            log.info(
                "api key lookups in redis answer again",
                extra={"down_s": round(time.monotonic() - self._down_since, 3)},
            )
            self._down_since = None
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
        if len(self._cache) > _CACHE_MAX:
            self._prune(now)
        self._cache[digest] = (tenant, now)
        return tenant

    def _without_redis(self, hit: tuple[str | None, float] | None, now: float) -> str | None:
        """Redis cannot be asked: its last answer for the key stands in for a while (a
        Redis restart is no outage for the clients); past that the key fails closed, so
        no key (revoked meanwhile or not) works on an answer older than the bound."""
        if hit is not None and now - hit[1] <= self._stale_bound:
            return hit[0]
        raise KeyStoreUnavailable(
            "the API key cannot be checked now (the key store is unreachable); retry later"
        )

    def _prune(self, now: float) -> None:
        """Drop the cached refusals and the answers too old to stand in for Redis: anyone
        can fill the cache with made-up keys, and emptying it whole dropped the valid keys'
        answers too (every client's key then failed at once while Redis was away). More
        valid answers than half the cache (many clients): the newest half stays, never
        none. Half empty at least afterwards, so pruning costs O(1) per lookup over time."""
        keep = [
            (d, hit)
            for d, hit in self._cache.items()
            if hit[0] is not None and now - hit[1] <= self._stale_bound
        ]
        if len(keep) > _CACHE_MAX // 2:
            keep = heapq.nlargest(_CACHE_MAX // 2, keep, key=_answered_at)
        self._cache = dict(keep)


def _check_budgets(
    budgets: tuple[tuple[TokenBucket, type[KeyLookupRefused]], ...], now: float
) -> None:
    """Raise the budget's refusal when one has less than a lookup left (nothing taken)."""
    for bucket, refusal in budgets:
        wait = bucket.wait_s(1.0, now)
        if wait:
            what = "from this address" if refusal is KeyLookupRefused else "from all clients"
            raise refusal(f"too many unknown API keys {what}; retry later", wait)


def _answered_at(entry: tuple[str, tuple[str | None, float]]) -> float:
    return entry[1][1]


def budget_address(client: str) -> str:
    """The address a budget of refused lookups belongs to: an IPv6 client's /64 (a host
    is commonly given a whole /64, and counted per address it could send every request
    from another), an IPv4-mapped IPv6 address as IPv4, anything else as it is."""
    try:
        ip = ipaddress.ip_address(client)
    except ValueError:
        return client
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return client


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_admin(provided: str | None, expected: str | None) -> bool:
    """Admin key check (constant time); no admin key configured means admin is closed."""
    if not expected or not provided:
        return False
    want = expected.encode()
    # as sent, or as a bearer token: both compared (a key may hold a space itself)
    bearer = _bearer(provided) if " " in provided else None
    as_sent = hmac.compare_digest(provided.encode(), want)
    return as_sent or (bearer is not None and hmac.compare_digest(bearer.encode(), want))
