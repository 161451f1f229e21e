"""Trace analysis: what a workload could reuse, and what the fleet's caches actually did.

Two inputs, one module:

* **Workload bounds** over requests given as chained block keys (:class:`RequestBlocks`):
  the infinite-cache token hit rate and the hit rate of one block-level LRU cache with a
  given capacity (the "fleet-capacity bound" of the router benchmarks: one cache holding the
  pooled capacity of every replica). Both apply the engine's hit cap (at most
  ``prompt_len - 1`` tokens can be served from cache), so they are comparable with
  engine-reported hit rates.
* **Cache-event traces**: JSON lines ``{"ts", "replica", "op": "store"|"remove"|"clear",
  "key", "tier"}`` written by cache agents (``--trace-out``) and request records ``{"ts",
  "replica", "tenant", "prompt_tokens", "cached_tokens", "predicted_cached_tokens"}``.
  Request records come from ``kvgate serve --trace-out`` (:mod:`gateway.requesttrace`, which
  adds fields this module ignores) or from your own tooling in the same format.
  ``cached_tokens`` and ``predicted_cached_tokens`` may be missing or null (not known): like
  the gateway's ``kvgate_cached_tokens_error_total``, the prediction error counts only records
  with both, and the hit rate only records with ``cached_tokens``; a record whose ``status``
  is present and not 200 counts in neither. From them: per-replica
  occupancy over time, evictions, block lifetimes (stored -> removed, with the still-alive
  blocks reported as censored), prefix duplication across replicas, and per-request hit
  rates.

  The analysed window runs from the first record to ``--end`` (default: the last record's
  ts); the state after the last record counts until then. Mean occupancy is time-weighted
  over the window (from a replica's first record); a censored lifetime is ``end - stored``.
  **Duplication** is ``duplicated block-seconds / cached block-seconds``: at each instant the
  cached blocks are the blocks held summed over replicas and the duplicated ones are the
  copies beyond a key's first (cached - distinct keys), both integrated over the window.
  Idle periods hold no blocks and so do not dilute it; when no cached state lasted any time
  (all records at one instant, no ``--end``) it is the share at the end.

``kvgate trace analyze FILE... [--end T]`` prints the tables. It streams
(:func:`analyze_files`): memory follows the live state (the blocks cached at one instant,
one occupancy row and one queue per replica), not the length of the trace, so an hour-long
trace of millions of lines takes what its caches held, not ~1.3 KB a line. A file with
cache events is read twice, once to count them per replica and once to replay them (a pipe,
which cannot be read twice, has its cache events held in memory). A gzip-compressed file
(a rotated log, ``FILE.gz``; several members concatenated too) is read through its
decompression, ``-`` is standard input. What is exact and what is not:

* every count, mean occupancy, duplication and the peaks are exact: the replay is the same
  sequence of float operations as an in-memory one;
* lifetimes are kept as counts per value rounded to 0.01 s (:class:`Lifetimes`), the
  precision the report prints; as rounding is monotonic, the nearest-rank p50/p90/p99 of
  the rounded values are the exact percentiles rounded, so the printed figures are exact.
  Their memory is one counter per distinct hundredth of a second, at most 100 per second
  of the longest lifetime. The API's ``lifetimes_s`` lists are those rounded values;
* a file holding several replicas' records (one agent for several data-parallel ranks)
  queues the records of one replica while the replay reads past them for another, up to
  ``QUEUE_CAP`` a replica; past that (an idle rank whose next record is far ahead) the
  replica gets a reader of its own, which reads that part of the file again.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import heapq
import json
import logging
import math
import os
import stat
import sys
import zlib
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from cachecore.scoring import hit_cap_blocks

Record = dict[str, Any]  # one JSON line of a trace
Positioned = tuple[int, Record]  # a record and the offset of its line in its file

# --------------------------------------------------------------------------- bounds


@dataclass(frozen=True, slots=True)
class RequestBlocks:
    """One request as the index sees it: its full blocks' chained keys."""

    keys: Sequence[bytes]
    prompt_tokens: int
    block_size: int


