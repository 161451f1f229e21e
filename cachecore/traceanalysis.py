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

``kvgate trace analyze FILE... [--end T]`` prints the tables.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachecore.scoring import hit_cap_blocks

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
    its full blocks become most recently used (evicting from the LRU end)."""
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
        for k in req.keys:
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


@dataclass(slots=True)
class ReplicaOccupancy:
    replica: str
    samples: list[tuple[float, int]] = field(default_factory=list)  # (ts, blocks stored)
    stores: int = 0  # keys newly cached on the replica
    tier_changes: int = 0  # store records of a key it already held (a new tier set)
    removes: int = 0
    clears: int = 0

    def time_weighted_mean(self, end_ts: float) -> float:
        """Mean blocks held from this replica's first record to ``end_ts`` (the report's
        end: the last state counts until then)."""
        if not self.samples:
            return 0.0
        area = 0.0
        for (t0, n), (t1, _) in zip(self.samples, [*self.samples[1:], (end_ts, 0)], strict=True):
            area += n * max(0.0, t1 - t0)
        span = end_ts - self.samples[0][0]
        return area / span if span > 0 else float(self.samples[-1][1])

    @property
    def peak(self) -> int:
        return max((n for _, n in self.samples), default=0)


@dataclass(slots=True)
class EventTraceReport:
    start_ts: float
    end_ts: float
    occupancy: dict[str, ReplicaOccupancy]
    lifetimes_s: list[float]
    censored_lifetimes_s: list[float]
    # duplicated_block_s / cached_block_s: the share of cached block-seconds held by a
    # second (third, ...) copy of a key cached on another replica
    duplication: float
    cached_block_s: float  # integral over the window of the blocks cached on all replicas
    duplicated_block_s: float  # the same for the copies beyond a key's first
    peak_duplicated_keys: int
    skipped: int = 0  # records that were not valid cache events


def replay_order(records: Iterable[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
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
    time; the files must hold one replica's records in the order written."""
    streams: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        streams[rec["replica"]].append(rec)
    timed: list[list[tuple[float, dict[str, Any]]]] = []
    for recs in streams.values():
        out: list[tuple[float, dict[str, Any]]] = []
        t = -math.inf
        for i, rec in enumerate(recs):
            ts = float(rec["ts"])
            if rec["op"] == "clear" and i + 1 < len(recs):
                ts = min(ts, float(recs[i + 1]["ts"]))
            t = max(t, ts)
            out.append((t, rec))
        timed.append(out)
    return list(heapq.merge(*timed, key=lambda p: p[0]))


