"""Shared per-replica load state: what every gateway process needs to see the same queue.

Two sources feed one :class:`LoadRecord` per replica:

* the replica's agent publishes the engine's own load (running and waiting requests, KV
  usage, scraped from vLLM's ``/metrics``) with :meth:`LoadStore.publish_engine`;
* every gateway process adds and subtracts what it dispatched and has not yet seen finish
  (requests in flight, prefill tokens in flight) under its own gateway id with
  :meth:`LoadStore.add_inflight`, and keeps those counts alive with
  :meth:`LoadStore.heartbeat`. A gateway that crashes stops heartbeating; once its liveness
  lapses (``gateway_ttl_ms``) its counts are ignored and then pruned, so a crash never leaks
  in-flight load. Counts are clamped at zero (a completion that arrives after its gateway's
  counts were pruned is a no-op, and cannot hide later dispatches).

:meth:`LoadStore.snapshot` returns every requested replica's record in one round trip. It
is not on the per-request path: the gateway refreshes a local copy every ~50-100 ms and adds
its own dispatches since the last refresh.

Clocks. Expiry and age are judged on one clock. :class:`MemoryLoadStore` (one process) uses
the caller's ``now_ms``. :class:`RedisLoadStore` is written by agents and gateways on other
hosts, whose wall clocks differ: an agent's ``now_ms + ttl_ms`` judged by a gateway's own
``now_ms`` made a fresh report read as expired when the agent's clock ran behind by more
than the TTL (the replica's load unknown) and a dead agent's report live on for as long as
its clock ran ahead (likewise a gateway's liveness judged by another gateway). So by default
(``clock="redis"``) its scripts stamp and judge expiry with the Redis server's ``TIME``, and
each writer's ``now_ms`` serves only to measure its offset from that clock: a snapshot
returns ``metrics_ts_ms`` and ``stalled_since_ms`` moved onto the reader's clock (so
``age_ms(now_ms)`` and ``fresh`` take the reader's own ``now_ms``, and ``stalled_ms``, a
difference on the agent's clock, is unchanged) and the agent's clock offset from the
reader's as ``clock_skew_ms``. Redis Cluster: a replica's keys share one slot, so its
record is stamped and judged on one node's clock. ``clock="caller"`` keeps the callers'
``now_ms`` as the clock (both stores then answer identically: deterministic tests). Redis
keys also get a TTL (expiry plus a grace) for garbage collection only.

Redis layout (see :mod:`cachecore.index.layout`): ``kvg:{r:<id>}:load`` (agent-owned hash:
running, waiting, kv_usage, metrics_ts_ms, expires_ms, since D17 stalled_since_ms and
stalled_at_ms, since the twenty-fifth session clock_offset_ms and clock_at_ms) and
``kvg:{r:<id>}:gw:inflight`` (gateway-owned hash: ``<gateway>:r``, ``<gateway>:t``,
``<gateway>:x`` = liveness expiry).

Compatibility: the record is a hash of named fields, so a field is only ever added, never
renamed or reinterpreted, and a missing one reads as its "nothing to report" value (0). A
record from an agent older than D17 has no stall fields and reads as not stalled; an older
gateway reads the fields it knows. The stall counts only when ``stalled_at_ms`` equals the
record's ``metrics_ts_ms``: an older agent taking over a key (a rollback) rewrites
metrics_ts_ms but not the stall fields, and a stall left there must not grow forever.
The clock offset (the agent's ``now_ms`` minus Redis's clock at the publish) counts only
when ``clock_at_ms`` equals ``metrics_ts_ms`` for the same reason; without it the agent's
clock is taken as the reader's (no correction, as before). ``expires_ms`` and ``<gateway>:x``
are wall-clock expiry stamps as before, now the Redis server's clock where an older writer
used its own: a reader of either version compares them with a clock of another host, as
every reader did, and a mixed fleet is no worse than the old one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from redis.exceptions import NoScriptError

from cachecore.index.base import IndexError_
from cachecore.index.layout import KeyLayout, validate_replica_id
from cachecore.index.redis import (
    REDIS_FAILURES,
    RedisClient,
    RedisScript,
    call_per_replica,
    redis_client,
)

DEFAULT_GATEWAY_TTL_MS = 5_000
GARBAGE_GRACE_MS = 60_000
PRUNE_AFTER_MS = 60_000
"""A lapsed gateway's fields are deleted this long after its liveness expired (until then
they are only ignored, so a gateway that stalled briefly resumes with correct counts)."""


def _inflight_key_ttl_ms(gateway_ttl_ms: int) -> int:
    """A replica's in-flight hash lives this long after its last gateway write: past its
    gateways' liveness, their prune and a grace."""
    return gateway_ttl_ms + PRUNE_AFTER_MS + GARBAGE_GRACE_MS