def capped_hit_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine serves from cache for a matched prefix: vLLM caps a hit at
    ``prompt_len - 1`` tokens so the last token is always computed."""
    return min(matched_blocks, hit_cap_blocks(prompt_tokens, block_size)) * block_size


@dataclass(frozen=True, slots=True)
class BoundResult:
    hit_tokens: int
    prompt_tokens: int
    evictions: int
    request_hits: tuple[int, ...] = ()  # hit tokens of each request, in order

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def lru_bound(requests: Iterable[RequestBlocks], capacity_blocks: int | None) -> BoundResult:
    """Token hit rate of ONE block-level LRU cache of ``capacity_blocks`` (None: infinite)
    serving the requests in order. Each request hits its longest cached prefix, then all
    its full blocks become most recently used (evicting from the LRU end), its head most
    recently of all: vLLM frees a request's blocks tail first (the engine's block pool
    too), so under pressure a chain loses its tail, never its root. Touching head first
    evicts the root and leaves the later blocks as dead weight no request can match (a hit
    needs the whole prefix): a bound lower than the LRU it names."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hit = total = evictions = 0
    hits: list[int] = []
    for req in requests:
        total += req.prompt_tokens
        matched = 0
        for k in req.keys:
            if k not in cache:
                break
            matched += 1
        hits.append(capped_hit_tokens(matched, req.prompt_tokens, req.block_size))
        hit += hits[-1]
        for k in reversed(req.keys):
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
                evictions += 1
    return BoundResult(hit, total, evictions, tuple(hits))


# ----------------------------------------------------------------------- event traces


def _nearest_rank(n: int, q: float) -> int:
    """The 1-based rank of the nearest-rank ``q`` percentile (q in [0, 100]) of n values."""
    return max(1, math.ceil(q / 100.0 * n))


@dataclass(slots=True)
class ReplicaOccupancy:
    """One replica's counts and blocks held over time, kept as a running integral (the
    samples themselves would grow with the trace)."""

    replica: str
    stores: int = 0  # keys newly cached on the replica
    tier_changes: int = 0  # store records of a key it already held (a new tier set)
    removes: int = 0
    clears: int = 0
    first_ts: float = math.nan  # its first record's replay time
    last_ts: float = math.nan  # its latest record's
    last_blocks: int = 0  # blocks held from last_ts
    peak: int = 0
    block_s: float = 0.0  # blocks held integrated from first_ts to last_ts

    def sample(self, ts: float, blocks: int) -> None:
        """The replica holds ``blocks`` from ``ts`` (non-decreasing: the replay order)."""
        if math.isnan(self.first_ts):
            self.first_ts = ts
        else:
            self.block_s += self.last_blocks * max(0.0, ts - self.last_ts)
        self.last_ts, self.last_blocks = ts, blocks
        self.peak = max(self.peak, blocks)

    def time_weighted_mean(self, end_ts: float) -> float:
        """Mean blocks held from this replica's first record to ``end_ts`` (the report's
        end: the last state counts until then)."""
        if math.isnan(self.first_ts):
            return 0.0
        area = self.block_s + self.last_blocks * max(0.0, end_ts - self.last_ts)
        span = end_ts - self.first_ts
        return area / span if span > 0 else float(self.last_blocks)