def analyze_events(
    records: Iterable[dict[str, Any]], end_ts: float | None = None
) -> EventTraceReport:
    """Replay store/remove/clear records (in :func:`replay_order`) and measure the caches.

    The window is ``[first record, end_ts]``; ``end_ts`` (default: the last record's time)
    closes the state after the last record: mean occupancy, duplication and the censored
    lifetimes of the blocks still cached all run to it, so a later ``end_ts`` weighs the
    final state by how long it is known to have lasted. An ``end_ts`` before the last
    record raises ValueError. Records :func:`valid_event` refuses (unknown op, no usable
    ts, ...) are skipped and counted in ``skipped``: they neither change a cache nor
    stretch the window."""
    alive: dict[tuple[str, str], float] = {}
    holders: dict[str, set[str]] = defaultdict(set)
    occ: dict[str, ReplicaOccupancy] = {}
    per_replica: dict[str, set[str]] = defaultdict(set)
    lifetimes: list[float] = []
    start = last = math.nan
    cached_area = dup_area = 0.0  # block-seconds: all copies, and copies beyond the first
    peak_dup = 0
    total_blocks = 0  # blocks cached, summed over replicas
    skipped = 0
    usable = []
    for rec in records:
        if valid_event(rec):
            usable.append(rec)
        else:
            skipped += 1
    for ts, rec in replay_order(usable):
        if math.isnan(start):
            start = last = ts
        dup_keys = total_blocks - len(holders)
        cached_area += total_blocks * (ts - last)
        dup_area += dup_keys * (ts - last)
        last = ts
        replica = rec["replica"]
        o = occ.setdefault(replica, ReplicaOccupancy(replica))
        op = rec["op"]
        if op == "store":
            key = rec["key"]
            if key not in per_replica[replica]:
                per_replica[replica].add(key)
                holders[key].add(replica)
                alive[(replica, key)] = ts
                total_blocks += 1
                o.stores += 1
            else:  # the agent re-emits a cached key whose tier set changed (GPU -> GPU|CPU)
                o.tier_changes += 1
        elif op == "remove":
            key = rec["key"]
            if key in per_replica[replica]:
                per_replica[replica].discard(key)
                holders[key].discard(replica)
                if not holders[key]:
                    del holders[key]
                lifetimes.append(ts - alive.pop((replica, key)))
                total_blocks -= 1
            o.removes += 1
        else:  # clear
            for key in per_replica[replica]:
                holders[key].discard(replica)
                if not holders[key]:
                    del holders[key]
                lifetimes.append(ts - alive.pop((replica, key)))
            total_blocks -= len(per_replica[replica])
            per_replica[replica].clear()
            o.clears += 1
        o.samples.append((ts, len(per_replica[replica])))
        peak_dup = max(peak_dup, total_blocks - len(holders))
    if math.isnan(start):
        start = last = 0.0 if end_ts is None else end_ts
    if end_ts is None:
        end_ts = last
    elif end_ts < last:
        raise ValueError(f"end {end_ts:g} is before the last record ({last:g})")
    dup_keys = total_blocks - len(holders)
    cached_area += total_blocks * (end_ts - last)
    dup_area += dup_keys * (end_ts - last)
    if cached_area > 0:
        duplication = dup_area / cached_area
    else:  # no cached state lasted any time: the state at the end
        duplication = dup_keys / total_blocks if total_blocks else 0.0
    return EventTraceReport(
        start_ts=start,
        end_ts=end_ts,
        occupancy=occ,
        lifetimes_s=lifetimes,
        censored_lifetimes_s=[end_ts - t0 for t0 in alive.values()],
        duplication=duplication,
        cached_block_s=cached_area,
        duplicated_block_s=dup_area,
        peak_duplicated_keys=peak_dup,
        skipped=skipped,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


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


def analyze_requests(records: Iterable[dict[str, Any]]) -> RequestReport:
    """Hit rate and prediction error of request records (assumed :func:`valid_request`)."""
    n = prompt = measured = cached = compared = err = 0
    by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for rec in records:
        p = int(rec["prompt_tokens"])
        c, pred = rec.get("cached_tokens"), rec.get("predicted_cached_tokens")
        if rec.get("status", 200) != 200:  # a failed answer: its counts are not comparable
            c = None
        row = by[str(rec.get("replica", "?"))]
        n += 1
        prompt += p
        row[0] += 1
        row[1] += p
        if c is None:
            continue
        measured += p
        cached += int(c)
        row[2] += p
        row[3] += int(c)
        if pred is not None:
            compared += p
            err += abs(int(pred) - int(c))
    return RequestReport(
        n,
        prompt,
        measured,
        cached,
        compared,
        err,
        {k: (v[0], v[1], v[2], v[3]) for k, v in by.items()},
    )


# ------------------------------------------------------------------------------ CLI


EVENT_OPS = frozenset({"store", "remove", "clear"})


def _number(v: object) -> bool:
    """A finite JSON number (not a bool, which json.loads also gives as an int)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def valid_event(rec: dict[str, Any]) -> bool:
    """A cache event the analysis can use: finite numeric ts, string replica, a known op,
    and a string key for store/remove."""
    op = rec.get("op")
    return (
        _number(rec.get("ts"))
        and isinstance(rec.get("replica"), str)
        and op in EVENT_OPS
        and (op == "clear" or isinstance(rec.get("key"), str))
    )


def valid_request(rec: dict[str, Any]) -> bool:
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


def read_jsonl(paths: Iterable[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    """Split records into cache events and request records, in file order (files in the
    order given); count the lines skipped: not UTF-8, not JSON, or not a valid record of
    either kind (see :func:`valid_event`, :func:`valid_request`). A file that cannot be
    read raises OSError."""
    events: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    bad = 0
    for path in paths:
        with Path(path).open("rb") as fh:
            for raw in fh:
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    bad += 1
                    continue
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
                    bad += 1
                    continue
                if not isinstance(rec, dict):
                    bad += 1
                elif "op" in rec:
                    if valid_event(rec):
                        events.append(rec)
                    else:
                        bad += 1
                elif valid_request(rec):
                    requests.append(rec)
                else:
                    bad += 1
    return events, requests, bad


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
    lt, cz = rep.lifetimes_s, rep.censored_lifetimes_s
    lines += [
        "",
        "| block lifetimes | n | p50 s | p90 s | p99 s |",
        "|---|---|---|---|---|",
        f"| ended (removed/cleared) | {len(lt)} | {percentile(lt, 50):.2f} | "
        f"{percentile(lt, 90):.2f} | {percentile(lt, 99):.2f} |",
        f"| still cached (censored) | {len(cz)} | {percentile(cz, 50):.2f} | "
        f"{percentile(cz, 90):.2f} | {percentile(cz, 99):.2f} |",
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


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    a = sub.add_parser("analyze", help="analyse agent/gateway JSONL traces")
    a.add_argument("files", nargs="+", type=Path)
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
        events, requests, bad = read_jsonl(_distinct(args.files))
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or 'input'}: {exc.strerror or exc}")
    if not events and not requests:
        lines = "line" if bad == 1 else "lines"
        print(
            f"kvgate trace: no cache events or request records found ({bad} {lines} skipped)",
            file=sys.stderr,
        )
        return 1
    if events:
        try:
            report = analyze_events(events, args.end)
        except ValueError as exc:  # "end X is before the last record (Y)"
            return _fail(f"--{exc}")
        print(format_event_report(report))
    if requests:
        if events:
            print()
        print(format_request_report(analyze_requests(requests)))
    if bad:
        print(f"\nskipped {bad} unparseable or invalid lines")
    return 0
