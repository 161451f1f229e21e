"""The production prefix index on Redis (standalone or Cluster), via server-side Lua.

Key layout: :mod:`cachecore.index.layout` (documented in ``docs/index.md``). Requirements:
Redis >= 7.0 (script flags and the ``%R~``/``%RW~`` ACL selectors
need 7.0) and ``maxmemory-policy noeviction`` (or a ``volatile-*`` policy: only TTL'd soft
state may ever be evicted, never a meta, block or mirror hash; agents and gateways read it,
:meth:`RedisIndex.eviction_policies`, and agents count their entries,
:meth:`RedisIndex.entry_counts`).

Round trips:

* :meth:`RedisIndex.lookup`: ONE ``EVALSHA`` for all replicas on standalone Redis; on
  Cluster one per shard, sent concurrently. The script reads each replica's meta (epoch,
  state), then finds the end of the stored run, of each tier's run and of the pending keys
  after them by binary search over the entries' run certificates (``HGET``/``ZSCORE`` per
  probe, O(log n) per replica; the steps of :func:`cachecore.index.base.search_prefix`);
* :meth:`RedisIndex.apply`: one ``EVALSHA`` per write (a write of more than
  ``max_write_fields`` entries is split, and the parts pipelined in one round trip), which
  checks the epoch and applies the block and mirror changes and ``last_seq`` atomically;
* :meth:`RedisIndex.clear_replica`: one ``EVALSHA``: ``HINCRBY epoch`` + ``UNLINK`` of the
  old epoch's hashes (UNLINK frees them in a background thread: O(1) for the caller).

Every Redis failure surfaces as :class:`~cachecore.index.base.IndexError_` (the gateway
degrades to load-only routing); a write on an old epoch as
:class:`~cachecore.index.base.StaleEpochError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import is_not, not_
from types import MappingProxyType
from typing import Any, TypedDict, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from cachecore.index.base import (
    DEFAULT_REMOVAL_LOG,
    EMPTY_TIERS,
    IndexError_,
    IndexStats,
    PrefixMatch,
    RemovalFloor,
    ReplicaMeta,
    ReplicaState,
    StaleEpochError,
    removals_at_or_after,
    removed_flags,
)
from cachecore.index.layout import (
    KeyLayout,
    engine_hash_fields,
    engine_hash_from_field,
    group_by_shard,
)
from cachecore.index.memory import check_write_values
from cachecore.keys import KEY_BYTES, BlockKey
from cachecore.lifecycle import IndexWrite, MirrorRecordError, Tier

try:
    import hiredis
except ImportError:  # pragma: no cover - a declared dependency; redis-py works without it
    hiredis = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_MAX_PENDING_PER_REPLICA = 262_144
DEFAULT_MAX_WRITE_FIELDS = 16_384
PENDING_KEY_GRACE_MS = 60_000
"""A pending zset's key TTL is its latest expiry plus this grace (relative to the caller's
clock, so skew between gateway and Redis clocks cannot expire live entries early)."""

_FORGET_KEYS_PER_CALL = 1024  # keys one forget script unlinks (a replica has a few; orphans more)

RedisClient = aioredis.Redis | RedisCluster
REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)
"""What a failing Redis raises. The cluster client raises RedisClusterException, which is
not a RedisError, when it reaches no node or a slot has none (where standalone raises
ConnectionError): callers must degrade alike on both."""

# ---------------------------------------------------------------------------- Lua scripts
# Scripts derive the b:/m:/rm:/gw:p: key names from the meta key (":meta" is 4 chars) and the
# epoch they read, so that no caller can pass a stale epoch's key name.

# KEYS: one meta key per replica. ARGV: now_ms, the request's block keys concatenated (16
# bytes each: one argument, so the client encodes one blob, not n). On Cluster no KEYS and
# the meta keys after those two ARGV (see call_per_replica).
#
# Per replica a row: state, the four tier run ends, the stored end, the pending end, and 1
# when one of its agent-owned keys was of the wrong type (else 0).
#
# The same steps as cachecore.index.base.search_prefix / run_end, so both backends answer
# alike even on inconsistent data: per replica, the end of the stored run (entries whose
# "stored run broken" bit is clear), each tier's run within it, then the pending keys after
# it, each end found by probing the run's first key, its last, then bisecting: a replica
# that holds nothing costs three Redis calls (meta, first key, its pending score), a
# complete hit three, a partial one O(log n). Probed values are cached per replica. Costs
# measured here (16 replicas, 8k-token prompt, ~78 calls): ~0.4 us per call, ~13 us for
# the 8 KiB key blob, and Lua allocation (each table, closure and string feeds Lua's
# incremental GC; batching probes into HMGETs made it slower for that reason): so the
# predicates are made once, not per replica, and a replica without the first key builds
# no tier runs (145-212 -> 113-131 us of Redis time per lookup).
LOOKUP_LUA = """#!lua flags=no-writes,allow-cross-slot-keys
local now = tonumber(ARGV[1])
local blob = ARGV[2]
local n = math.floor(#blob / 16)
local try, sub, floor, find = redis.pcall, string.sub, math.floor, string.find
local band, bnot, rshift = bit.band, bit.bnot, bit.rshift
local keys = {}
local function key(i)  -- 0-based
  local k = keys[i]
  if k == nil then
    k = sub(blob, 16 * i + 1, 16 * i + 16)
    keys[i] = k
  end
  return k
end
local function run_end(ok, lo, hi)
  if lo >= hi or not ok(lo) then return lo end
  if ok(hi - 1) then return hi end
  lo, hi = lo + 1, hi - 1
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    if ok(mid) then lo = mid + 1 else hi = mid end
  end
  return lo
end
-- One replica at a time: its hash and zset names and its probed values, as upvalues of
-- predicates made once (closures and tables per replica were most of the script's cost).
local bkey, pkey, seen, tier_bit
-- Agent-owned keys are read with pcall: an agent may DEL and SET its own keys, and a key
-- of the wrong type (its b: hash made a string) must cost its own replica the match, not
-- fail the script for every replica. Such a replica reads as holding nothing, and is
-- flagged (row[8]). Any other error is raised as before (the gateway falls back).
local wrong
local function read(r)
  if type(r) == 'table' and r.err then
    if find(r.err, 'WRONGTYPE', 1, true) ~= 1 then error(r) end
    wrong = 1
    return false
  end
  return r
end
local function value(i)
  local v = seen[i]
  if v == nil then
    v = tonumber(read(try('HGET', bkey, key(i)))) or 0
    seen[i] = v
  end
  return v
end
local function in_stored_run(i)
  local v = value(i)
  return band(v, 15) ~= 0 and band(v, 256) == 0
end
local function in_tier_run(i)
  local v = value(i)
  return band(band(v, tier_bit), bnot(rshift(v, 4))) ~= 0
end
local function pending_live(i)
  local sc = read(try('ZSCORE', pkey, key(i)))  -- a missing zset answers nil
  return sc and tonumber(sc) > now
end
local metas, first = KEYS, 0
if #KEYS == 0 then metas, first = ARGV, 2 end  -- Cluster: undeclared keys, after the ARGV
local out = {}
for r = 1, #metas - first do
  local meta = metas[first + r]
  wrong = 0
  local m = read(try('HMGET', meta, 'epoch', 'state')) or {}
  local state = m[2] or 'unknown'
  if state ~= 'live' and state ~= 'cold' then
    out[r] = {state, 0, 0, 0, 0, 0, 0, wrong}
  else
    local base = sub(meta, 1, -5)
    local epoch = m[1] or '0'
    bkey, seen = base .. 'b:' .. epoch, {}
    local stored = run_end(in_stored_run, 0, n)
    local t1, t2, t3, t4, pend = 0, 0, 0, 0, stored
    if stored > 0 then  -- else every tier's run is empty without a probe
      tier_bit = 1; t1 = run_end(in_tier_run, 0, stored)
      tier_bit = 2; t2 = run_end(in_tier_run, 0, stored)
      tier_bit = 4; t3 = run_end(in_tier_run, 0, stored)
      tier_bit = 8; t4 = run_end(in_tier_run, 0, stored)
    end
    if stored < n then
      pkey = base .. 'gw:p:' .. epoch
      pend = run_end(pending_live, stored, n)
    end
    out[r] = {state, t1, t2, t3, t4, stored, pend, wrong}
  end
end
return out
"""

# KEYS[1] meta. ARGV: epoch, now_ms, seq ('' = keep), n_bset, n_bdel, n_mset, n_mdel,
# removal_log, n_relog, then n_bset (key, bits) pairs, n_bdel keys, n_mset (hash, record)
# pairs, n_mdel hashes, n_relog keys. Each deleted entry that existed, and each relog key
# (deleted and stored again within the write), is logged in rm:<epoch> at now_ms (the
# removal log of PrefixIndex.removed_since), trimmed to the latest removal_log; rm_floor in
# the meta is the newest time trimmed, so the log is complete after it. ZADD GT: a key's
# time never goes back (an agent clock stepped back must not hide a later-stamped removal).
APPLY_LUA = """
local meta = KEYS[1]
local cur = redis.call('HGET', meta, 'epoch') or '0'
if cur ~= ARGV[1] then
  return redis.error_reply('STALE epoch ' .. cur)
end
local base = string.sub(meta, 1, -5)
local bkey = base .. 'b:' .. cur
local mkey = base .. 'm:' .. cur
local nbs, nbd = tonumber(ARGV[4]), tonumber(ARGV[5])
local nms, nmd = tonumber(ARGV[6]), tonumber(ARGV[7])
local STEP = 1024
local function hset_pairs(key, from, npairs)
  local i = 0
  while i < npairs do
    local c = math.min(STEP, npairs - i)
    redis.call('HSET', key, unpack(ARGV, from + 2 * i, from + 2 * (i + c) - 1))
    i = i + c
  end
end
local function hdel_fields(key, from, nfields)
  local i = 0
  while i < nfields do
    local c = math.min(STEP, nfields - i)
    redis.call('HDEL', key, unpack(ARGV, from + i, from + i + c - 1))
    i = i + c
  end
end
local cap, nrl = tonumber(ARGV[8]), tonumber(ARGV[9])
local rkey = base .. 'rm:' .. cur
local now = ARGV[2]
local logged = 0
local function hdel_logged(key, from, nfields)
  -- only a field that existed is a removal to log: HMGET, HDEL, ZADD per chunk
  local i = 0
  while i < nfields do
    local c = math.min(STEP, nfields - i)
    local had = redis.call('HMGET', key, unpack(ARGV, from + i, from + i + c - 1))
    redis.call('HDEL', key, unpack(ARGV, from + i, from + i + c - 1))
    local args, q = {}, 0
    for j = 1, c do
      if had[j] then
        args[q + 1] = now
        args[q + 2] = ARGV[from + i + j - 1]
        q = q + 2
      end
    end
    if q > 0 then
      redis.call('ZADD', rkey, 'GT', unpack(args))
      logged = logged + q / 2
    end
    i = i + c
  end
end
local p = 10
hset_pairs(bkey, p, nbs); p = p + 2 * nbs
if cap > 0 then
  hdel_logged(bkey, p, nbd)
else
  hdel_fields(bkey, p, nbd)
  if nbd + nrl > 0 then  -- nothing logged: every removal so far is "trimmed"
    redis.call('HSET', meta, 'rm_floor', now)
  end
end
p = p + nbd
hset_pairs(mkey, p, nms); p = p + 2 * nms
hdel_fields(mkey, p, nmd); p = p + nmd
if cap > 0 then
  for i = 0, nrl - 1 do
    redis.call('ZADD', rkey, 'GT', now, ARGV[p + i])
    logged = logged + 1
  end
end
if logged > 0 then
  local card = redis.call('ZCARD', rkey)
  if card > cap then
    local cut = redis.call('ZRANGE', rkey, card - cap - 1, card - cap - 1, 'WITHSCORES')
    redis.call('ZREMRANGEBYRANK', rkey, 0, card - cap - 1)
    local floor = tonumber(redis.call('HGET', meta, 'rm_floor') or '-1')
    if tonumber(cut[2]) > floor then redis.call('HSET', meta, 'rm_floor', cut[2]) end
  end
end
if ARGV[3] ~= '' then
  redis.call('HSET', meta, 'epoch', cur, 'last_seq', ARGV[3], 'updated_ms', ARGV[2])
else
  redis.call('HSET', meta, 'epoch', cur, 'updated_ms', ARGV[2])
end
return 1
"""

# KEYS[1] meta. ARGV: state, now_ms, engine_start. Returns the new epoch. The old epoch's
# removal log goes with it, so the new one is complete only after the clear: rm_floor is
# the clear's time (-1 read "complete since ever", and a claim looked up before an engine's
# cache reset and stored again by its own request read as never removed: a false claim).
CLEAR_LUA = """
local meta = KEYS[1]
local old = redis.call('HGET', meta, 'epoch') or '0'
local new
if old == '0' or (string.match(old, '^[1-9]%d*$') and #old <= 18) then
  new = redis.call('HINCRBY', meta, 'epoch', 1)
else
  -- an epoch no agent writes (a broken tool's "abc", "-1", "1.5"), which HINCRBY refuses:
  -- the clear's time in ms, an epoch no earlier one (a count of clears) can equal
  new = tonumber(ARGV[2])
  redis.call('HSET', meta, 'epoch', ARGV[2])
end
redis.call('HSET', meta, 'state', ARGV[1], 'last_seq', '-1', 'engine_start', ARGV[3],
           'updated_ms', ARGV[2], 'rm_floor', ARGV[2])
local base = string.sub(meta, 1, -5)
redis.call('UNLINK', base .. 'b:' .. old, base .. 'm:' .. old, base .. 'rm:' .. old)
return new
"""

# KEYS[1] the replica's pending anchor (gw:p, a gateway-owned name: a gateway may not
# declare the agent-owned meta key, which it can only read). ARGV: expiry_ms, now_ms, cap,
# grace_ms, keys...
ADD_PENDING_LUA = """
local anchor = KEYS[1]
local epoch = redis.call('HGET', string.sub(anchor, 1, -5) .. 'meta', 'epoch') or '0'
local pkey = anchor .. ':' .. epoch
local expiry = ARGV[1]
local now = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local STEP = 512
local n = #ARGV - 4
local i = 0
while i < n do
  local c = math.min(STEP, n - i)
  local args = {'GT'}
  for q = 1, c do
    args[2 * q] = expiry
    args[2 * q + 1] = ARGV[4 + i + q]
  end
  redis.call('ZADD', pkey, unpack(args))
  i = i + c
end
redis.call('ZREMRANGEBYSCORE', pkey, '-inf', now)
local card = redis.call('ZCARD', pkey)
if card > cap then
  -- trim whole expiry groups (a request's keys share one expiry), never part of one
  local cut = redis.call('ZRANGE', pkey, card - cap - 1, card - cap - 1, 'WITHSCORES')
  redis.call('ZREMRANGEBYSCORE', pkey, '-inf', cut[2])
  card = redis.call('ZCARD', pkey)
end
if card > 0 then
  local top = redis.call('ZRANGE', pkey, -1, -1, 'WITHSCORES')
  local ttl = tonumber(top[2]) - now + tonumber(ARGV[4])
  if ttl < 1 then ttl = 1 end
  redis.call('PEXPIRE', pkey, math.floor(ttl))
end
return card
"""

# KEYS[1] the replica's pending anchor (as ADD_PENDING). ARGV: expiry_ms (the write being
# undone), now_ms, then per key: the key, the expiry to set it back to (0: none). Only a
# key still at expiry_ms changes (a later write raised it otherwise: that one's). A key is
# dropped by moving its score to 0 and trimming expired scores: ZADD and ZREMRANGEBYSCORE
# are what the gateway's ACL already grants (ZREM is not), so deployed users need no change.
REMOVE_PENDING_LUA = """
local anchor = KEYS[1]
local epoch = redis.call('HGET', string.sub(anchor, 1, -5) .. 'meta', 'epoch') or '0'
local pkey = anchor .. ':' .. epoch
local mine = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
local changed = 0
for i = 3, #ARGV - 1, 2 do
  local k = ARGV[i]
  local sc = redis.call('ZSCORE', pkey, k)
  if sc and tonumber(sc) == mine then
    local to = tonumber(ARGV[i + 1])
    if to <= now then to = 0 end
    redis.call('ZADD', pkey, 'XX', to, k)
    changed = changed + 1
  end
end
if changed > 0 then redis.call('ZREMRANGEBYSCORE', pkey, '-inf', now) end
return changed
"""

# KEYS[1] meta. ARGV: since_ms, block keys. Per key its score in the removal log (the time
# of its latest logged removal, as the agent wrote it: compared with since_ms and judged by
# the caller, since a rogue agent can write any score), false if none; -1 (not a list) when
# the log was trimmed past since_ms, or when the agent-owned keys hold what no agent writes
# (an rm_floor that is no number, an rm key that is no sorted set): "cannot tell", never a
# script error, which the gateway would take for its own failure and not count
# (RedisIndex.removal_floor says which).
REMOVED_SINCE_LUA = """#!lua flags=no-writes
local meta = KEYS[1]
local m = redis.pcall('HMGET', meta, 'epoch', 'rm_floor')
if m.err then return -1 end
local since = tonumber(ARGV[1])
local floor = tonumber(m[2] or '-1')
if floor == nil or floor >= since then return -1 end
if #ARGV < 2 then return {} end
local rkey = string.sub(meta, 1, -5) .. 'rm:' .. (m[1] or '0')
local scores = redis.pcall('ZMSCORE', rkey, unpack(ARGV, 2))
if scores.err then return -1 end
return scores
"""

# KEYS[1] meta, KEYS[2] an epoch-scoped key, ARGV[1] its epoch: unlink it iff that epoch is
# not the replica's current one (atomic, so a concurrent clear cannot lose the live epoch).
SWEEP_LUA = """
local cur = redis.call('HGET', KEYS[1], 'epoch') or '0'
if cur ~= ARGV[1] then
  return redis.call('UNLINK', KEYS[2])
end
return 0
"""

# KEYS[1] meta. The current epoch and the HLEN of its b: and m: hashes, read together: the
# agent's index check compares them with its mirror, since an evicting Redis (allkeys-*)
# drops those hashes while the meta, which the check itself reads, stays.
COUNTS_LUA = """#!lua flags=no-writes
local meta = KEYS[1]
local epoch = redis.call('HGET', meta, 'epoch') or '0'
local base = string.sub(meta, 1, -5)
return {epoch, redis.call('HLEN', base .. 'b:' .. epoch), redis.call('HLEN', base .. 'm:' .. epoch)}
"""

# KEYS: one meta key per replica (on Cluster none, the metas in ARGV: call_per_replica).
# Per replica a row: whether the meta exists, its epoch, state, last_seq, engine_start and
# updated_ms as stored (nil when absent), then HLEN of b: and m:, ZCARD of rm: and gw:p: of
# that epoch, whether a registration key exists, and 1 when one of those keys was of the
# wrong type (read as empty). Commands the sweeper ACL grants (operators run it with that).
INSPECT_LUA = """#!lua flags=no-writes,allow-cross-slot-keys
local wrong
local function read(r, absent)
  if type(r) == 'table' and r.err then
    if string.find(r.err, 'WRONGTYPE', 1, true) ~= 1 then error(r) end
    wrong = 1
    return absent
  end
  return r
end
local metas = KEYS
if #KEYS == 0 then metas = ARGV end
local out = {}
for r = 1, #metas do
  local meta = metas[r]
  local base = string.sub(meta, 1, -5)
  wrong = 0
  local m = read(redis.pcall('HMGET', meta, 'epoch', 'state', 'last_seq', 'engine_start',
                             'updated_ms'), {false, false, false, false, false})
  local epoch = m[1] or '0'
  out[r] = {
    redis.call('EXISTS', meta), m[1], m[2], m[3], m[4], m[5],
    read(redis.pcall('HLEN', base .. 'b:' .. epoch), 0),
    read(redis.pcall('HLEN', base .. 'm:' .. epoch), 0),
    read(redis.pcall('ZCARD', base .. 'rm:' .. epoch), 0),
    read(redis.pcall('ZCARD', base .. 'gw:p:' .. epoch), 0),
    redis.call('EXISTS', base .. 'reg'), wrong,
  }
end
return out
"""

# KEYS[1] meta, KEYS[2..] the replica's epoch-scoped keys a SCAN found (any epoch). ARGV:
# now_ms, idle_ms, force, check. Unless forced, refuses ({'registered'}) while a registration
# key exists, ({'recent', updated_ms}) when the meta was updated less than idle_ms ago, or
# ({'active', expiry_ms}) when a gateway's pending entry or in-flight liveness expired less
# than idle_ms ago (or has not yet): a replica with no agent (static, gateway-only) has no
# meta, and gateways routing to it are its only sign of life. An expiry stands in for the
# write before it (never later): the safe side. With check '1' it unlinks nothing and
# answers {'forgettable'}. Else unlinks them, the meta, the current epoch's keys (created
# since the SCAN) and the keys with no epoch, all at once: a returning agent finds no meta
# and builds a new replica from epoch 1, into which no key of the old one survives (its
# clear unlinks only epoch 0's).
FORGET_LUA = """
local meta = KEYS[1]
local base = string.sub(meta, 1, -5)
local m = redis.pcall('HMGET', meta, 'epoch', 'updated_ms')
if m.err then m = {} end  -- a meta made no hash: nothing an agent keeps up to date
local epoch = m[1] or '0'
local names = {meta, base .. 'reg', base .. 'load', base .. 'gw:inflight',
               base .. 'b:' .. epoch, base .. 'm:' .. epoch, base .. 'rm:' .. epoch,
               base .. 'gw:p:' .. epoch}
for i = 2, #KEYS do names[#names + 1] = KEYS[i] end
if ARGV[3] ~= '1' then
  local now, idle = tonumber(ARGV[1]), tonumber(ARGV[2])
  if redis.call('EXISTS', base .. 'reg') == 1 then return {'registered'} end
  local updated = tonumber(m[2] or '')
  if updated and now - updated < idle then
    return {'recent', m[2]}
  end
  -- gateway-owned keys of the wrong type read as no activity (pcall), as in lookups
  local newest = nil
  local function seen(v)
    v = tonumber(v)
    if v and (newest == nil or v > newest) then newest = v end
  end
  local pending = base .. 'gw:p:'
  for i = 1, #names do
    if string.sub(names[i], 1, #pending) == pending then
      local top = redis.pcall('ZRANGE', names[i], -1, -1, 'WITHSCORES')
      if not top.err and top[2] then seen(top[2]) end
    end
  end
  local f = redis.pcall('HGETALL', base .. 'gw:inflight')
  if not f.err then
    for i = 1, #f, 2 do
      if string.sub(f[i], -2) == ':x' then seen(f[i + 1]) end
    end
  end
  if newest and now - math.min(newest, now) < idle then return {'active', newest} end
end
if ARGV[4] == '1' then return {'forgettable'} end
return {'forgotten', redis.call('UNLINK', unpack(names))}
"""


def c_packing(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """``cls`` (a redis-py asyncio connection class) packing commands with hiredis's C
    packer. redis-py's asyncio connections pack in Python, a few calls per argument: on the
    agent's writes (tens of thousands of arguments each) that was a quarter of the agent's
    CPU. Same bytes on the wire; anything the C packer refuses (bytearray, values redis-py
    rejects with DataError, a command name holding a space) goes the Python way."""
    if hiredis is None:  # pragma: no cover
        return cls
    # a new subclass per call (one per client built, a handful per process): no
    # module-level cache of them
    python_pack = cls.pack_command
    c_pack = hiredis.pack_command

    def pack_command(self: AbstractConnection, *args: Any) -> list[bytes]:
        head = args[0] if args else None
        if (type(head) is str and " " not in head) or (type(head) is bytes and b" " not in head):
            try:
                return [c_pack(args)]
            except TypeError:
                pass
        return python_pack(self, *args)

    return type(f"CPacked{cls.__name__}", (cls,), {"pack_command": pack_command})


# how often a client logs the connect failures no command saw (:func:`shielded_connects`)
CONNECT_WARNING_INTERVAL_S = 60.0


def shielded_connects(cls: type[AbstractConnection]) -> type[AbstractConnection]:
    """``cls`` (a redis-py asyncio connection class) whose connect attempt, once begun, runs
    to its end in a task of its own, whatever becomes of the command that began it, and
    whose last owed reply, once its command is cut, is read to its end in a task of its own
    too. redis-py connects lazily, inside the first command that takes the connection, and a
    cancellation of that command dropped the connect half made (``connect_check_health``
    disconnects on BaseException; a cut TCP connect closes its socket). The gateway cuts
    its lookups at ``index.lookup_timeout_ms`` (5 ms): where a connect and its handshake
    (TCP, AUTH/HELLO, CLIENT SETINFO, SELECT) took longer, each lookup began one and threw
    it away, and after a Redis restart or a dropped connection the lookups fell back for
    as long as nothing but lookups used the client (20 in 20 on a 20 ms handshake, a new
    connection each). Now the cut command still gives up at its cut, and its connect
    attempt goes on, bounded by the client's connect and read timeouts, leaving the
    connection in its pool connected. While it runs, the connection reads as not connected
    to every task but its own, so a command that takes it meanwhile waits for that same
    connect instead of writing into its handshake; a disconnect (the client's close)
    cancels it. An attempt that fails with no command waiting for it is logged (WARNING, at
    most once per :data:`CONNECT_WARNING_INTERVAL_S` per client): its lookups read only as
    timeouts.

    A command cut while waiting for its reply: redis-py disconnects, since the reply left
    on the wire would be read as the next command's. Under a Redis whose replies take a
    little longer than the cut (a loaded host, a slow link) every lookup then opened a new
    connection (50 lookups answered 8 ms late, a 5 ms cut: 34-37 connections). The connection
    counts the replies it owes (commands packed and sent, replies read); when the cut read
    is of the last one, the read goes on in a task of its own, bounded by the client's
    read timeout, and the connection reads as not connected meanwhile, as while
    connecting: a command that takes it waits for the reply to be read (a disconnect
    cancels the read). A read it fails disconnects, as redis-py's does. Where the count is
    not known (a command sent other than packed here, one whose replies are not one, a
    read of another form: pub/sub; any, once WATCH was sent) or more replies are owed (a
    pipeline, MULTI/EXEC), or the parser is not hiredis's (whose state lives in its
    reader, resumable after a cancelled socket read), the cut disconnects as before. One
    such read per connection: at most the pool's size."""

    def running(conn: Any) -> asyncio.Task[None] | None:
        """``conn``'s connect or reply read in flight in another task than the caller's."""
        task: asyncio.Task[None] | None = _busy(conn)
        if task is None:
            return None
        try:
            current = asyncio.current_task()
        except RuntimeError:  # no running loop: a finaliser
            current = None
        return None if task is current else task

    # per client (a class per client): when a failed connect was last logged
    warned_at = -math.inf

    def retrieved(conn: Any, task: asyncio.Task[None]) -> None:
        """Log the attempt's error where no command waits for it: the commands that began
        it were cut (a lookup's 5 ms), so a handshake that fails after the cut (a wrong
        password, a TLS error) read only as lookup timeouts, its cause never seen. Type and
        message only: redis-py's messages name the host, never the password."""
        nonlocal warned_at
        if task.cancelled() or conn._kvgate_waiting:
            return
        exc = task.exception()
        now = time.monotonic()
        if exc is None or now - warned_at < CONNECT_WARNING_INTERVAL_S:
            return
        warned_at = now
        log.warning(
            "redis connect failed after the commands that began it gave up",
            extra={"error": type(exc).__name__, "detail": str(exc)},
        )

    def drained(task: asyncio.Task[None]) -> None:
        # a read that fails has disconnected (the next command reconnects): nothing to report
        if not task.cancelled() and task.exception() is not None:
            log.debug("a cut command's reply was not read", exc_info=task.exception())

    class Shielded(cls):  # type: ignore[valid-type,misc]  # a class made at run time
        _kvgate_connect: asyncio.Task[None] | None = None
        _kvgate_waiting = 0  # commands awaiting the attempt
        _kvgate_drain: asyncio.Task[None] | None = None  # a cut command's reply being read
        _kvgate_owed = 0  # replies owed on the wire; -1: not known
        # the last packed command(s) and their replies (-1: not one a command), until sent;
        # one tuple, swapped whole: redis-py packs a large pipeline in a worker thread, and
        # two attributes written apart could be read torn (a count from another packing)
        _kvgate_packed: tuple[Any, int] | None = None

        @property
        def is_connected(self) -> bool:
            return running(self) is None and bool(super().is_connected)

        def pack_command(self, *args: Any) -> Any:
            packed = super().pack_command(*args)
            self._kvgate_packed = (packed, 1 if _one_reply(args) else -1)
            return packed

        def pack_commands(self, commands: Any) -> Any:
            commands = list(commands)
            packed = super().pack_commands(commands)
            n = len(commands) if all(map(_one_reply, commands)) else -1
            self._kvgate_packed = (packed, n)
            return packed

        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            last = self._kvgate_packed
            n = last[1] if last is not None and command is last[0] else -1
            self._kvgate_packed = None
            current = asyncio.current_task()
            asked = current.cancelling() if current is not None else 0
            await super().send_packed_command(command, check_health)
            owed = self._kvgate_owed  # read after a connect the send made, which zeroes it
            self._kvgate_owed = owed + n if n > 0 and owed >= 0 else -1
            if current is None or current.cancelling() <= asked:
                return
            # cut during the write, and written: redis-py writes under asyncio.wait_for,
            # which on Python 3.11 returns a result that is ready along with the
            # cancellation, so the cut command went on to wait for its reply, up to the
            # read timeout (a lookup cut at 5 ms answered after 70 ms, its cut lost)
            try:
                await asyncio.sleep(0)  # a cancellation still pending is delivered here
            except asyncio.CancelledError:
                await self._kvgate_unread()
                raise
            await self._kvgate_unread()
            raise asyncio.CancelledError  # the one wait_for swallowed

        async def _kvgate_unread(self) -> None:
            """The reply just sent for is not its command's to read (cut): read on in a
            task of its own if it is the last owed, else disconnect."""
            if (
                self._kvgate_owed == 1
                and isinstance(self._parser, _AsyncHiredisParser)
                and super().is_connected
                and self._kvgate_connect is not asyncio.current_task()
            ):
                self._kvgate_read_on_later(False)
            else:
                await self.disconnect(nowait=True)

        def _kvgate_read_on_later(self, disable_decoding: bool) -> None:
            self._kvgate_drain = asyncio.ensure_future(self._kvgate_read_on(disable_decoding))
            self._kvgate_drain.add_done_callback(drained)

        def _kvgate_read_one(self) -> None:
            owed = self._kvgate_owed
            self._kvgate_owed = owed - 1 if owed > 0 else -1

        async def read_response(
            self,
            disable_decoding: bool = False,
            timeout: float | None = None,  # noqa: ASYNC109  # redis-py's signature
            *,
            disconnect_on_error: bool = True,
            push_request: bool | None = False,
        ) -> Any:
            read = super().read_response
            if timeout is not None or not disconnect_on_error or push_request:
                self._kvgate_owed = -1  # pub/sub's reads: replies not one a command
                return await read(
                    disable_decoding,
                    timeout,
                    disconnect_on_error=disconnect_on_error,
                    push_request=push_request,
                )
            if not (self._kvgate_owed == 1 and isinstance(self._parser, _AsyncHiredisParser)):
                try:
                    response = await read(disable_decoding)
                except ResponseError:  # a reply, read (any other error disconnected)
                    self._kvgate_read_one()
                    raise
                self._kvgate_read_one()
                return response
            # the last reply owed: a cut leaves it to a task of its own (see the class)
            try:
                response = await read(disable_decoding, disconnect_on_error=False)
            except ResponseError:  # raised after the reply was read (redis-py keeps the
                self._kvgate_read_one()  # connection)
                raise
            except asyncio.CancelledError:
                if not super().is_connected or self._kvgate_connect is asyncio.current_task():
                    raise
                self._kvgate_read_on_later(disable_decoding)
                raise
            except BaseException:
                await self.disconnect(nowait=True)  # what disconnect_on_error does
                raise
            self._kvgate_read_one()
            return response

        async def _kvgate_read_on(self, disable_decoding: bool) -> None:
            """Read the reply a cut command left, bounded by the client's read timeout; a
            failure disconnects (redis-py's read does)."""
            with contextlib.suppress(ResponseError):
                await super().read_response(disable_decoding)
            self._kvgate_read_one()

        # one attempt (TCP and handshake), not connect()'s retries: a retry's back-off
        # would keep a Redis that is back unused by the lookups waiting on it
        async def connect_check_health(
            self, check_health: bool = True, retry_socket_connect: bool = True
        ) -> None:
            parent = super().connect_check_health
            await self._kvgate_shielded(lambda: parent(check_health, retry_socket_connect))

        async def _kvgate_shielded(self, start: Callable[[], Awaitable[None]]) -> None:
            drain = self._kvgate_drain
            if drain is not None and not drain.done() and drain is not asyncio.current_task():
                await asyncio.wait([drain])  # its outcome is its own, not this command's
                current = asyncio.current_task()
                if drain.cancelled() and current is not None and not current.cancelling():
                    # a disconnect (the client's close) ended it: as for a connect below
                    raise RedisConnectionError("connection closed while reading a reply")
            task = self._kvgate_connect
            if task is not None and not task.done():
                if task is asyncio.current_task():  # redis-py's own nested call
                    await start()
                    return
            elif super().is_connected:  # the common case: one attribute read more
                return
            else:
                task = self._kvgate_connect = asyncio.ensure_future(self._kvgate_attempt(start))
                task.add_done_callback(lambda done: retrieved(self, done))
            self._kvgate_waiting += 1
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if task.cancelled() and current is not None and not current.cancelling():
                    # a disconnect (the client's close) ended the attempt, not this
                    # command's cancellation: a lost connection to it, which the index's
                    # callers catch (a CancelledError would escape their fallback)
                    raise RedisConnectionError("connection closed while connecting") from None
                raise
            finally:
                self._kvgate_waiting -= 1

        async def _kvgate_attempt(self, start: Callable[[], Awaitable[None]]) -> None:
            await start()
            self._kvgate_owed = 0  # a new connection owes nothing, whatever its handshake

        async def disconnect(self, *args: Any, **kwargs: Any) -> None:
            task = running(self)
            if task is not None:  # its own clean-up closes what it opened
                task.cancel()
                await asyncio.wait([task])
            try:
                await super().disconnect(*args, **kwargs)
            finally:
                self._kvgate_owed = 0

    Shielded.__name__ = Shielded.__qualname__ = f"Shielded{cls.__name__}"
    return Shielded


# commands whose replies are not one per command (pub/sub's, MONITOR's, CLIENT REPLY's),
# and WATCH: its connection then owes replies "not known" until it reconnects, so a cut
# disconnects as before. Kept, it kept the WATCH: a pipeline cut while watching skips its
# UNWATCH (redis-py sends none to a connection that reads as not connected, as one
# reading a reply on does), and another caller's MULTI/EXEC on it failed (WatchError).
_NOT_ONE_REPLY = frozenset(
    {"SUBSCRIBE", "PSUBSCRIBE", "SSUBSCRIBE", "UNSUBSCRIBE", "PUNSUBSCRIBE", "SUNSUBSCRIBE"}
    | {"MONITOR", "CLIENT REPLY", "RESET", "QUIT", "WATCH"}
)


def _one_reply(args: Sequence[Any]) -> bool:
    """Whether the command ``args`` is answered by exactly one reply (a name redis-py
    writes as one argument, "CLIENT REPLY", or in two)."""
    words = _word(args[0] if args else None).split()
    if words[:1] == ["CLIENT"] and len(words) == 1 and len(args) > 1:
        words.append(_word(args[1]))
    return (
        bool(words) and words[0] not in _NOT_ONE_REPLY and " ".join(words[:2]) not in _NOT_ONE_REPLY
    )


def _word(arg: Any) -> str:
    """``arg`` (a command's name, or its subcommand) in capitals; "" if not text."""
    if isinstance(arg, bytes):
        arg = arg.decode("latin-1")
    return arg.upper() if isinstance(arg, str) else ""


def _busy(conn: AbstractConnection) -> asyncio.Task[None] | None:
    """``conn``'s shielded connect attempt or cut command's reply read
    (:func:`shielded_connects`) while it runs, else None."""
    for name in ("_kvgate_connect", "_kvgate_drain"):
        task: asyncio.Task[None] | None = getattr(conn, name, None)
        if task is not None and not task.done():
            return task
    return None


class _ConnectedFirstPool(aioredis.ConnectionPool):
    """The standalone pool of shielded connections: it hands out an idle connection whose
    connect attempt (or cut command's reply read) still runs only when every idle one's
    does. redis-py's pool takes the one released last, and a cut command releases its
    connection mid-connect, so one stuck connect (a lost SYN, a stalled handshake) was
    handed to each next lookup to wait on, and cut, until it timed out, while a connected
    connection sat idle beside it."""

    def get_available_connection(self) -> AbstractConnection:
        idle = self._available_connections
        if idle and _busy(idle[-1]):
            ready = next((i for i in reversed(range(len(idle))) if not _busy(idle[i])), None)
            if ready is not None:
                idle.append(idle.pop(ready))
        conn: AbstractConnection = super().get_available_connection()  # type: ignore[no-untyped-call]
        return conn


# Unbounded, as redis-py's standalone pool is by default. RedisCluster's own default (100
# per node) raises MaxConnectionsError, not waits, on a burst the standalone pool absorbs.
_UNBOUNDED_CONNECTIONS = 2**31


def _check_database(url: str) -> None:
    """redis-py reads a path that is no number (``redis://host/abc``, a typo) as database
    0: another deployment's database, written without a word. Refused instead (the URL is
    not quoted: it may hold a password)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"the redis URL's database must be a number, got {db!r}")


def check_redis_url(url: str) -> str:
    """``url`` if redis-py can connect with it, else ValueError with redis-py's reason
    (which names the part, never the password): the settings call it, so a bad URL is an
    error naming its flag at start-up, not "Port could not be cast to integer value as
    'abc'" out of a client built later (read as a --port problem)."""
    parse_url(url)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
    _check_database(url)
    return url


class RedisTimeouts(TypedDict, total=False):
    """The timeout arguments of the stores' ``from_url`` (index, load store, registry)."""

    socket_timeout_s: float
    connect_timeout_s: float


def redis_timeouts(timeout_s: float | None) -> RedisTimeouts:
    """``from_url`` arguments for an operator's Redis timeout (``KVGATE_REDIS_TIMEOUT_S``,
    ``KVGATE_AGENT_REDIS_TIMEOUT_S``): ``timeout_s`` to connect and to read, or with None
    none, each store keeping its own defaults."""
    if timeout_s is None:
        return {}
    return {"socket_timeout_s": timeout_s, "connect_timeout_s": timeout_s}


def redis_client(
    url: str,
    *,
    cluster: bool = False,
    socket_timeout_s: float,
    connect_timeout_s: float,
    max_connections: int | None = None,
    c_pack: bool = False,
    shield_connects: bool = False,
) -> RedisClient:
    """A standalone client of ``url``, or with ``cluster`` a Redis Cluster client seeded by
    it, with the same options either way: timeouts, ``max_connections`` (on Cluster a limit
    per node, each node having its own pool; ``None``: unbounded) and, with ``c_pack``,
    hiredis command packing (:func:`c_packing`), with ``shield_connects`` connects that
    outlive their commands' cancellation (:func:`shielded_connects`). A URL that Cluster
    refuses (a database other than 0, a unix socket) raises ValueError here, at start-up,
    rather than at the first command (the client connects lazily)."""
    _check_database(url)
    limit = _UNBOUNDED_CONNECTIONS if max_connections is None else max_connections
    if not cluster:
        pool_class = _ConnectedFirstPool if shield_connects else aioredis.ConnectionPool
        pool = pool_class.from_url(
            url,
            decode_responses=False,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            max_connections=limit,
        )
        pool.connection_class = _connection_class(pool.connection_class, c_pack, shield_connects)
        return aioredis.Redis.from_pool(pool)  # as Redis.from_url: the client owns its pool
    try:
        cluster_client = RedisCluster.from_url(
            url,
            decode_responses=False,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            max_connections=limit,
        )
    except RedisClusterException as exc:
        raise ValueError(f"redis_cluster is on, but: {exc}") from None
    if c_pack or shield_connects:
        # RedisCluster takes no connection_class: it creates every node (those it discovers
        # later too) from its shared connection_kwargs, which nothing has used yet (the
        # client connects lazily). Safe to pack in C: ClusterNode sends commands and
        # pipelines through Connection.pack_command / pack_commands, as standalone does,
        # and routing reads the arguments before packing, never the packed bytes. Its
        # nodes connect in send_packed_command (connect_check_health), which is shielded.
        conn_kwargs = cluster_client.connection_kwargs
        conn_kwargs["connection_class"] = _connection_class(
            conn_kwargs["connection_class"], c_pack, shield_connects
        )
        for node in cluster_client.nodes_manager.startup_nodes.values():
            node.connection_class = conn_kwargs["connection_class"]
    return cluster_client


def _connection_class(
    cls: type[AbstractConnection], c_pack: bool, shield_connects: bool
) -> type[AbstractConnection]:
    if c_pack:
        cls = c_packing(cls)
    # outermost: the shield counts the commands packed (a reply owed each)
    return shielded_connects(cls) if shield_connects else cls


# what redis-py's Cluster client raises when a node refuses CLUSTER SLOTS: a standalone
# server's "cluster support disabled", but an ACL user without +cluster|slots reads the same
_NOT_A_CLUSTER = "cluster mode is not enabled"


def not_a_cluster(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a Cluster client's "Cluster
    mode is not enabled": a node that answers but refuses CLUSTER SLOTS. No outage, so no
    retry helps; :func:`cluster_mode_problem` tells the two causes apart."""
    while exc is not None:
        if _NOT_A_CLUSTER in str(exc).lower():
            return True
        exc = exc.__cause__
    return False


async def cluster_mode_problem(url: str, cluster: bool, switch: str) -> str | None:
    """With ``cluster`` (``switch`` names that setting), why the server at ``url`` is no
    Redis Cluster node, or None. Asked of the node itself (``INFO cluster``'s
    ``cluster_enabled``, else CLUSTER SLOTS' own error) by a throw-away standalone client,
    so any event loop may run it at start-up: the Cluster client's "Cluster mode is not
    enabled" was taken for an outage for ever (the gateway fell back on every lookup, the
    agent retried "index not reachable"). A server that does not answer is None: no
    mismatch, the callers' outage handling applies."""
    if not cluster:
        return None
    client = redis_client(url, socket_timeout_s=2.0, connect_timeout_s=2.0)
    enabled: bool | None = None
    try:
        try:
            info = await client.info("cluster")
            if "cluster_enabled" in info:
                enabled = bool(int(info["cluster_enabled"]))
        except REDIS_FAILURES:  # an ACL without INFO: the command's own answer below
            pass
        if enabled is None:
            try:
                await client.execute_command("CLUSTER", "SLOTS")
                enabled = True
            except ResponseError as exc:
                enabled = False if "cluster support disabled" in str(exc).lower() else None
            except REDIS_FAILURES:
                enabled = None
    finally:
        try:
            await client.aclose()
        except REDIS_FAILURES:
            log.debug("redis close failed", exc_info=True)
    if enabled is not False:
        return None
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if parts.hostname and ":" in parts.hostname else parts.hostname
    return (
        f"{switch} is set but {host}:{parts.port or 6379} is not a Redis Cluster node "
        "(cluster_enabled:0): drop the switch for a standalone Redis"
    )


class RedisScript:
    """A Lua script called by SHA; loaded on first NOSCRIPT (a Redis restart or failover
    empties the script cache) and retried once. ``readonly`` scripts run with
    ``EVALSHA_RO`` (Redis 7.0): their declared keys need only read permission, which is
    what a gateway's ACL grants on agent-owned keys, and they may run on replicas."""

    def __init__(self, source: str, readonly: bool = False) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.command = "EVALSHA_RO" if readonly else "EVALSHA"

    async def call(self, client: RedisClient, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        cmd = (self.command, self.sha, len(keys), *keys, *args)
        try:
            return await client.execute_command(*cmd)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.execute_command(*cmd)

    async def call_on_node(
        self, cluster: RedisCluster, node: Any, keys: Sequence[Any], args: Sequence[Any]
    ) -> Any:
        """Cluster: run on ``node``, which must own ``keys`` (declared keys must also share
        one slot: Redis refuses CROSSSLOT declared keys even with allow-cross-slot-keys)."""
        cmd = (self.command, self.sha, len(keys), *keys, *args)
        try:
            return await cluster.execute_command(*cmd, target_nodes=node)
        except NoScriptError:
            await cluster.execute_command("SCRIPT", "LOAD", self.source, target_nodes=node)
            return await cluster.execute_command(*cmd, target_nodes=node)

    def queue(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Queue a call by SHA on a pipeline (a NOSCRIPT reply is the caller's to handle).
        Through ``execute_command``: redis-py's cluster pipeline refuses its ``evalsha``
        method, yet routes the raw command by its keys (which must share one slot)."""
        pipe.execute_command(self.command, self.sha, len(keys), *keys, *args)


async def call_per_replica(
    client: RedisClient,
    script: RedisScript,
    layout: KeyLayout,
    replicas: Sequence[str],
    key_of: Callable[[str], str],
    args: Sequence[Any],
) -> tuple[list[Any], int]:
    """Run a read script whose KEYS are one key per replica (``key_of(replica)``) and
    whose reply is one row per key, in ONE call on standalone Redis and one call per shard,
    concurrently, on Cluster. Returns the rows in ``replicas`` order and the number of calls
    made.

    On Cluster a shard's keys span several slots, and Redis refuses declared keys of
    different slots (CROSSSLOT) whatever the script's flags; so there the call declares no
    keys and passes them after ``args`` in ARGV, where the script (flagged
    ``allow-cross-slot-keys``, which lets it reach undeclared keys of several slots of its
    node) must look for them when ``#KEYS == 0``."""
    keys = [key_of(r) for r in replicas]  # validates every id
    if not isinstance(client, RedisCluster):
        return list(await script.call(client, keys, args)), 1
    # the slot map is loaded lazily by the first command, or reloaded after a connection
    # error; without this a fresh client's first lookup raised a bare KeyError (no map)
    await client.initialize()  # a no-op once loaded
    nodes: dict[str, Any] = {}

    def shard_of_slot(slot: int) -> str:
        node = client.nodes_manager.get_node_from_slot(slot)
        nodes[node.name] = node
        return str(node.name)

    groups = group_by_shard(replicas, layout, shard_of_slot)
    results = await asyncio.gather(
        *(
            script.call_on_node(client, nodes[name], [], [*args, *map(key_of, group)])
            for name, group in groups.items()
        )
    )
    by_replica: dict[str, Any] = {}
    for group, rows in zip(groups.values(), results, strict=True):
        by_replica.update(zip(group, rows, strict=True))
    return [by_replica[r] for r in replicas], len(groups)


def _stale_or_index_error(exc: BaseException, what: str) -> IndexError_:
    if isinstance(exc, ResponseError) and str(exc).startswith("STALE"):
        return StaleEpochError(f"{what}: {exc}")
    return IndexError_(f"{what}: {type(exc).__name__}: {exc}")


def _state(raw: Any) -> ReplicaState:
    if isinstance(raw, bytes):
        raw = raw.decode()
    try:
        return ReplicaState(raw)
    except ValueError:
        return ReplicaState.UNKNOWN


_STATE_OF: Mapping[Any, ReplicaState] = MappingProxyType(
    {s.value.encode(): s for s in ReplicaState}
)


def _field_int(raw: bytes | str | None, default: int) -> int:
    """An agent-written integer field of the meta; ``default`` (as if absent) when it holds
    anything else."""
    got = _agent_int(raw, default)
    return default if got is None else got


def _agent_float(raw: bytes | str | None, default: float) -> float | None:
    """An agent-written number (``engine_start``); None unless a finite one."""
    if raw is None:
        return default
    try:
        got = float(raw)
    except ValueError:
        return None
    return got if math.isfinite(got) else None


def _or(value: _T | None, absent: _T) -> _T:
    return absent if value is None else value


def _meta_of(
    epoch: bytes | str | None,
    state: bytes | str | None,
    last_seq: bytes | str | None,
    engine_start: bytes | str | None,
    updated: bytes | str | None,
) -> ReplicaMeta:
    """A meta hash's fields as stored (None: absent) read as :class:`ReplicaMeta`."""
    # the agent's own fields: one that is no number (a broken or rogue agent's) reads
    # as absent, as removal_floor reads it as no integer, never a ValueError; named in
    # ``unreadable`` (the replica's own agent rebuilds it)
    ints = {
        "epoch": _agent_int(epoch, 0),
        "last_seq": _agent_int(last_seq, -1),
        "updated_ms": _agent_int(updated, 0),
    }
    start = _agent_float(engine_start, 0.0)
    absent = ReplicaMeta()
    return ReplicaMeta(
        epoch=_or(ints["epoch"], absent.epoch),
        state=_state(state) if state is not None else ReplicaState.UNKNOWN,
        last_seq=_or(ints["last_seq"], absent.last_seq),
        engine_start=_or(start, absent.engine_start),
        updated_ms=_or(ints["updated_ms"], absent.updated_ms),
        unreadable=tuple(name for name, v in [*ints.items(), ("engine_start", start)] if v is None),
    )


def _agent_int(raw: bytes | str | None, default: int) -> int | None:
    """An agent-written integer field; None when it holds anything else (a rogue agent's)."""
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ReplicaInspection:
    """What the index holds for one replica (``kvgate index stats``): its meta as
    :meth:`RedisIndex.meta` reads it (``has_meta`` False: there is none), the entries of its
    current epoch's ``b:``/``m:`` hashes and ``rm:``/``gw:p:`` sorted sets (pending entries
    counted whether expired or not: what Redis holds), whether a registration key exists,
    and whether one of those keys was of the wrong type (counted as empty)."""

    replica: str
    has_meta: bool
    meta: ReplicaMeta
    stored: int
    mirror: int
    removals: int
    pending: int
    registration: bool
    wrong_type: bool


@dataclass(frozen=True, slots=True)
class EntryCounts:
    """What :meth:`RedisIndex.entry_counts` read in one script: the replica's epoch (as
    stored; 0 absent) and the entries of that epoch's ``b:`` and ``m:`` hashes."""

    epoch: int
    blocks: int
    mirror: int


def evicts_any_key(policy: str | None) -> bool:
    """Whether a ``maxmemory-policy`` may evict keys without a TTL (``allkeys-*``): a
    replica's meta, entries or mirror, which the index requires kept (``noeviction`` or a
    ``volatile-*`` policy evicts only TTL'd soft state)."""
    return policy is not None and policy.startswith("allkeys-")


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What :meth:`RedisIndex.sweep_orphan_keys` unlinked, out of how many keys examined;
    ``complete`` False: it stopped at its bound with keys left to examine."""

    removed: list[str]
    examined: int
    complete: bool


@dataclass(frozen=True, slots=True)
class ForgetResult:
    """:meth:`RedisIndex.forget_replica`'s answer: ``unlinked`` keys, or why it refused
    (``registered``; ``recent`` with the meta's ``updated_ms``; ``active`` with
    ``active_ms``, the latest expiry of a gateway's pending entry or in-flight liveness)."""

    replica: str
    unlinked: int = 0
    refused: str = ""
    updated_ms: int | None = None
    active_ms: int | None = None


class RedisIndex:
    """:class:`~cachecore.index.base.PrefixIndex` on Redis.

    ``client`` must be created with ``decode_responses=False`` (keys are binary). Use
    :meth:`from_url` to get one with sensible hot-path timeouts.
    """

    def __init__(
        self,
        client: RedisClient,
        layout: KeyLayout | None = None,
        *,
        max_pending_per_replica: int = DEFAULT_MAX_PENDING_PER_REPLICA,
        max_write_fields: int = DEFAULT_MAX_WRITE_FIELDS,
        removal_log: int = DEFAULT_REMOVAL_LOG,
    ) -> None:
        if max_pending_per_replica <= 0 or max_write_fields <= 0 or removal_log < 0:
            raise ValueError("bounds must be positive")
        self.removal_log = removal_log  # 0: log nothing (then removed_since says "unknown")
        self.client = client
        self.layout = layout or KeyLayout()
        self.max_pending_per_replica = max_pending_per_replica
        self.max_write_fields = max_write_fields
        self._lookup = RedisScript(LOOKUP_LUA, readonly=True)
        self._apply = RedisScript(APPLY_LUA)
        self._clear = RedisScript(CLEAR_LUA)
        self._add_pending = RedisScript(ADD_PENDING_LUA)
        self._remove_pending = RedisScript(REMOVE_PENDING_LUA)
        self._sweep = RedisScript(SWEEP_LUA)
        self._removed_since = RedisScript(REMOVED_SINCE_LUA, readonly=True)
        self._inspect = RedisScript(INSPECT_LUA, readonly=True)
        self._forget = RedisScript(FORGET_LUA)
        self._counts = RedisScript(COUNTS_LUA, readonly=True)
        self._meta_keys: dict[str, str] = {}
        self.round_trips = 0  # network calls issued (for benchmarks and tests)
        # called with a replica whose agent-owned keys a lookup found of the wrong type
        # (read as holding nothing): the gateway counts it (kvgate_index_unreadable)
        self.on_unreadable: Callable[[str], None] | None = None
        # the Redis from_url connected to (None: built on a client): what sibling() uses
        self._url: str | None = None
        self._cluster = False

    @classmethod
    def from_url(
        cls,
        url: str,
        layout: KeyLayout | None = None,
        *,
        cluster: bool = False,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float = 0.5,
        max_connections: int = 64,
        **kwargs: Any,
    ) -> RedisIndex:
        """Connect to ``redis://[user:password@]host:port/db`` (or a cluster seed node).
        In the gateway no lookup waits on these timeouts: ``GatewayIndex.lookup`` cuts each
        at the policy's ``index.lookup_timeout_ms``. They bound the rest: connects (which go
        on past a lookup's cut) and the gateway's pending writes. ``KVGATE_REDIS_TIMEOUT_S``
        sets both. The agents embedded in the gateway write through a :meth:`sibling` with
        their own."""
        client = redis_client(
            url,
            cluster=cluster,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            c_pack=True,
            shield_connects=True,  # lookups are cut (index.lookup_timeout_ms)
        )
        index = cls(client, layout, **kwargs)
        index._url, index._cluster = url, cluster
        return index

    def sibling(
        self,
        *,
        socket_timeout_s: float,
        connect_timeout_s: float,
        max_connections: int,
        removal_log: int | None = None,
    ) -> RedisIndex | None:
        """Another index on this one's Redis, with its layout and bounds (``removal_log``
        unless given), over a client and connection pool of its own with these timeouts
        (closed by its own :meth:`close`); None for an index not built by :meth:`from_url`
        (its Redis unknown). The gateway's embedded agents write through one: a standalone
        agent's write timeouts, not the lookup client's (0.25 s, under which every write to
        a slower Redis failed), and their own removal log's length."""
        if self._url is None:
            return None
        return type(self).from_url(
            self._url,
            self.layout,
            cluster=self._cluster,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_connections=max_connections,
            max_pending_per_replica=self.max_pending_per_replica,
            max_write_fields=self.max_write_fields,
            removal_log=self.removal_log if removal_log is None else removal_log,
        )

    @property
    def is_cluster(self) -> bool:
        return isinstance(self.client, RedisCluster)

    async def _call(self, script: RedisScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """One script call whose keys all live in one slot (one replica)."""
        self.round_trips += 1
        return await script.call(self.client, keys, args)

    # ------------------------------------------------------------------ lookup
    async def lookup(
        self, keys: Sequence[BlockKey], replicas: Sequence[str], now_ms: int
    ) -> dict[str, PrefixMatch]:
        if not replicas:
            return {}
        blob = b"".join(keys)
        if len(blob) != KEY_BYTES * len(keys):
            raise ValueError(f"block keys must be {KEY_BYTES} bytes")
        args = [now_ms, blob]
        try:
            rows, calls = await call_per_replica(
                self.client, self._lookup, self.layout, replicas, self._meta_key, args
            )
            self.round_trips += calls
        except RedisError as exc:
            raise _stale_or_index_error(exc, "lookup") from exc
        except (RedisClusterException, OSError) as exc:
            raise IndexError_(f"lookup: {exc}") from exc
        out: dict[str, PrefixMatch] = {}
        for rid, row in zip(replicas, rows, strict=True):
            if row[7] and self.on_unreadable is not None:
                self.on_unreadable(rid)
            state = _STATE_OF.get(row[0]) or _state(row[0])
            g, c, d, r, stored, pend = row[1:7]
            if not (g or c or d or r):  # the common miss: no dict per replica
                out[rid] = PrefixMatch(EMPTY_TIERS, int(stored), int(pend), state)
            else:
                tiers = {Tier.GPU: int(g), Tier.CPU: int(c), Tier.DISK: int(d), Tier.REMOTE: int(r)}
                out[rid] = PrefixMatch(tiers, int(stored), int(pend), state)
        return out

    def _meta_key(self, replica: str) -> str:
        """The replica's meta key, validated once: lookups name the same replicas over and
        over, and building + validating 16 names was a tenth of a lookup's client CPU."""
        key = self._meta_keys.get(replica)
        if key is None:
            key = self.layout.meta(replica)
            if len(self._meta_keys) >= 65_536:  # bounded: ids come from the fleet
                self._meta_keys.clear()
            self._meta_keys[replica] = key
        return key

    # ------------------------------------------------------------------ writes
    def _write_parts(self, epoch: int, write: IndexWrite, now_ms: int) -> list[list[Any]]:
        """ARGV lists of the apply script, split so no call carries more than
        ``max_write_fields`` entries; ``last_seq`` goes with the last part. Built with C
        loops (compress, zip, chain): a write carries up to tens of thousands of entries."""
        check_write_values(write)
        blocks = write.blocks
        bset: list[Any]
        bdel: list[Any]
        if 0 in blocks.values():
            kept = list(map(bool, blocks.values()))
            bset = list(zip(compress(blocks, kept), compress(blocks.values(), kept), strict=True))
            bdel = list(compress(blocks, map(not_, kept)))
        else:
            bset, bdel = list(blocks.items()), []
        mirror = write.mirror
        fields = engine_hash_fields(mirror.keys())
        mset: list[Any]
        mdel: list[Any]
        if None in mirror.values():
            present = list(map(is_not, mirror.values(), repeat(None)))
            mset = list(
                zip(compress(fields, present), compress(mirror.values(), present), strict=True)
            )
            mdel = list(compress(fields, map(not_, present)))
        else:
            mset, mdel = list(zip(fields, mirror.values(), strict=True)), []
        # deleted and stored again within the write: only the removal log sees them
        restored = [k for k in write.removed if blocks.get(k)] if write.removed else []
        sources = (bset, bdel, mset, mdel)
        pairs = (True, False, True, False)
        step = self.max_write_fields
        parts: list[list[Any]] = []
        i = [0, 0, 0, 0]
        while True:
            room = step
            chunks: list[list[Any]] = []
            for idx, src in enumerate(sources):
                take = src[i[idx] : i[idx] + room]
                i[idx] += len(take)
                room -= len(take)
                chunks.append(take)
            last = all(i[idx] >= len(src) for idx, src in enumerate(sources))
            seq = "" if (write.seq is None or not last) else str(write.seq)
            relog = restored if last else []
            argv: list[Any] = [
                epoch, now_ms, seq, *(len(c) for c in chunks), self.removal_log, len(relog)
            ]  # fmt: skip
            for chunk, paired in zip(chunks, pairs, strict=True):
                argv.extend(chain.from_iterable(chunk) if paired else chunk)
            argv.extend(relog)
            parts.append(argv)
            if last:
                return parts

    async def apply(self, replica: str, epoch: int, write: IndexWrite, now_ms: int) -> None:
        meta = self.layout.meta(replica)
        parts = self._write_parts(epoch, write, now_ms)
        try:
            if len(parts) == 1:
                await self._call(self._apply, [meta], parts[0])
                return
            await self._apply_pipelined(meta, parts)
        except RedisError as exc:
            raise _stale_or_index_error(exc, f"apply {replica}") from exc
        except (RedisClusterException, OSError) as exc:
            raise IndexError_(f"apply {replica}: {exc}") from exc

    async def _apply_pipelined(self, meta: str, parts: list[list[Any]]) -> None:
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for argv in parts:
                self._apply.queue(pipe, [meta], argv)  # one slot: one node, in order
            self.round_trips += 1
            results = await pipe.execute(raise_on_error=False)
            errors = [r for r in results if isinstance(r, Exception)]
            if not errors:
                return
            if attempt == 0 and any(isinstance(e, NoScriptError) for e in errors):
                await self.client.script_load(self._apply.source)
                continue
            raise errors[0]

    async def clear_replica(
        self, replica: str, state: ReplicaState, now_ms: int, engine_start: float = 0.0
    ) -> int:
        meta = self.layout.meta(replica)
        try:
            new = await self._call(
                self._clear, [meta], [state.value, now_ms, repr(float(engine_start))]
            )
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"clear {replica}") from exc
        return int(new)

    async def set_state(self, replica: str, state: ReplicaState, now_ms: int) -> None:
        meta = self.layout.meta(replica)
        try:
            self.round_trips += 1
            await self.client.hset(meta, mapping={"state": state.value, "updated_ms": now_ms})
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"set_state {replica}") from exc

    async def set_engine_start(self, replica: str, engine_start: float) -> None:
        meta = self.layout.meta(replica)
        try:
            self.round_trips += 1
            await self.client.hset(meta, "engine_start", repr(float(engine_start)))
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"set_engine_start {replica}") from exc

    async def add_pending(
        self, replica: str, keys: Sequence[BlockKey], ttl_ms: int, now_ms: int
    ) -> None:
        anchor = self.layout.pending_anchor(replica)
        args = [
            now_ms + ttl_ms,
            now_ms,
            self.max_pending_per_replica,
            PENDING_KEY_GRACE_MS,
            *keys,
        ]
        try:
            await self._call(self._add_pending, [anchor], args)
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"add_pending {replica}") from exc

    async def remove_pending(
        self,
        replica: str,
        keys: Sequence[BlockKey],
        expiry_ms: int,
        now_ms: int,
        restore: Sequence[int] | None = None,
    ) -> None:
        if not keys:
            return
        anchor = self.layout.pending_anchor(replica)
        back = restore if restore else repeat(0, len(keys))
        args = [expiry_ms, now_ms, *chain.from_iterable(zip(keys, back, strict=True))]
        try:
            await self._call(self._remove_pending, [anchor], args)
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"remove_pending {replica}") from exc

    # ------------------------------------------------------------------ reads
    async def removed_since(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[bool] | None:
        return removed_flags(await self.removal_times(replica, keys, since_ms))

    async def removal_times(
        self, replica: str, keys: Sequence[BlockKey], since_ms: int
    ) -> list[float | None] | None:
        meta = self.layout.meta(replica)
        try:
            raw = await self._call(self._removed_since, [meta], [since_ms, *keys])
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"removed_since {replica}") from exc
        if not isinstance(raw, list):
            return None
        # a score is a double: "inf" too, which a rogue may write (float reads it)
        return removals_at_or_after([None if v is None else float(v) for v in raw], since_ms)

    async def removal_floor(self, replica: str) -> RemovalFloor:
        meta = self.layout.meta(replica)
        try:
            self.round_trips += 1
            floor, updated = await self.client.hmget(meta, ["rm_floor", "updated_ms"])
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):  # its agent made its meta no hash
                return RemovalFloor(None, None)
            raise _stale_or_index_error(exc, f"removal_floor {replica}") from exc
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"removal_floor {replica}") from exc
        return RemovalFloor(_agent_int(floor, -1), _agent_int(updated, 0))

    async def meta(self, replica: str) -> ReplicaMeta:
        key = self.layout.meta(replica)
        try:
            self.round_trips += 1
            raw = await self.client.hmget(
                key, ["epoch", "state", "last_seq", "engine_start", "updated_ms"]
            )
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"meta {replica}") from exc
        return _meta_of(*raw)

    async def _scan_epoch_hash(self, replica: str, kind: str) -> dict[bytes, bytes]:
        """HSCAN the current epoch's ``b:`` or ``m:`` hash without blocking Redis; retried
        if the epoch moved while scanning (a clear in between)."""
        meta = self.layout.meta(replica)
        for _ in range(5):
            try:
                self.round_trips += 1
                epoch = _field_int(await self.client.hget(meta, "epoch"), 0)
                key = (
                    self.layout.blocks(replica, epoch)
                    if kind == "b"
                    else self.layout.mirror(replica, epoch)
                )
                out: dict[bytes, bytes] = {}
                cursor = 0
                while True:
                    self.round_trips += 1
                    cursor, page = await self.client.hscan(key, cursor, count=2000)
                    out.update(page)  # type: ignore[arg-type]
                    if cursor == 0:
                        break
                self.round_trips += 1
                again = _field_int(await self.client.hget(meta, "epoch"), 0)
            except REDIS_FAILURES as exc:
                raise _stale_or_index_error(exc, f"scan {replica}") from exc
            if again == epoch:
                return out
        raise IndexError_(f"replica {replica}: epoch kept changing during a scan")

    async def load_mirror(self, replica: str) -> dict[int, bytes]:
        raw = await self._scan_epoch_hash(replica, "m")
        try:
            return {engine_hash_from_field(f): v for f, v in raw.items()}
        except ValueError as exc:  # a field no agent writes: no retry reads it better
            raise MirrorRecordError(f"replica {replica}: {exc}") from None

    async def replica_blocks(self, replica: str) -> dict[BlockKey, int]:
        raw = await self._scan_epoch_hash(replica, "b")
        return {f: int(v) for f, v in raw.items()}

    async def instance_id(self) -> str:
        """The Redis server's ``run_id``: it changes when Redis restarts (and lost its
        data), which tells agents to rewrite their mirror (issue 4)."""
        try:
            self.round_trips += 1
            if isinstance(self.client, RedisCluster):
                # redis-py sends INFO to one node by default; every primary's run_id is
                # needed (a restarted or failed-over primary lost, or may lack, writes)
                info = await self.client.info("server", target_nodes=RedisCluster.PRIMARIES)
            else:
                info = await self.client.info("server")
        except REDIS_FAILURES as exc:
            raise IndexError_(f"instance_id: {exc}") from exc
        if isinstance(self.client, RedisCluster):  # one dict per node
            ids = sorted(str(v.get("run_id")) for v in info.values() if isinstance(v, dict))
            return ",".join(ids)
        return str(info["run_id"])

    async def entry_counts(self, replica: str) -> EntryCounts:
        """The replica's epoch and how many entries its ``b:`` and ``m:`` hashes hold, in
        one read-only script (the agent's ACL allows it): the agent's periodic check
        compares them with its mirror to see entries Redis evicted (R6)."""
        meta = self.layout.meta(replica)
        try:
            epoch, blocks, mirror = await self._call(self._counts, [meta], [])
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"entry_counts {replica}") from exc
        return EntryCounts(_field_int(epoch, 0), int(blocks), int(mirror))

    async def eviction_policies(self) -> dict[str, str | None]:
        """Each primary's ``maxmemory-policy`` (one entry on standalone Redis; None where
        it could not be read). From ``INFO memory`` (its ``maxmemory_policy``, which the
        agent's and gateway's ACLs allow); where that lacks it, ``CONFIG GET``, which an
        ACL (kvgate's own rules too: CONFIG GET also reads passwords) may refuse. Raises
        IndexError_ only when Redis does not answer INFO."""
        client = self.client
        try:
            self.round_trips += 1
            if isinstance(client, RedisCluster):
                raw = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
            else:
                raw = await client.info("memory")
        except REDIS_FAILURES as exc:
            raise IndexError_(f"eviction_policies: {exc}") from exc
        # a cluster answers one dict per node (one node: redis-py returns its dict alone)
        per_node: dict[str, Any] = (
            dict(raw) if raw and all(isinstance(v, dict) for v in raw.values()) else {"": raw}
        )
        out: dict[str, str | None] = {}
        for node, info in per_node.items():
            got = info.get("maxmemory_policy")
            out[str(node)] = None if got is None else str(got)
        if isinstance(client, RedisCluster) or all(v is not None for v in out.values()):
            return out  # a cluster's CONFIG GET would go to one node: INFO's answer stands
        try:
            self.round_trips += 1
            conf = await client.config_get("maxmemory-policy")
        except REDIS_FAILURES:  # NOPERM under an ACL without CONFIG: unknown
            return out
        got = conf.get("maxmemory-policy", conf.get(b"maxmemory-policy"))  # type: ignore[call-overload]
        if got is not None:
            out = {"": got.decode() if isinstance(got, bytes) else str(got)}
        return out

    async def replicas(self) -> list[str]:
        """Every replica with a meta hash (SCAN; debugging, stats and the sweeper)."""
        out: list[str] = []
        try:
            async for raw in self.client.scan_iter(match=self.layout.meta_pattern(), count=1000):
                parsed = self.layout.parse(raw.decode())
                if parsed is not None:
                    out.append(parsed[0])
        except REDIS_FAILURES as exc:
            raise IndexError_(f"replicas: {exc}") from exc
        return sorted(out)

    async def stats(self) -> IndexStats:
        """O(entries): scans every current-epoch hash to count distinct keys (debug use)."""
        rids = await self.replicas()
        stored = pending = 0
        distinct: set[bytes] = set()
        try:
            for rid in rids:
                blocks = await self._scan_epoch_hash(rid, "b")
                stored += len(blocks)
                distinct.update(blocks)
                epoch = (await self.meta(rid)).epoch
                self.round_trips += 1
                pending += int(await self.client.zcard(self.layout.pending(rid, epoch)))
        except REDIS_FAILURES as exc:
            raise IndexError_(f"stats: {exc}") from exc
        return IndexStats(
            replicas=len(rids),
            stored_entries=stored,
            pending_entries=pending,
            distinct_keys=len(distinct),
            extra={"used_memory": float(await self.used_memory())},
        )

    async def used_memory(self) -> int:
        """Redis ``used_memory`` in bytes, summed over every primary on Cluster."""
        try:
            self.round_trips += 1
            if isinstance(self.client, RedisCluster):  # INFO goes to one node by default
                per_node = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                used = sum(int(v.get("used_memory", 0)) for v in per_node.values())
            else:
                used = (await self.client.info("memory")).get("used_memory", 0)
        except REDIS_FAILURES as exc:
            raise IndexError_(f"used_memory: {exc}") from exc
        return int(used) if isinstance(used, int | float) else 0

    # ------------------------------------------------------------------ operators
    # ``kvgate index`` (gateway/index_cli.py); the commands the sweeper ACL grants
    # (gateway_acl_rules(sweeper=True)) are all they send.

    async def keys_by_replica(self) -> dict[str, list[bytes]]:
        """Every key of this layout, grouped by replica (SCAN of every primary: O(keys in
        Redis), a few per replica, never blocking it)."""
        out: dict[str, list[bytes]] = {}
        try:
            async for raw in self.client.scan_iter(
                match=self.layout.replica_keys_pattern(), count=1000
            ):
                parsed = self.layout.parse(raw.decode())
                if parsed is not None:
                    out.setdefault(parsed[0], []).append(raw)
        except REDIS_FAILURES as exc:
            raise IndexError_(f"scan: {exc}") from exc
        return out

    async def inspect_replicas(
        self, replicas: Sequence[str], chunk: int = 256
    ) -> list[ReplicaInspection]:
        """What the index holds for each of ``replicas`` (in order): one read-only script
        per ``chunk`` replicas (per shard on Cluster), so a fleet of thousands neither
        makes thousands of round trips nor blocks Redis in one long script."""
        out: list[ReplicaInspection] = []
        for at in range(0, len(replicas), chunk):
            part = replicas[at : at + chunk]
            try:
                rows, calls = await call_per_replica(
                    self.client, self._inspect, self.layout, part, self._meta_key, []
                )
            except REDIS_FAILURES as exc:
                raise IndexError_(f"inspect: {exc}") from exc
            self.round_trips += calls
            for rid, row in zip(part, rows, strict=True):
                has_meta, *fields = row[:6]
                counts = [int(v) for v in row[6:12]]
                out.append(
                    ReplicaInspection(
                        replica=rid,
                        has_meta=bool(has_meta),
                        meta=_meta_of(*fields),
                        stored=counts[0],
                        mirror=counts[1],
                        removals=counts[2],
                        pending=counts[3],
                        registration=bool(counts[4]),
                        wrong_type=bool(counts[5]),
                    )
                )
        return out

    async def forget_replica(
        self,
        replica: str,
        keys: Sequence[bytes | str],
        *,
        now_ms: int,
        idle_ms: int,
        force: bool = False,
        check: bool = False,
    ) -> ForgetResult:
        """Unlink every key of ``replica`` (a departed one): its meta, its keys with no
        epoch, its current epoch's and every key of ``keys`` (what
        :meth:`keys_by_replica` found for it), at once. Unless ``force``, refused while it
        has a registration key, its meta was updated less than ``idle_ms`` before
        ``now_ms``, or a gateway's pending entry or in-flight liveness for it expired less
        than ``idle_ms`` before (gateways route to it: an agentless replica has no meta),
        all checked in the same script, so an agent or gateway that writes in between is
        never half-forgotten. ``check``: only say whether it would be refused (unlinked
        stays 0; nothing, not even the surplus orphans, is unlinked). An agent of that id
        that comes back later finds no meta and builds a new replica from scratch."""
        meta = self.layout.meta(replica)
        scoped: list[tuple[bytes | str, int]] = []  # epoch-scoped keys and their epochs
        for key in keys:
            parsed = self.layout.parse(key.decode() if isinstance(key, bytes) else key)
            if parsed is None or parsed[0] != replica:
                raise ValueError(f"{key!r} is no key of replica {replica!r}")
            if parsed[2] is not None:
                scoped.append((key, parsed[2]))
        head, rest = scoped[:_FORGET_KEYS_PER_CALL], scoped[_FORGET_KEYS_PER_CALL:]
        if check:
            rest = []
        try:
            for key, epoch in rest:  # a bounded script: the surplus goes as orphans first
                await self._call(self._sweep, [meta, key], [epoch])
            reply = await self._call(
                self._forget,
                [meta, *(key for key, _ in head)],
                [now_ms, idle_ms, "1" if force else "0", "1" if check else "0"],
            )
        except REDIS_FAILURES as exc:
            raise _stale_or_index_error(exc, f"forget {replica}") from exc
        outcome = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        if outcome == "forgotten":
            log.info("replica forgotten", extra={"replica": replica, "unlinked": reply[1]})
            return ForgetResult(replica, unlinked=int(reply[1]))
        if outcome == "forgettable":
            return ForgetResult(replica)
        if outcome == "active":
            return ForgetResult(replica, refused=outcome, active_ms=int(reply[1]))
        updated = _agent_int(reply[1], 0) if len(reply) > 1 else None
        return ForgetResult(replica, refused=outcome, updated_ms=updated)

    async def sweep_orphans(self, max_keys: int = 100_000) -> int:
        """Unlink epoch-scoped keys (b:, m:, rm:, gw:p:) whose epoch is not their replica's
        current one. A clear unlinks the old b:/m:/rm: keys itself, so orphans only come from
        a lost meta hash (deleted by hand, or evicted under a wrong maxmemory-policy), and
        old gw:p: zsets also expire by their own TTL; run this from an operator job with the
        sweeper ACL (``kvgate index sweep``). Bounded by ``max_keys`` examined keys. Returns
        how many were unlinked."""
        return len((await self.sweep_orphan_keys(max_keys)).removed)

    async def sweep_orphan_keys(self, max_keys: int = 100_000) -> SweepResult:
        """:meth:`sweep_orphans`, naming the keys it unlinked."""
        removed: list[str] = []
        examined = 0
        complete = True
        try:
            async for raw in self.client.scan_iter(
                match=self.layout.epoch_keys_pattern(), count=1000
            ):
                if examined >= max_keys:
                    complete = False
                    break
                examined += 1
                parsed = self.layout.parse(raw.decode())
                if parsed is None or parsed[2] is None:
                    continue
                rid, _, epoch = parsed
                if int(await self._call(self._sweep, [self.layout.meta(rid), raw], [epoch])):
                    removed.append(raw.decode())
        except REDIS_FAILURES as exc:
            raise IndexError_(f"sweep: {exc}") from exc
        if removed:
            log.info("swept orphaned epoch keys", extra={"removed": len(removed)})
        return SweepResult(removed, examined, complete)

    async def ping_ms(self) -> float:
        """One PING round trip in milliseconds (health checks and benchmarks). The clock is
        perf_counter: uvloop's ``loop.time()`` ticks in whole milliseconds."""
        t0 = time.perf_counter()
        try:
            await self.client.ping()
        except REDIS_FAILURES as exc:
            raise IndexError_(f"ping: {exc}") from exc
        return (time.perf_counter() - t0) * 1000.0

    async def close(self) -> None:
        try:
            await self.client.aclose()
        except REDIS_FAILURES:  # closing a broken connection must not raise
            log.debug("redis close failed", exc_info=True)


__all__ = [
    "EMPTY_TIERS",
    "EntryCounts",
    "ForgetResult",
    "RedisIndex",
    "RedisScript",
    "ReplicaInspection",
    "SweepResult",
    "call_per_replica",
    "cluster_mode_problem",
    "evicts_any_key",
    "not_a_cluster",
]