@dataclass(slots=True)
class Lifetimes:
    """Block lifetimes (seconds) as counts per value rounded to 0.01 s, the precision the
    report prints. Rounding is monotonic, so the nearest-rank percentile of the rounded
    values is the exact percentile rounded; the memory is one counter per distinct
    hundredth of a second, not one value per block."""

    counts: Counter[float] = field(default_factory=Counter)
    n: int = 0

    def add(self, seconds: float) -> None:
        # round() and the report's :.2f both round the float's exact value correctly
        self.counts[round(seconds, 2)] += 1
        self.n += 1

    def __len__(self) -> int:
        return self.n

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile (q in [0, 100]) to 0.01 s; nan for no values."""
        if not self.n:
            return math.nan
        rank = _nearest_rank(self.n, q)
        for value in sorted(self.counts):
            rank -= self.counts[value]
            if rank <= 0:
                return value
        raise AssertionError("counts do not add up to n")  # pragma: no cover

    def values(self) -> list[float]:
        """Every lifetime, rounded, ascending: as long as the count (tests, small traces)."""
        return [v for v in sorted(self.counts) for _ in range(self.counts[v])]


@dataclass(slots=True)
class EventTraceReport:
    start_ts: float
    end_ts: float
    occupancy: dict[str, ReplicaOccupancy]
    lifetimes: Lifetimes  # blocks removed or cleared in the window: stored -> ended
    censored: Lifetimes  # blocks still cached at end_ts: end_ts - stored
    # duplicated_block_s / cached_block_s: the share of cached block-seconds held by a
    # second (third, ...) copy of a key cached on another replica
    duplication: float
    cached_block_s: float  # integral over the window of the blocks cached on all replicas
    duplicated_block_s: float  # the same for the copies beyond a key's first
    peak_duplicated_keys: int
    skipped: int = 0  # records that were not valid cache events

    @property
    def lifetimes_s(self) -> list[float]:
        return self.lifetimes.values()

    @property
    def censored_lifetimes_s(self) -> list[float]:
        return self.censored.values()


class EndBeforeLastRecord(ValueError):
    """An analysis window's end before the last record it replayed."""


def _timed(records: Iterator[Record]) -> Iterator[tuple[float, Record]]:
    """One replica's records with their replay times (see :func:`replay_order`). Only a
    clear looks one record ahead, so the stream holds at most two records at a time."""
    t = -math.inf
    rec = next(records, None)
    while rec is not None:
        ts = float(rec["ts"])
        after = next(records, None) if rec["op"] == "clear" else None
        if after is not None:
            ts = min(ts, float(after["ts"]))
        t = max(t, ts)
        yield t, rec
        rec = after if rec["op"] == "clear" else next(records, None)


def _merged(streams: Iterable[Iterator[Record]]) -> Iterator[tuple[float, Record]]:
    """Per-replica streams (in order of their replicas' first records) merged by replay
    time; ties go to the earlier stream, as heapq.merge breaks them."""
    return heapq.merge(*(_timed(s) for s in streams), key=lambda p: p[0])


def _by_replica(records: Iterable[Record]) -> tuple[dict[str, list[Record]], int]:
    """Valid events grouped per replica in the order given, and the count of the others."""
    streams: dict[str, list[Record]] = defaultdict(list)
    skipped = 0
    for rec in records:
        if valid_event(rec):
            streams[rec["replica"]].append(rec)
        else:
            skipped += 1
    return streams, skipped


def replay_order(records: Iterable[Record]) -> list[tuple[float, Record]]:
    """The records as ``(time, record)`` in the order to replay them.

    One replica's records are replayed in the order given (file order): the agent writes
    them in the order it applied them, and their ``ts`` come from two clocks, the engine's
    batch times and the agent's wall clock for a clear that no batch carried (agent start,
    engine restart, gap). A fresh agent against a running engine writes its start-up clear
    at "now" and then the engine's replayed batches, which are older: sorted by ts, the
    clear would land after those stores and wipe them. So within a replica the time is
    made non-decreasing (a record is placed no earlier than the one before it), and a
    clear is placed no later than the record after it (the first batch applied after a
    clear bounds when the cache it describes started). Replicas are then merged by that
    time; the files must hold one replica's records in the order written. (In memory: the
    streaming :func:`analyze_files` applies the same order file by file.)"""
    streams, _ = _by_replica(records)
    return list(_merged(iter(s) for s in streams.values()))