def _load_key_ttl_ms(ttl_ms: int) -> int:
    """A replica's load record lives this long after its agent's publish (``ttl_ms``)."""
    return max(1, ttl_ms) + GARBAGE_GRACE_MS


class LoadStoreError(IndexError_):
    """The load store failed; the gateway keeps routing on its last snapshot."""


def validate_gateway_id(gateway_id: str) -> str:
    """Gateway ids use the replica-id alphabet (no ``:``, which separates hash fields)."""
    try:
        return validate_replica_id(gateway_id)
    except ValueError:
        raise ValueError(f"invalid gateway id {gateway_id!r}") from None


def new_gateway_id() -> str:
    """A gateway id unique per process (host, pid, random): a restarted gateway must not
    inherit the counts of its previous life."""
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c in "-.")[:24] or "gw"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's own view, as its agent scraped it."""

    num_running: int
    num_waiting: int
    kv_usage: float  # vllm:kv_cache_usage_perc, 0..1
    metrics_ts_ms: int  # when the agent scraped /metrics
    # since when (the agent's clock, ms) the engine has had requests and taken no step, as
    # of this scrape (cachecore.agent.progress); 0 when it progresses, is idle or unknown
    stalled_since_ms: int = 0

    def __post_init__(self) -> None:
        if self.num_running < 0 or self.num_waiting < 0:
            raise ValueError("negative request counts")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError("kv_usage must be within [0, 1]")
        if self.stalled_since_ms < 0 or self.stalled_since_ms > self.metrics_ts_ms:
            raise ValueError("stalled_since_ms must be within [0, metrics_ts_ms]")


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One replica's load as every gateway sees it.

    ``metrics_ts_ms == 0`` means no unexpired engine report (agent down or never started):
    the engine fields are then zero and :meth:`fresh` is false; in-flight counts still
    hold what gateways dispatched.
    """

    replica: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    metrics_ts_ms: int = 0
    inflight_requests: int = 0
    inflight_prefill_tokens: int = 0
    gateways: int = 0  # live gateways with counts on this replica
    stalled_since_ms: int = 0  # EngineLoad.stalled_since_ms (0: not stalled, or no report)
    # the agent's clock minus the reader's, measured through Redis's clock at the publish
    # and the read (0: one clock, no report, or an agent that does not say); metrics_ts_ms
    # and stalled_since_ms are already moved onto the reader's clock by it
    clock_skew_ms: int = 0

    @property
    def has_engine(self) -> bool:
        return self.metrics_ts_ms > 0

    @property
    def stalled_ms(self) -> int:
        """How long the engine had been busy without progress when last scraped (0 when
        not). A difference of two stamps of one clock: no skew against the reader's."""
        if self.stalled_since_ms <= 0 or not self.has_engine:
            return 0
        return max(0, self.metrics_ts_ms - self.stalled_since_ms)

    def age_ms(self, now_ms: int) -> int | None:
        """Age of the engine report on the reader's clock (``now_ms``, the one it passed to
        the snapshot), or None without one."""
        return now_ms - self.metrics_ts_ms if self.has_engine else None

    def fresh(self, now_ms: int, max_age_ms: int) -> bool:
        age = self.age_ms(now_ms)
        return age is not None and age <= max_age_ms