class EventReplay:
    """The analysis of cache events fed one at a time in :func:`replay_order`. It keeps the
    live state (the blocks each replica holds and when each was stored, the replicas
    holding each key) and running sums: nothing per record."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, float]] = {}  # replica -> key -> stored at
        self._copies: dict[str, int] = {}  # key -> replicas holding it
        self._total = 0  # blocks cached, summed over replicas
        self.occupancy: dict[str, ReplicaOccupancy] = {}
        self.lifetimes = Lifetimes()
        self.start = self.last = math.nan
        self.cached_area = self.dup_area = 0.0  # block-seconds: all copies, beyond the first
        self.peak_dup = 0

    def _drop(self, key: str) -> None:
        n = self._copies[key] - 1
        if n:
            self._copies[key] = n
        else:
            del self._copies[key]

    def feed(self, ts: float, rec: Record) -> None:
        """Apply one valid event at replay time ``ts`` (non-decreasing)."""
        if math.isnan(self.start):
            self.start = self.last = ts
        dup_keys = self._total - len(self._copies)
        self.cached_area += self._total * (ts - self.last)
        self.dup_area += dup_keys * (ts - self.last)
        self.last = ts
        replica = rec["replica"]
        o = self.occupancy.get(replica)
        if o is None:
            o = self.occupancy[replica] = ReplicaOccupancy(replica)
            self._held[replica] = {}
        held = self._held[replica]
        op = rec["op"]
        if op == "store":
            key = rec["key"]
            if key not in held:
                held[key] = ts
                self._copies[key] = self._copies.get(key, 0) + 1
                self._total += 1
                o.stores += 1
            else:  # the agent re-emits a cached key whose tier set changed (GPU -> GPU|CPU)
                o.tier_changes += 1
        elif op == "remove":
            stored = held.pop(rec["key"], None)
            if stored is not None:
                self._drop(rec["key"])
                self.lifetimes.add(ts - stored)
                self._total -= 1
            o.removes += 1
        else:  # clear
            for key, stored in held.items():
                self._drop(key)
                self.lifetimes.add(ts - stored)
            self._total -= len(held)
            held.clear()
            o.clears += 1
        o.sample(ts, len(held))
        self.peak_dup = max(self.peak_dup, self._total - len(self._copies))

    def report(self, end_ts: float | None = None, skipped: int = 0) -> EventTraceReport:
        """The report of the window ``[first record, end_ts]`` (see :func:`analyze_events`)."""
        start, last = self.start, self.last
        if math.isnan(start):
            start = last = 0.0 if end_ts is None else end_ts
        if end_ts is None:
            end_ts = last
        elif end_ts < last:
            raise EndBeforeLastRecord(f"end {end_ts:g} is before the last record ({last:g})")
        dup_keys = self._total - len(self._copies)
        cached_area = self.cached_area + self._total * (end_ts - last)
        dup_area = self.dup_area + dup_keys * (end_ts - last)
        if cached_area > 0:
            duplication = dup_area / cached_area
        else:  # no cached state lasted any time: the state at the end
            duplication = dup_keys / self._total if self._total else 0.0
        censored = Lifetimes()
        for held in self._held.values():
            for stored in held.values():
                censored.add(end_ts - stored)
        return EventTraceReport(
            start_ts=start,
            end_ts=end_ts,
            occupancy=self.occupancy,
            lifetimes=self.lifetimes,
            censored=censored,
            duplication=duplication,
            cached_block_s=cached_area,
            duplicated_block_s=dup_area,
            peak_duplicated_keys=self.peak_dup,
            skipped=skipped,
        )


def _replay(
    timed: Iterable[tuple[float, Record]], end_ts: float | None, skipped: int
) -> EventTraceReport:
    replay = EventReplay()
    for ts, rec in timed:
        replay.feed(ts, rec)
    return replay.report(end_ts, skipped)


def analyze_events(records: Iterable[Record], end_ts: float | None = None) -> EventTraceReport:
    """Replay store/remove/clear records (in :func:`replay_order`) and measure the caches.

    The window is ``[first record, end_ts]``; ``end_ts`` (default: the last record's time)
    closes the state after the last record: mean occupancy, duplication and the censored
    lifetimes of the blocks still cached all run to it, so a later ``end_ts`` weighs the
    final state by how long it is known to have lasted. An ``end_ts`` before the last
    record raises :class:`EndBeforeLastRecord` (a ValueError). Records :func:`valid_event`
    refuses (unknown op, no usable ts, ...) are skipped and counted in ``skipped``: they
    neither change a cache nor stretch the window. The records are grouped per replica in
    memory (they are in memory already); files stream through :func:`analyze_files`."""
    streams, skipped = _by_replica(records)
    return _replay(_merged(iter(s) for s in streams.values()), end_ts, skipped)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    return sorted(values)[_nearest_rank(len(values), q) - 1]


@dataclass(frozen=True, slots=True)
class RequestReport:
    requests: int
    prompt_tokens: int  # all records
    measured_prompt_tokens: int  # records with an actual cached count: the hit rate's base
    cached_tokens: int
    compared_prompt_tokens: int  # records with a predicted and an actual count
    predicted_error_tokens: int  # sum |predicted - actual| over those records
    # replica -> (requests, prompt tokens, measured prompt tokens, cached tokens)
    by_replica: dict[str, tuple[int, int, int, int]]

    @property
    def hit_rate(self) -> float:
        m = self.measured_prompt_tokens
        return self.cached_tokens / m if m else 0.0

    @property
    def prediction_error(self) -> float:
        """|predicted - actual| / prompt tokens over the records that carry both (a record
        without one is not known to be right or wrong, so it is left out of the base too,
        as the gateway's precision metric does)."""
        c = self.compared_prompt_tokens
        return self.predicted_error_tokens / c if c else 0.0


class RequestTally:
    """:func:`analyze_requests` one record at a time: sums, one row per replica."""

    def __init__(self) -> None:
        self.n = self.prompt = self.measured = self.cached = self.compared = self.err = 0
        self._by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])

    def add(self, rec: Record) -> None:
        p = int(rec["prompt_tokens"])
        c, pred = rec.get("cached_tokens"), rec.get("predicted_cached_tokens")
        if rec.get("status", 200) != 200:  # a failed answer: its counts are not comparable
            c = None
        row = self._by[str(rec.get("replica", "?"))]
        self.n += 1
        self.prompt += p
        row[0] += 1
        row[1] += p
        if c is None:
            return
        self.measured += p
        self.cached += int(c)
        row[2] += p
        row[3] += int(c)
        if pred is not None:
            self.compared += p
            self.err += abs(int(pred) - int(c))

    def report(self) -> RequestReport:
        return RequestReport(
            self.n,
            self.prompt,
            self.measured,
            self.cached,
            self.compared,
            self.err,
            {k: (v[0], v[1], v[2], v[3]) for k, v in self._by.items()},
        )


def analyze_requests(records: Iterable[Record]) -> RequestReport:
    """Hit rate and prediction error of request records (assumed :func:`valid_request`)."""
    tally = RequestTally()
    for rec in records:
        tally.add(rec)
    return tally.report()


# ----------------------------------------------------------------------------- files

_log = logging.getLogger(__name__)

EVENT_OPS = frozenset({"store", "remove", "clear"})


def _number(v: object) -> bool:
    """A finite JSON number (not a bool, which json.loads also gives as an int)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def valid_event(rec: Record) -> bool:
    """A cache event the analysis can use: finite numeric ts, string replica, a known op,
    and a string key for store/remove."""
    op = rec.get("op")
    return (
        _number(rec.get("ts"))
        and isinstance(rec.get("replica"), str)
        and op in EVENT_OPS
        and (op == "clear" or isinstance(rec.get("key"), str))
    )


def valid_request(rec: Record) -> bool:
    """A request record: finite numeric ts and a token count; the cached counts, when
    present and not null, are counts too."""
    return (
        _number(rec.get("ts"))
        and _count(rec.get("prompt_tokens"))
        and all(
            rec.get(k) is None or _count(rec[k])
            for k in ("cached_tokens", "predicted_cached_tokens")
        )
    )


def _parse(raw: bytes) -> Record | str | None:
    """One line: a valid record (a cache event when it has an ``op``, else a request
    record), the reason it is neither (a string), or None for a blank line."""
    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return "not UTF-8"
    if not line:
        return None
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return "not JSON"
    if not isinstance(rec, dict):
        return "not a JSON object"
    if "op" in rec:
        return rec if valid_event(rec) else "not a valid cache event"
    return rec if valid_request(rec) else "not a valid request record"


_GZIP_MAGIC = b"\x1f\x8b"


@contextlib.contextmanager
def open_trace(path: Path) -> Iterator[BinaryIO]:
    """``path`` opened for reading bytes, decompressed when it is gzip (told by its first
    two bytes, not its name: a rotated log, or gzip sent down a pipe). Offsets and sizes
    taken from it are in decompressed bytes, and seeking works (forward by decompressing,
    backward by starting over)."""
    with Path(path).open("rb") as fh:
        if fh.peek(2)[:2] != _GZIP_MAGIC:
            yield fh
            return
        with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
            yield gz  # type: ignore[misc]  # a GzipFile reads as BinaryIO does


def read_jsonl(paths: Iterable[Path]) -> tuple[list[Record], list[Record], int]:
    """Split records into cache events and request records, in file order (files in the
    order given); count the lines skipped: not UTF-8, not JSON, or not a valid record of
    either kind (see :func:`valid_event`, :func:`valid_request`). A file that cannot be
    read raises OSError. Everything in memory: the CLI streams (:func:`analyze_files`)."""
    events: list[Record] = []
    requests: list[Record] = []
    bad = 0
    for path in paths:
        with open_trace(path) as fh:
            for raw in fh:
                rec = _parse(raw)
                if isinstance(rec, str):
                    bad += 1
                elif rec is not None:
                    (events if "op" in rec else requests).append(rec)
    return events, requests, bad


class TraceChanged(Exception):
    """A file's cache events differ between the two reads (rewritten or truncated)."""