CLOCK_SKEW_LOG_INTERVAL_S = 60.0
CLOCK_SKEW_LOG_BURST = 2
"""At most this many clock-skew lines per replica in :data:`CLOCK_SKEW_LOG_INTERVAL_S`: a
skew that passes the threshold and comes back is told at once; one that flips faster (an
offset hovering at the threshold, two agents with different clocks publishing for one
replica, a clock stepped back and forth) is told once the window allows, with the changes
no line told."""


@dataclass(slots=True)
class _Skew:
    logged_off: bool = False  # what the last line said
    off: bool = False  # as last observed
    changes: int = 0  # changes of ``off`` since the last line
    lines: deque[float] = field(default_factory=lambda: deque(maxlen=CLOCK_SKEW_LOG_BURST))


class ClockSkewLog:
    """Logs, per replica, whether its agent's clock is off the reader's by more than
    ``warn_ms`` (:attr:`LoadRecord.clock_skew_ms`): a WARNING when it leaves, an INFO when it
    is back, on a change of state only and at most :data:`CLOCK_SKEW_LOG_BURST` lines per
    :data:`CLOCK_SKEW_LOG_INTERVAL_S` per replica. A change past that bound waits for the
    window and is then told as the state it has reached, with ``changes_unlogged`` (the
    changes no line told; a flip and back that no line told is told too), so an offset
    that flips at every publish costs two lines a minute, not two per refresh. The
    threshold matters to the checks that still compare an agent's stamps with the reader's
    clock (D22's removal log); the load store itself judges on Redis's clock."""

    def __init__(
        self,
        logger: logging.Logger,
        warn_ms: int,
        interval_s: float = CLOCK_SKEW_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.warn_ms = warn_ms
        self.interval_s = interval_s
        self._clock = clock
        self._replicas: dict[str, _Skew] = {}

    @property
    def off(self) -> set[str]:
        """The replicas whose last line said their agent's clock is off."""
        return {rid for rid, st in self._replicas.items() if st.logged_off}

    def observe(self, skews: Mapping[str, int], present: Iterable[str]) -> None:
        """``skews``: the replicas whose record measured a skew now (one without a record
        keeps its last word); a replica not in ``present`` is forgotten."""
        now = self._clock()
        for rid, skew in skews.items():
            off = abs(skew) > self.warn_ms
            st = self._replicas.get(rid)
            if st is None:
                if not off:
                    continue  # agrees, and no line said otherwise
                st = self._replicas[rid] = _Skew()
            if off != st.off:
                st.off = off
                st.changes += 1
            if not st.changes:
                continue
            if len(st.lines) == CLOCK_SKEW_LOG_BURST and now - st.lines[0] < self.interval_s:
                continue  # told enough of this replica lately: told once the window allows
            unlogged = st.changes - (off != st.logged_off)
            extra = {"replica": rid, "agent_clock_skew_ms": skew, "changes_unlogged": unlogged}
            if off:
                self._log.warning(
                    "agent clock differs from this gateway's: load freshness is judged on "
                    "Redis's clock and unaffected, the removal-log checks (D22) are not",
                    extra=extra,
                )
            else:
                self._log.info("agent clock agrees with this gateway's again", extra=extra)
            st.logged_off, st.changes = off, 0
            st.lines.append(now)
        keep = set(present)
        for rid in self._replicas.keys() - keep:
            del self._replicas[rid]


@runtime_checkable
class LoadStore(Protocol):
    """Per-replica load shared by agents (engine load) and gateways (in-flight counts)."""

    gateway_ttl_ms: int

    async def publish_engine(
        self, replica: str, load: EngineLoad, ttl_ms: int, now_ms: int
    ) -> None:
        """Agent: the engine's load, valid until ``now_ms + ttl_ms``."""
        ...

    async def add_inflight(
        self, gateway_id: str, replica: str, d_requests: int, d_prefill_tokens: int, now_ms: int
    ) -> None:
        """Gateway: add (dispatch) or subtract (first token, completion, failure) in-flight
        counts; also refreshes this gateway's liveness on ``replica``."""
        ...

    async def heartbeat(
        self,
        gateway_id: str,
        replicas: Sequence[str],
        now_ms: int,
        counts: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Gateway: keep this gateway's counts on ``replicas`` alive (call well within
        ``gateway_ttl_ms``); prunes long-lapsed gateways' fields. ``counts``: this gateway's
        own in-flight (requests, prefill tokens) per replica, written as they are (a
        replica left out keeps its fields): the deltas between heartbeats are clamped at
        zero, so counts a store lost (a Redis restart, a prune) would otherwise stay
        under the truth for as long as the gateway is never idle."""
        ...

    async def drop_gateway(self, gateway_id: str, replicas: Sequence[str]) -> None:
        """Gateway, on clean shutdown: remove its counts at once."""
        ...

    async def snapshot(self, replicas: Sequence[str], now_ms: int) -> dict[str, LoadRecord]:
        """Every requested replica's record, in one round trip."""
        ...

    async def close(self) -> None: ...


# ------------------------------------------------------------------------------ memory


@dataclass(slots=True)
class _GatewayCounts:
    requests: int = 0
    tokens: int = 0
    expires_ms: int = 0


@dataclass(slots=True)
class _MemReplica:
    engine: EngineLoad | None = None
    engine_expires_ms: int = 0
    gateways: dict[str, _GatewayCounts] = field(default_factory=dict)
    # when Redis would have let both of its keys expire (the latest write's key TTL): the
    # record reads as empty by then, and it is dropped (see MemoryLoadStore.heartbeat)
    gc_ms: int = 0


class MemoryLoadStore:
    """In-process :class:`LoadStore` (embedded mode: one gateway process)."""

    def __init__(self, gateway_ttl_ms: int = DEFAULT_GATEWAY_TTL_MS) -> None:
        if gateway_ttl_ms <= 0:
            raise ValueError("gateway_ttl_ms must be positive")
        self.gateway_ttl_ms = gateway_ttl_ms
        self._replicas: dict[str, _MemReplica] = {}

    @property
    def _key_ttl_ms(self) -> int:
        return _inflight_key_ttl_ms(self.gateway_ttl_ms)

    def _rep(self, replica: str) -> _MemReplica:
        rep = self._replicas.get(replica)
        if rep is None:
            rep = self._replicas[replica] = _MemReplica()
            validate_replica_id(replica)
        return rep

    async def publish_engine(
        self, replica: str, load: EngineLoad, ttl_ms: int, now_ms: int
    ) -> None:
        rep = self._rep(replica)
        rep.engine = load
        rep.engine_expires_ms = now_ms + ttl_ms
        rep.gc_ms = max(rep.gc_ms, now_ms + _load_key_ttl_ms(ttl_ms))

    async def add_inflight(
        self, gateway_id: str, replica: str, d_requests: int, d_prefill_tokens: int, now_ms: int
    ) -> None:
        validate_gateway_id(gateway_id)
        rep = self._rep(replica)
        g = rep.gateways.setdefault(gateway_id, _GatewayCounts())
        # clamped on write, as in Redis (a late completion after a prune is a no-op)
        g.requests = max(0, g.requests + d_requests)
        g.tokens = max(0, g.tokens + d_prefill_tokens)
        g.expires_ms = now_ms + self.gateway_ttl_ms
        rep.gc_ms = max(rep.gc_ms, now_ms + self._key_ttl_ms)

    async def heartbeat(
        self,
        gateway_id: str,
        replicas: Sequence[str],
        now_ms: int,
        counts: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        validate_gateway_id(gateway_id)
        # the replicas no one wrote for a key TTL (removed ones: autoscaled fleets bring
        # fresh ids) go, as their Redis keys expire; else one entry per id ever seen
        for rid in [rid for rid, rep in self._replicas.items() if rep.gc_ms < now_ms]:
            del self._replicas[rid]
        for rid in replicas:
            rep = self._rep(rid)
            g = rep.gateways.setdefault(gateway_id, _GatewayCounts())
            g.expires_ms = now_ms + self.gateway_ttl_ms
            rep.gc_ms = max(rep.gc_ms, now_ms + self._key_ttl_ms)
            own = counts.get(rid) if counts is not None else None
            if own is not None:
                g.requests, g.tokens = max(0, own[0]), max(0, own[1])
            for gid in [
                gid for gid, c in rep.gateways.items() if c.expires_ms + PRUNE_AFTER_MS < now_ms
            ]:
                del rep.gateways[gid]

    async def drop_gateway(self, gateway_id: str, replicas: Sequence[str]) -> None:
        validate_gateway_id(gateway_id)
        for rid in replicas:
            self._rep(rid).gateways.pop(gateway_id, None)

    async def snapshot(self, replicas: Sequence[str], now_ms: int) -> dict[str, LoadRecord]:
        out: dict[str, LoadRecord] = {}
        for rid in replicas:
            rep = self._replicas.get(rid)
            if rep is None:
                validate_replica_id(rid)
                out[rid] = LoadRecord(rid)
                continue
            req = tok = live = 0
            for c in rep.gateways.values():
                if c.expires_ms > now_ms:
                    live += 1
                    req += max(0, c.requests)
                    tok += max(0, c.tokens)
            eng = rep.engine if rep.engine_expires_ms > now_ms else None
            out[rid] = LoadRecord(
                rid,
                num_running=eng.num_running if eng else 0,
                num_waiting=eng.num_waiting if eng else 0,
                kv_usage=eng.kv_usage if eng else 0.0,
                metrics_ts_ms=eng.metrics_ts_ms if eng else 0,
                inflight_requests=req,
                inflight_prefill_tokens=tok,
                gateways=live,
                stalled_since_ms=eng.stalled_since_ms if eng else 0,
            )
        return out

    async def close(self) -> None:
        return None


# ------------------------------------------------------------------------------- redis

# The clock a script stamps and judges expiry with: ARGV's caller now_ms, or with mode '1'
# the Redis server's TIME (one clock for every host; see the module docstring).
_CLOCK_LUA = """
local function clock(now_arg, mode)
  if mode == '1' then
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return tonumber(now_arg)
end
local function int(x) return string.format('%d', x) end
"""

# ARGV: the reader's now_ms, clock mode[, Cluster: the keys]. Per key a row: running,
# waiting, kv_usage, metrics_ts_ms and stalled_since_ms (both on the reader's clock),
# in-flight requests and tokens, live gateways, the agent's clock skew from the reader's
_SNAPSHOT_LUA = (
    """#!lua flags=no-writes,allow-cross-slot-keys
"""
    + _CLOCK_LUA
    + """
local reader = tonumber(ARGV[1])
local now = clock(ARGV[1], ARGV[2])
local reader_off = reader - now  -- the reader's clock minus the store's
local lkeys, first = KEYS, 0
if #KEYS == 0 then lkeys, first = ARGV, 2 end  -- Cluster: undeclared keys, after the ARGV
local out = {}
for r = 1, #lkeys - first do
  local lkey = lkeys[first + r]
  local ikey = string.sub(lkey, 1, -5) .. 'gw:inflight'
  -- the load record is its agent's: a key of the wrong type or a field that is no number
  -- reads as no record / 0, never a script error that would fail every replica's read
  local l = redis.pcall('HMGET', lkey, 'running', 'waiting', 'kv_usage', 'metrics_ts_ms',
                        'expires_ms', 'stalled_since_ms', 'stalled_at_ms', 'clock_offset_ms',
                        'clock_at_ms')
  if l.err then
    if string.find(l.err, 'WRONGTYPE', 1, true) ~= 1 then error(l) end
    l = {}
  end
  local row = {0, 0, '0', 0, 0, 0, 0, 0, 0}
  local exp = tonumber(l[5])
  local ts = tonumber(l[4]) or 0
  if exp and exp > now and ts > 0 then
    row[1] = tonumber(l[1]) or 0
    row[2] = tonumber(l[2]) or 0
    local kv = tonumber(l[3])
    if kv and kv >= 0 and kv <= 1 then row[3] = tostring(kv) end
    -- the agent's stamps onto the reader's clock, when the agent said its offset (absent
    -- before the twenty-fifth session; stale after an older agent took the key over)
    local shift = 0
    local off = tonumber(l[8])
    -- an offset beyond a day (or NaN, inf: no number the agent's publish writes) is no
    -- clock's: ignored, the record read as from an agent that did not say
    if off and math.abs(off) <= 86400000 and l[9] and l[9] == l[4] then
      shift = reader_off - off
      row[9] = off - reader_off
    end
    row[4] = math.max(1, ts + shift)
    -- absent before D17; stale (not this scrape's) after an older agent took the key over
    if l[7] and l[4] and l[7] == l[4] then
      local since = tonumber(l[6]) or 0
      if since > 0 then row[8] = math.max(1, since + shift) end
    end
  end
  local f = redis.call('HGETALL', ikey)
  local vals = {}
  for i = 1, #f, 2 do vals[f[i]] = f[i + 1] end
  local req, tok, live = 0, 0, 0
  for name, v in pairs(vals) do
    if string.sub(name, -2) == ':x' and tonumber(v) > now then
      local g = string.sub(name, 1, -3)
      live = live + 1
      req = req + math.max(0, tonumber(vals[g .. ':r'] or '0'))
      tok = tok + math.max(0, tonumber(vals[g .. ':t'] or '0'))
    end
  end
  row[5] = req
  row[6] = tok
  row[7] = live
  out[r] = row
end
return out
"""
)

# KEYS[1] inflight hash. ARGV: gateway, d_req, d_tok, now_ms, key_ttl_ms, gateway_ttl_ms,
# clock mode
_ADD_INFLIGHT_LUA = (
    _CLOCK_LUA
    + """
local g = ARGV[1]
-- clamp at zero on write: a completion that arrives after this gateway's fields were pruned
-- must not hide its later dispatches
if redis.call('HINCRBY', KEYS[1], g .. ':r', ARGV[2]) < 0 then
  redis.call('HSET', KEYS[1], g .. ':r', 0)
end
if redis.call('HINCRBY', KEYS[1], g .. ':t', ARGV[3]) < 0 then
  redis.call('HSET', KEYS[1], g .. ':t', 0)
end
redis.call('HSET', KEYS[1], g .. ':x', int(clock(ARGV[4], ARGV[7]) + tonumber(ARGV[6])))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
)

# KEYS[1] inflight hash. ARGV: gateway, gateway_ttl_ms, now_ms, prune_after_ms, key_ttl_ms,
# clock mode[, requests, prefill tokens: this gateway's own counts, written as they are]
_HEARTBEAT_LUA = (
    _CLOCK_LUA
    + """
local g = ARGV[1]
local now = clock(ARGV[3], ARGV[6])
local prune = tonumber(ARGV[4])
redis.call('HSET', KEYS[1], g .. ':x', int(now + tonumber(ARGV[2])))
if ARGV[8] then
  redis.call('HSET', KEYS[1], g .. ':r', ARGV[7], g .. ':t', ARGV[8])
end
local f = redis.call('HGETALL', KEYS[1])
for i = 1, #f, 2 do
  local name = f[i]
  if string.sub(name, -2) == ':x' and tonumber(f[i + 1]) + prune < now then
    local other = string.sub(name, 1, -3)
    redis.call('HDEL', KEYS[1], other .. ':r', other .. ':t', other .. ':x')
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""
)

# KEYS[1] load record. ARGV: running, waiting, kv_usage, metrics_ts_ms, now_ms, key_ttl_ms,
# stalled_since_ms, ttl_ms, clock mode
_PUBLISH_LUA = (
    _CLOCK_LUA
    + """
local now = clock(ARGV[5], ARGV[9])
redis.call('HSET', KEYS[1], 'running', ARGV[1], 'waiting', ARGV[2], 'kv_usage', ARGV[3],
           'metrics_ts_ms', ARGV[4], 'expires_ms', int(now + tonumber(ARGV[8])),
           'stalled_since_ms', ARGV[7], 'stalled_at_ms', ARGV[4],
           'clock_offset_ms', int(tonumber(ARGV[5]) - now), 'clock_at_ms', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
return 1
"""
)

Clock = Literal["redis", "caller"]


class RedisLoadStore:
    """:class:`LoadStore` on Redis, shared by every gateway process and agent. ``clock``:
    ``"redis"`` (production) stamps and judges expiry with the Redis server's clock, the
    callers' ``now_ms`` only measuring their offsets from it; ``"caller"`` uses the callers'
    ``now_ms`` as the clock, as :class:`MemoryLoadStore` does (tests with simulated time;
    right only when every host's clock agrees)."""

    def __init__(
        self,
        client: RedisClient,
        layout: KeyLayout | None = None,
        gateway_ttl_ms: int = DEFAULT_GATEWAY_TTL_MS,
        clock: Clock = "redis",
    ) -> None:
        if gateway_ttl_ms <= 0:
            raise ValueError("gateway_ttl_ms must be positive")
        if clock not in ("redis", "caller"):
            raise ValueError(f"clock must be 'redis' or 'caller', not {clock!r}")
        self.client = client
        self.layout = layout or KeyLayout()
        self.gateway_ttl_ms = gateway_ttl_ms
        self.clock: Clock = clock
        self._mode = "1" if clock == "redis" else "0"
        self._snapshot = RedisScript(_SNAPSHOT_LUA, readonly=True)
        self._add = RedisScript(_ADD_INFLIGHT_LUA)
        self._heartbeat = RedisScript(_HEARTBEAT_LUA)
        self._publish = RedisScript(_PUBLISH_LUA)
        self.round_trips = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        layout: KeyLayout | None = None,
        *,
        cluster: bool = False,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        **kwargs: Any,
    ) -> RedisLoadStore:
        """Connect to ``redis://...``, or with ``cluster`` to the Redis Cluster it seeds;
        the timeouts are a serving hot path's (fail fast), a correctness test's patient."""
        client = redis_client(
            url,
            cluster=cluster,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        return cls(client, layout, **kwargs)

    @property
    def _key_ttl_ms(self) -> int:
        return _inflight_key_ttl_ms(self.gateway_ttl_ms)

    async def _run(self, what: str, script: RedisScript, key: str, args: list[Any]) -> Any:
        self.round_trips += 1
        try:
            return await script.call(self.client, [key], args)
        except REDIS_FAILURES as exc:
            raise LoadStoreError(f"{what}: {type(exc).__name__}: {exc}") from exc

    async def publish_engine(
        self, replica: str, load: EngineLoad, ttl_ms: int, now_ms: int
    ) -> None:
        args = [
            load.num_running,
            load.num_waiting,
            repr(float(load.kv_usage)),
            load.metrics_ts_ms,
            now_ms,
            _load_key_ttl_ms(ttl_ms),
            load.stalled_since_ms,
            ttl_ms,
            self._mode,
        ]
        await self._run("publish_engine", self._publish, self.layout.load(replica), args)

    async def add_inflight(
        self, gateway_id: str, replica: str, d_requests: int, d_prefill_tokens: int, now_ms: int
    ) -> None:
        validate_gateway_id(gateway_id)
        args = [
            gateway_id,
            int(d_requests),
            int(d_prefill_tokens),
            now_ms,
            self._key_ttl_ms,
            self.gateway_ttl_ms,
            self._mode,
        ]
        await self._run("add_inflight", self._add, self.layout.inflight(replica), args)

    async def heartbeat(
        self,
        gateway_id: str,
        replicas: Sequence[str],
        now_ms: int,
        counts: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        validate_gateway_id(gateway_id)
        if not replicas:
            return
        base: list[str | int] = [
            gateway_id,
            self.gateway_ttl_ms,
            now_ms,
            PRUNE_AFTER_MS,
            self._key_ttl_ms,
            self._mode,
        ]
        calls: list[tuple[str, list[str | int]]] = []
        for r in replicas:
            own = counts.get(r) if counts is not None else None
            args = base if own is None else [*base, max(0, own[0]), max(0, own[1])]
            calls.append((self.layout.inflight(r), args))
        self.round_trips += 1
        try:
            # one script call per replica (each touches one slot), pipelined: one round trip
            # on standalone Redis; redis-py splits a cluster pipeline per node.
            pipe = self.client.pipeline(transaction=False)
            for key, args in calls:
                self._heartbeat.queue(pipe, [key], args)
            results = await pipe.execute(raise_on_error=False)
            if any(isinstance(r, NoScriptError) for r in results):
                await self.client.script_load(self._heartbeat.source)
                pipe = self.client.pipeline(transaction=False)
                for key, args in calls:
                    self._heartbeat.queue(pipe, [key], args)
                results = await pipe.execute(raise_on_error=False)
            for r in results:
                if isinstance(r, Exception):
                    raise r
        except REDIS_FAILURES as exc:
            raise LoadStoreError(f"heartbeat: {type(exc).__name__}: {exc}") from exc

    async def drop_gateway(self, gateway_id: str, replicas: Sequence[str]) -> None:
        validate_gateway_id(gateway_id)
        if not replicas:
            return
        self.round_trips += 1
        fields = [f"{gateway_id}:{s}" for s in ("r", "t", "x")]
        try:
            pipe = self.client.pipeline(transaction=False)
            for rid in replicas:
                pipe.hdel(self.layout.inflight(rid), *fields)
            await pipe.execute()
        except REDIS_FAILURES as exc:
            raise LoadStoreError(f"drop_gateway: {type(exc).__name__}: {exc}") from exc

    async def snapshot(self, replicas: Sequence[str], now_ms: int) -> dict[str, LoadRecord]:
        if not replicas:
            return {}
        try:
            rows, calls = await call_per_replica(
                self.client,
                self._snapshot,
                self.layout,
                replicas,
                self.layout.load,
                [now_ms, self._mode],
            )
        except REDIS_FAILURES as exc:
            raise LoadStoreError(f"snapshot: {type(exc).__name__}: {exc}") from exc
        self.round_trips += calls
        out: dict[str, LoadRecord] = {}
        for rid, row in zip(replicas, rows, strict=True):
            out[rid] = LoadRecord(
                rid,
                num_running=int(row[0]),
                num_waiting=int(row[1]),
                kv_usage=float(row[2]),
                metrics_ts_ms=int(row[3]),
                inflight_requests=int(row[4]),
                inflight_prefill_tokens=int(row[5]),
                gateways=int(row[6]),
                stalled_since_ms=int(row[7]),
                clock_skew_ms=int(row[8]),
            )
        return out

    async def close(self) -> None:
        with contextlib.suppress(*REDIS_FAILURES):
            await self.client.aclose()