class TraceDamaged(Exception):
    """A gzip-compressed file that does not decompress to its end (cut short, corrupt)."""


_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)  # what a damaged member raises


@dataclass(slots=True)
class _FileScan:
    """What the first read of a file found."""

    path: Path
    size: int  # bytes read: the replay stops there (an agent may still be appending)
    events: dict[str, int]  # replica -> its cache events here, in order of first record
    held: dict[str, deque[Positioned]] | None  # a pipe's cache events: it cannot be read twice


def _scan(path: Path, tally: RequestTally) -> tuple[_FileScan, int]:
    """Read ``path`` once: count its cache events per replica, add its request records to
    ``tally``, count (and log at debug) the lines skipped."""
    events: dict[str, int] = {}
    size = bad = 0
    with open_trace(path) as fh:
        held: dict[str, deque[Positioned]] | None = None
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            held = {}
        lines = enumerate(fh, 1)
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                break
            except _GZIP_ERRORS as exc:  # the lines before it were read: say where it broke
                raise TraceDamaged(
                    f"{path}: its gzip data is damaged after {size} decompressed bytes ({exc})"
                ) from exc
            offset = size
            size += len(raw)
            rec = _parse(raw)
            if isinstance(rec, str):
                bad += 1
                _log.debug(
                    "trace line skipped", extra={"path": str(path), "line": lineno, "why": rec}
                )
            elif rec is None:
                continue
            elif "op" in rec:
                replica = rec["replica"]
                events[replica] = events.get(replica, 0) + 1
                if held is not None:
                    held.setdefault(replica, deque()).append((offset, rec))
            else:
                tally.add(rec)
    return _FileScan(path, size, events, held), bad


QUEUE_CAP = 10_000  # records of one replica queued in a file before it gets its own reader


def _events_from(fh: BinaryIO, offset: int, size: int) -> Iterator[Positioned]:
    """The cache events of ``fh`` from ``offset`` (where it is positioned) to ``size``."""
    while offset < size:
        raw = fh.readline(size - offset)
        if not raw:
            return
        rec = _parse(raw)
        if isinstance(rec, dict) and "op" in rec:
            yield offset, rec
        offset += len(raw)


class _FileEvents:
    """A scanned file's cache events handed out per replica, each replica's in file order.

    One reader goes through the file for all its replicas and queues the records of the
    others it passes. A replica whose queue reaches ``QUEUE_CAP`` (the replica the replay
    waits for writes far ahead in the file: an idle rank, a replica gone) gets a reader of
    its own from its first queued record instead, which reads that part of the file again
    and keeps the memory bounded. Readers open when first needed; all close once every
    record was handed out."""

    def __init__(self, scan: _FileScan) -> None:
        self.scan = scan
        self._left = dict(scan.events)  # replica -> records not yet handed out
        self._unread = sum(scan.events.values())
        self._queued = scan.held if scan.held is not None else {r: deque() for r in scan.events}
        self._own: dict[str, Iterator[Positioned]] = {}  # replicas with a reader of their own
        self._shared: Iterator[Positioned] | None = None
        self._files = contextlib.ExitStack()

    def of(self, replica: str) -> Iterator[Record]:
        queue = self._queued[replica]
        while self._left[replica]:
            if queue:
                _, rec = queue.popleft()
            elif replica in self._own:
                _, rec = self._next(self._own[replica])
            else:
                self._read_one()
                continue
            self._left[replica] -= 1
            self._unread -= 1
            if not self._unread:
                self.close()
            yield rec

    def _read_one(self) -> None:
        if self._shared is None:
            self._shared = self._reader(0)
        offset, rec = self._next(self._shared)
        replica = rec["replica"]
        if replica in self._own:
            return
        queue = self._queued.get(replica)
        if queue is None:
            raise TraceChanged(f"{self.scan.path} changed while it was read (rewritten?)")
        queue.append((offset, rec))
        if len(queue) >= QUEUE_CAP:
            own = self._reader(queue[0][0])
            self._own[replica] = (p for p in own if p[1]["replica"] == replica)
            queue.clear()

    def _reader(self, offset: int) -> Iterator[Positioned]:
        fh = self._files.enter_context(open_trace(self.scan.path))
        fh.seek(offset)
        return _events_from(fh, offset, self.scan.size)

    def _next(self, reader: Iterator[Positioned]) -> Positioned:
        found = next(reader, None)
        if found is None:  # fewer records than the first read counted
            raise TraceChanged(f"{self.scan.path} changed while it was read (truncated?)")
        return found

    def close(self) -> None:
        self._files.close()


def _replica_stream(files: Sequence[_FileEvents], replica: str) -> Iterator[Record]:
    """One replica's cache events: file by file in the order given, each in file order."""
    for f in files:
        if replica in f.scan.events:
            yield from f.of(replica)


@dataclass(frozen=True, slots=True)
class TraceAnalysis:
    events: EventTraceReport | None  # None: no cache events
    requests: RequestReport | None  # None: no request records
    skipped: int  # lines neither: not UTF-8, not JSON, not a valid record


def analyze_files(paths: Sequence[Path], end_ts: float | None = None) -> TraceAnalysis:
    """What ``kvgate trace analyze`` prints, streamed: the same analysis as
    :func:`read_jsonl` then :func:`analyze_events` and :func:`analyze_requests`, in memory
    that follows the caches' live state, not the files' length (see the module's notes).

    A first read of each file (in the order given) sums its request records and counts
    its cache events per replica; the replay then reads each replica's events file by
    file, in file order, and merges the replicas by replay time (:func:`replay_order`),
    stopping in each file where the first read stopped. Raises OSError for a file that
    cannot be read, :class:`TraceChanged` for one whose events changed between the reads,
    :class:`EndBeforeLastRecord` for an ``end_ts`` before the last event."""
    tally = RequestTally()
    scans: list[_FileScan] = []
    bad = 0
    for path in paths:
        scan, skipped = _scan(Path(path), tally)
        scans.append(scan)
        bad += skipped
    requests = tally.report() if tally.n else None
    replicas: dict[str, None] = {}  # in order of first record, as replay_order has them
    for scan in scans:
        replicas.update(dict.fromkeys(scan.events))
    if not replicas:
        return TraceAnalysis(None, requests, bad)
    files = [_FileEvents(scan) for scan in scans if scan.events]
    try:
        streams = (_replica_stream(files, r) for r in replicas)
        events = _replay(_merged(streams), end_ts, 0)
    finally:
        for f in files:
            f.close()
    return TraceAnalysis(events, requests, bad)


# ------------------------------------------------------------------------------ CLI


def format_event_report(rep: EventTraceReport) -> str:
    lines = [
        f"span: {rep.end_ts - rep.start_ts:.1f} s (to end {rep.end_ts:.3f})",
        "",
        "| replica | stores | tier changes | removes | clears | mean occupancy (blocks) | peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in sorted(rep.occupancy):
        o = rep.occupancy[name]
        lines.append(
            f"| {name} | {o.stores} | {o.tier_changes} | {o.removes} | {o.clears} | "
            f"{o.time_weighted_mean(rep.end_ts):.1f} | {o.peak} |"
        )
    lt, cz = rep.lifetimes, rep.censored
    lines += [
        "",
        "| block lifetimes | n | p50 s | p90 s | p99 s |",
        "|---|---|---|---|---|",
        f"| ended (removed/cleared) | {len(lt)} | {lt.percentile(50):.2f} | "
        f"{lt.percentile(90):.2f} | {lt.percentile(99):.2f} |",
        f"| still cached (censored) | {len(cz)} | {cz.percentile(50):.2f} | "
        f"{cz.percentile(90):.2f} | {cz.percentile(99):.2f} |",
        "",
        f"prefix duplication across replicas (share of cached block-seconds held by a second "
        f"copy of a key): {rep.duplication:.1%}; peak duplicated blocks: "
        f"{rep.peak_duplicated_keys}",
    ]
    return "\n".join(lines)


def format_request_report(rep: RequestReport) -> str:
    lines = [
        f"requests: {rep.requests}, token hit rate {rep.hit_rate:.1%} "
        f"({rep.measured_prompt_tokens} of {rep.prompt_tokens} prompt tokens with a cached "
        f"count), predicted-vs-actual cached error {rep.prediction_error:.2%} of prompt tokens "
        f"({rep.compared_prompt_tokens} prompt tokens with both counts)",
        "",
        "| replica | requests | prompt tokens | cached tokens | hit rate |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(rep.by_replica):
        n, p, m, c = rep.by_replica[name]
        rate = f"{c / m:.1%}" if m else "-"  # no record with a cached count: not 0%
        lines.append(f"| {name} | {n} | {p} | {c} | {rate} |")
    return "\n".join(lines)


def _trace_path(arg: str) -> Path:
    return Path("/dev/stdin") if arg == "-" else Path(arg)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    a = sub.add_parser("analyze", help="analyse agent/gateway JSONL traces")
    a.add_argument(
        "files",
        nargs="+",
        type=_trace_path,
        help="JSONL traces (`kvgate agent --trace-out`, `kvgate serve --trace-out`), plain or "
        "gzip-compressed; - is standard input",
    )
    a.add_argument(
        "--end",
        type=float,
        default=None,
        help="end of the analysed window (same clock as the records' ts): the state after "
        "the last record counts until then in mean occupancy, duplication and the ages of "
        "the blocks still cached (default: the last record's ts, so that state has no weight)",
    )


def _fail(what: str) -> int:
    print(f"kvgate trace: {what}", file=sys.stderr)
    return 2


def _distinct(paths: Sequence[Path]) -> list[Path]:
    """``paths`` less the ones naming a file already given (``a.jsonl ./a.jsonl``, two
    overlapping globs): read twice, every record counted twice, every store a tier change
    and every clear doubled, without a word."""
    out: list[Path] = []
    seen: set[Path] = set()
    for path in paths:
        key = path.resolve()
        if key in seen:
            print(f"kvgate trace: {path} names a file already given: read once", file=sys.stderr)
            continue
        seen.add(key)
        out.append(path)
    return out


def run(args: argparse.Namespace) -> int:
    if args.end is not None and not math.isfinite(args.end):
        return _fail(f"--end must be a finite time, got {args.end}")
    try:
        result = analyze_files(_distinct(args.files), args.end)
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or 'input'}: {exc.strerror or exc}")
    except (TraceChanged, TraceDamaged) as exc:
        return _fail(str(exc))
    except EndBeforeLastRecord as exc:  # "end X is before the last record (Y)"
        return _fail(f"--{exc}")
    bad = result.skipped
    if result.events is None and result.requests is None:
        lines = "line" if bad == 1 else "lines"
        print(
            f"kvgate trace: no cache events or request records found ({bad} {lines} skipped)",
            file=sys.stderr,
        )
        return 1
    if result.events is not None:
        print(format_event_report(result.events))
    if result.requests is not None:
        if result.events is not None:
            print()
        print(format_request_report(result.requests))
    if bad:
        print(f"\nskipped {bad} unparseable or invalid lines")
    return 0
