"""``kvgate bench soak``: the whole stack under minutes of mixed traffic, checked for drift.

What a gateway must survive before it runs for days: long runs of ordinary traffic mixed
with the client faults it meets in production, while its KV caches churn. The benchmark
starts a private ``redis-server``, ``--replicas`` simulated replicas with small KV caches
(blocks are evicted all along, so every lifecycle transition keeps happening), and
``kvgate serve`` with the Redis index and one embedded cache agent per replica. For
``--minutes`` it sends an open-loop mix (:func:`soak_schedule`):

* shared-prefix chats (streamed), a four-tenant mix (half of it non-streamed),
  multi-turn sessions, short unique completions (non-streamed), sensitive requests;
* client faults: streams abandoned after their first chunk, malformed JSON, a wrong API
  key, an unknown model; and an admin policy reload every ``--reload-s``.

With ``--chaos-s`` it also injects a fault that often, in rotation: five KV events dropped
(the agent must replay them), a 2 s engine stall, a Redis restart that loses every key
(agents must resync from their mirrors; lookups fall back to the gateway's own decisions),
5 s of failing health checks, an engine restart (its in-flight requests fail; each must get
an OpenAI error, and only those may fail).

Every ``--sample-s`` it records the gateway's RSS, open fds, threads, metric series and
in-flight count, Redis memory and keys, and the TTFT of the requests finished in that
window. Once the traffic stops it checks (:func:`verdicts`):

1. every well-formed request succeeded and every faulty one got its OpenAI error status;
2. the gateway's in-flight accounting is back to zero (``/admin/replicas``: the gateway's
   in-flight count and every replica's in-flight and queued-token counts);
3. Redis holds, for every replica, exactly the keys of the blocks its engine holds
   (recomputed from the replica's ``/debug/blocks``, :mod:`cachecore.agent.expect`);
4. no growth after warm-up (the first ``--warmup-frac`` of the run; the gateway's
   tokenizer segment cache is bounded small, ``--tokenizer-cache-tokens``, so that this
   bounded cache fills during warm-up and what grows after it is a leak): the mean RSS of the
   last quarter within max(4 MiB, 2%) of the third quarter's, metric series within
   max(10, 2%);
   once the client has closed, open fds other than sockets to the engines back to their
   pre-traffic count, and the idle upstream connections within the pool's bound;
5. no latency drift: the TTFT p99 of the last quarter within 2x (+50 ms) of the second's.

Exit code 1 when a check fails. Results and the command are recorded in
``docs/benchmarks.md`` ("Soak").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis
import redis.asyncio as aioredis
import yaml

from cachecore.agent.expect import dump_when_idle, expected_keys
from cachecore.argtypes import (
    float_between,
    nonnegative_float,
    positive_float,
    positive_int,
    writable_file,
)
from cachecore.engine.latency import get_profile
from cachecore.index.redis import RedisIndex
from cachecore.replica.fleet import FleetProcess, launch_fleet
from cachecore.testing import RedisServer, free_port
from cachecore.traceanalysis import percentile
from gateway.upstream import MAX_IDLE_PER_HOST
from loadtest.harness import MODEL, gateway_process, scaled_policy, write_api_keys
from loadtest.replay import LATE_SEND_S
from loadtest.workloads import TextSource, WorkItem, build

PROFILE = "8b-h100"
TENANTS = ("acme", "globex", "initech", "umbrella")
SHARED_TENANT = "acme"

# a request's kind: what it sends and what answer counts as right
OK_STREAM, OK_JSON, ABANDON, BAD_JSON, BAD_KEY, NO_MODEL = (
    "stream",
    "json",
    "abandon",
    "bad-json",
    "bad-key",
    "no-model",
)
EXPECTED_STATUS = {
    OK_STREAM: 200,
    OK_JSON: 200,
    ABANDON: 200,
    BAD_JSON: 400,
    BAD_KEY: 401,
    NO_MODEL: 404,
}
FAULT_SHARES = {ABANDON: 0.02, BAD_JSON: 0.01, BAD_KEY: 0.01, NO_MODEL: 0.005}


# --chaos-s: one fault every so often, in this rotation
DROP_EVENTS, PAUSE, REDIS_RESTART, UNHEALTHY, ENGINE_RESTART = (
    "drop-events", "pause", "redis-restart", "unhealthy", "engine-restart",
)  # fmt: skip
CHAOS_FAULTS = (DROP_EVENTS, PAUSE, REDIS_RESTART, UNHEALTHY, ENGINE_RESTART)
RESTART_GRACE_S = 1.0  # a request failing this close to its engine's restart was cut by it


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    t: float  # seconds after the traffic started
    fault: str
    replica: str | None  # None for Redis


@dataclass(frozen=True, slots=True)
class SoakRequest:
    t: float  # seconds after the traffic starts
    item: WorkItem
    kind: str


@dataclass(slots=True)
class Outcome:
    kind: str
    t_done: float
    status: int = 0
    ttft_s: float | None = None
    error: str | None = None
    t_start: float = 0.0
    replica: str | None = None  # x-kvgate-replica: which replica served it
    clean_error: bool = False  # a failure reported as an OpenAI error object (JSON or SSE)

    @property
    def right(self) -> bool:
        """The answer this kind of request must get (an OpenAI error object for faults)."""
        return self.error is None and self.status == EXPECTED_STATUS[self.kind]


@dataclass(slots=True)
class Sample:
    t: float
    rss_mib: float
    fds: int
    threads: int
    series: int
    in_flight: int
    redis_mib: float
    redis_keys: int
    done: int
    wrong: int
    ttft_p50_s: float
    ttft_p99_s: float
    cpu_s: float


@dataclass(slots=True)
class SoakReport:
    samples: list[Sample]
    outcomes: list[Outcome]
    baseline_fds: int
    baseline_upstream: int  # of baseline_fds: sockets to the engines (health, scrapes)
    final_fds: int
    final_upstream: int  # of final_fds: the same plus idle keep-alive upstream connections
    max_idle_upstream: int  # the upstream pool's bound: idle connections per engine x engines
    final_in_flight: int
    replica_accounts: list[dict[str, Any]]
    exactness: dict[str, tuple[int, int, int]]  # replica -> (held, wanted, differing)
    reloads: int
    reload_failures: int
    wall_s: float
    gateway_cpu_s: float
    late_sends: int = 0
    final_metrics: str = ""
    chaos: list[ChaosEvent] = field(default_factory=list)


# ------------------------------------------------------------------------------ traffic


def soak_schedule(minutes: float, rate: float, seed: int, text: TextSource) -> list[SoakRequest]:
    """The open-loop mix for ``minutes`` at ``rate`` requests/s, sorted by time."""
    dur = minutes * 60.0
    rng = random.Random(seed)
    out: list[tuple[float, WorkItem]] = []

    def take(name: str, share: float, seed_offset: int = 0, **kw: Any) -> list[WorkItem]:
        r = rate * share
        w = build(name, text, rate=r, seed=seed + seed_offset, **kw)
        return [it for it in w.items if it.t < dur]

    groups = 16
    for it in take(
        "shared-prefix",
        0.30,
        groups=groups,
        prompts_per_group=math.ceil(rate * 0.30 * dur * 1.2 / groups) + 1,
        output_tokens=32,
        tenant=SHARED_TENANT,
    ):
        out.append((it.t, it))
    for it in take(
        "tenant-mix",
        0.25,
        n=math.ceil(rate * 0.25 * dur * 1.2) + 1,
        tenants=TENANTS,
        output_tokens=24,
    ):
        out.append((it.t, it))
    mt = take(
        "multi-turn",
        0.15,
        sessions=max(2, math.ceil(rate * 0.15 * dur / 4) + 1),
        turns=4,
        output_tokens=24,
        think_time_s=3.0,
    )
    out.extend((it.t, replace(it, tenant=rng.choice(TENANTS))) for it in mt)
    for it in take(
        "short-unique", 0.25, n=math.ceil(rate * 0.25 * dur * 1.2) + 1, output_tokens=16
    ):
        out.append((it.t, replace(it, tenant=rng.choice(TENANTS))))
    for it in take(
        "tenant-mix",
        0.05,
        seed_offset=1,
        n=math.ceil(rate * 0.05 * dur * 1.2) + 1,
        tenants=TENANTS,
        output_tokens=16,
    ):
        kind = "session" if rng.random() < 0.5 else "request"
        session = f"sens-{rng.randrange(8)}" if kind == "session" else None
        out.append((it.t, replace(it, sensitive=kind, session=session, group="sensitive")))
    out.sort(key=lambda p: p[0])
    reqs: list[SoakRequest] = []
    for t, it in out:
        u = rng.random()
        kind = OK_JSON if (it.api == "completions" or rng.random() < 0.25) else OK_STREAM
        acc = 0.0
        for fault, share in FAULT_SHARES.items():
            acc += share
            if u < acc:
                kind = fault if fault != ABANDON or it.api == "chat" else kind
                break
        reqs.append(SoakRequest(t, it, kind))
    return reqs


async def send(
    client: httpx.AsyncClient, base: str, req: SoakRequest, keys: dict[str, str], t0: float
) -> Outcome:
    it = req.item
    path = "/v1/chat/completions" if it.api == "chat" else "/v1/completions"
    stream = req.kind in (OK_STREAM, ABANDON)
    body = it.body("no-such-model" if req.kind == NO_MODEL else MODEL, stream)
    key = "sk-wrong-" + "0" * 16 if req.kind == BAD_KEY else keys[it.tenant]
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if it.session:
        headers["x-session-id"] = it.session
    if it.sensitive:
        headers["x-kvgate-sensitive"] = it.sensitive
    raw = orjson.dumps(body)
    if req.kind == BAD_JSON:
        raw = raw[: len(raw) // 2]  # a body cut in the middle
    start = time.perf_counter()
    out = Outcome(req.kind, 0.0, t_start=start - t0)
    try:
        if not stream:
            resp = await client.post(base + path, content=raw, headers=headers)
            out.status = resp.status_code
            out.replica = resp.headers.get("x-kvgate-replica")
            out.ttft_s = time.perf_counter() - start
            data = resp.json()
            if resp.status_code != 200:
                out.clean_error = _is_openai_error(data)
                if not out.clean_error:
                    out.error = f"not an OpenAI error object: {resp.text[:120]}"
            elif "choices" not in data:
                out.error = "a 200 without choices"
        else:
            async with client.stream("POST", base + path, content=raw, headers=headers) as resp:
                out.status = resp.status_code
                out.replica = resp.headers.get("x-kvgate-replica")
                if resp.status_code != 200:
                    data = orjson.loads(await resp.aread())
                    out.clean_error = _is_openai_error(data)
                    if not out.clean_error:
                        out.error = "not an OpenAI error object"
                else:
                    out.error = await _read_stream(resp, req.kind == ABANDON, out, start)
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    out.t_done = time.perf_counter() - t0
    return out


def _is_openai_error(data: Any) -> bool:
    err = data.get("error") if isinstance(data, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err


async def _read_stream(
    resp: httpx.Response, abandon: bool, out: Outcome, start: float
) -> str | None:
    """Read an SSE answer to its [DONE]; with ``abandon`` leave after the first chunk."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return None
        obj = orjson.loads(payload)
        if "error" in obj:
            out.clean_error = _is_openai_error(obj)
            return f"stream error: {str(obj['error'])[:120]}"
        if out.ttft_s is None and obj.get("choices"):
            out.ttft_s = time.perf_counter() - start
            if abandon:
                return None  # leaving the block closes the connection mid-stream
    return "stream ended without [DONE]"


# ------------------------------------------------------------------------------ probes


def proc_stats(pid: int) -> tuple[float, int, int, float]:
    """(RSS MiB, open fds, threads, CPU seconds) of a process, from /proc."""
    rss = 0.0
    threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(stat[11]) + int(stat[12])) / tick  # utime + stime
    return rss, fds, threads, cpu


def upstream_sockets(pid: int, ports: set[int]) -> int:
    """How many of ``pid``'s open sockets are TCP connections to one of ``ports`` (its
    upstream pool: idle keep-alive connections to the engines, which the engines close
    after their own keep-alive timeout), from /proc/<pid>/fd and /proc/net/tcp{,6}."""
    inodes: set[str] = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[9] in inodes and int(cols[2].rsplit(":", 1)[1], 16) in ports:
                    n += 1
    return n


def metric_series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def metric_value(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric_sum(text: str, name: str, where: str = "") -> float:
    """The sum of a metric over its label sets whose labels contain ``where`` (a
    ``label="value"`` pair; empty: all of them); 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            if where and where not in line[len(name) : line.rfind("}") + 1]:
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


# counters reported at the end of a soak (name in the exposition and a label filter, label
# in the report)
REPORTED_COUNTERS = (
    ("kvgate_quarantine_transitions_total", 'to="in"', "quarantine entries"),
    ("kvgate_claim_checks_total", 'outcome="false"', "false claims"),
    ("kvgate_claim_checks_total", 'outcome="evicted"', "evictions seen at once"),
    ("kvgate_claim_checks_total", 'outcome="evicted_late"', "evictions reported late"),
    ("kvgate_claim_checks_total", 'outcome="evicted_restored"', "evictions stored again"),
    ("kvgate_claim_checks_total", 'outcome="unverifiable"', "unverifiable claim checks"),
    ("kvgate_claim_checks_total", 'outcome="tampered"', "impossible removal-log floors"),
    ("kvgate_claim_checks_total", 'outcome="skipped"', "claim checks skipped"),
    ("kvgate_index_fallbacks_total", "", "lookups answered locally"),
    ("kvgate_pending_write_errors_total", "", "pending write errors"),
    ("kvgate_upstream_errors_total", "", "upstream errors"),
    ("kvgate_upstream_retries_total", "", "retries"),
    ("kvgate_precision_warnings_total", "", "precision warnings"),
    ("kvgate_agent_messages_dropped_total", "", "agent messages dropped"),
    ("kvgate_agent_gaps_total", "", "agent gaps"),
    ("kvgate_agent_clears_total", "", "agent clears"),
)


# ------------------------------------------------------------------------------ verdicts


def growth_verdict(
    values: Sequence[float], warmup_frac: float, floor: float, rel: float
) -> tuple[bool, float]:
    """Growth of the last quarter's mean over the third quarter's, after warm-up: a leak
    keeps growing to the end, a bounded cache that fills during the run levels off. Returns
    (within max(floor, rel x third-quarter mean), growth)."""
    start = int(len(values) * warmup_frac)
    rest = list(values[start:])
    if len(rest) < 4:
        return True, 0.0
    q = len(rest) // 4
    third = statistics.fmean(rest[len(rest) - 2 * q : len(rest) - q])
    last = statistics.fmean(rest[len(rest) - q :])
    grew = last - third
    return grew <= max(floor, rel * third), grew


def cut_by_restart(o: Outcome, chaos: Sequence[ChaosEvent]) -> bool:
    """A well-formed request that failed with an OpenAI error while its engine restarted:
    the engine dropped it (as vLLM drops its requests when it dies), and the gateway
    reported it cleanly; nothing else may fail."""
    if o.right or not o.clean_error or o.kind not in (OK_STREAM, OK_JSON, ABANDON):
        return False
    return any(
        ev.fault == ENGINE_RESTART
        and (o.replica is None or ev.replica == o.replica)
        and o.t_start - RESTART_GRACE_S <= ev.t <= o.t_done + RESTART_GRACE_S
        for ev in chaos
    )


def verdicts(rep: SoakReport, warmup_frac: float) -> list[tuple[str, bool, str]]:
    """(check, passed, figures) for each check of the module docstring."""
    out: list[tuple[str, bool, str]] = []
    cut = [o for o in rep.outcomes if cut_by_restart(o, rep.chaos)]
    wrong = [o for o in rep.outcomes if not o.right and o not in cut]
    by_kind: dict[str, int] = {}
    for o in rep.outcomes:
        by_kind[o.kind] = by_kind.get(o.kind, 0) + 1
    detail = ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items()))
    first = "; first: " + f"{wrong[0].kind} {wrong[0].status} {wrong[0].error}" if wrong else ""
    if rep.chaos:
        faults = Counter(ev.fault for ev in rep.chaos)
        first += (
            f"; faults injected: {', '.join(f'{k} {n}' for k, n in sorted(faults.items()))}; "
            f"{len(cut)} cut by an engine restart, each with an OpenAI error"
        )
    out.append(
        (
            "every request got its right answer",
            not wrong,
            f"{len(rep.outcomes) - len(wrong) - len(cut)} right of {len(rep.outcomes)} "
            f"({detail}){first}",
        )
    )
    acct = [
        (
            r["id"],
            r["in_flight"],
            r["own_queued_tokens"],
            r["own_queued_requests"],
            r["own_running"],
        )
        for r in rep.replica_accounts
    ]
    dirty = [a for a in acct if any(a[1:])]
    out.append(
        (
            "in-flight accounting back to zero",
            rep.final_in_flight == 0 and not dirty,
            f"in_flight {rep.final_in_flight}; replicas not at zero: {dirty or 'none'}",
        )
    )
    bad = {r: v for r, v in rep.exactness.items() if v[2]}
    held = sum(v[0] for v in rep.exactness.values())
    out.append(
        (
            "Redis index == engines' cached blocks",
            bool(rep.exactness) and not bad,
            f"{held:,} keys over {len(rep.exactness)} replicas; differing: {bad or 'none'}",
        )
    )
    rss = [s.rss_mib for s in rep.samples]
    ok_rss, grew = growth_verdict(rss, warmup_frac, 4.0, 0.02)
    out.append(
        (
            "gateway RSS levels off",
            ok_rss,
            f"{rss[0]:.1f} -> {rss[-1]:.1f} MiB; last quarter {grew:+.1f} MiB on the third"
            if rss
            else "no samples",
        )
    )
    series = [float(s.series) for s in rep.samples]
    # a label value seen for the first time adds a few series; a per-request label adds one
    # per request: the floor of 10 tells them apart
    ok_series, sgrew = growth_verdict(series, warmup_frac, 10.0, 0.02)
    out.append(
        (
            "metric series bounded",
            ok_series,
            f"{int(series[0]) if series else 0} -> {int(series[-1]) if series else 0} "
            f"series; last quarter {sgrew:+.0f}",
        )
    )
    # sockets to the engines are the upstream pool (bounded; engines close idle ones after
    # their keep-alive timeout); every other fd must be back to its pre-traffic count
    other0 = rep.baseline_fds - rep.baseline_upstream
    other1 = rep.final_fds - rep.final_upstream
    pool = rep.final_upstream - rep.baseline_upstream
    fd_ok = other1 <= other0 + 8 and pool <= rep.max_idle_upstream
    out.append(
        (
            "open fds back to baseline",
            fd_ok,
            f"other than sockets to the engines: {other0} before traffic, {other1} after; "
            f"idle upstream connections after it {pool} (bound {rep.max_idle_upstream}); "
            f"peak fds {max((s.fds for s in rep.samples), default=0)}",
        )
    )
    start = int(len(rep.samples) * warmup_frac)
    windows = rep.samples[start:]
    q = len(windows) // 4
    if q:
        early = [s.ttft_p99_s for s in windows[q : 2 * q] if not math.isnan(s.ttft_p99_s)]
        late = [s.ttft_p99_s for s in windows[-q:] if not math.isnan(s.ttft_p99_s)]
        e = statistics.median(early) if early else math.nan
        la = statistics.median(late) if late else math.nan
        ok = math.isnan(e) or math.isnan(la) or la <= 2 * e + 0.05
        out.append(
            ("no TTFT drift", ok, f"window p99 median, second quarter {e:.3f} s, last {la:.3f} s")
        )
    out.append(
        (
            "policy reloads under load",
            rep.reload_failures == 0,
            f"{rep.reloads} reloads, {rep.reload_failures} failed",
        )
    )
    return out


# ------------------------------------------------------------------------------ the run


async def every(period_s: float, stop: asyncio.Event) -> AsyncIterator[int]:
    """Yields 0, 1, 2, ... once every ``period_s`` until ``stop`` is set (the soak's
    sampler, policy reloader and fault injector)."""
    k = 0
    while True:
        try:
            await asyncio.wait_for(stop.wait(), period_s)
            return
        except TimeoutError:
            yield k
            k += 1


async def _run_traffic(
    args: argparse.Namespace,
    base: str,
    pid: int,
    keys: dict[str, str],
    admin_key: str,
    policy_text: str,
    server: RedisServer,
    fleet: FleetProcess,
) -> SoakReport:
    redis_url = server.url
    schedule = soak_schedule(args.minutes, args.rate, args.seed, TextSource())
    chaos_log: list[ChaosEvent] = []
    r = aioredis.from_url(redis_url)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    admin = {"x-admin-key": admin_key}

    async def metrics_text() -> str:
        resp = await probe.get(base + "/metrics", headers=admin)  # tenants may not read it
        resp.raise_for_status()
        return resp.text

    samples: list[Sample] = []
    outcomes: list[Outcome] = []
    reloads = [0, 0]
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as probe:
        await asyncio.sleep(1.0)
        ports = {int(httpx.URL(u).port or 80) for u in fleet.urls}
        _, baseline_fds, _, cpu0 = proc_stats(pid)
        baseline_upstream = upstream_sockets(pid, ports)
        t0 = time.perf_counter()
        dur = args.minutes * 60.0
        stop = asyncio.Event()

        async def sampler() -> None:
            last_done = 0
            async for _ in every(args.sample_s, stop):
                rss, fds, threads, cpu = proc_stats(pid)
                text = await metrics_text()
                try:
                    used = (await r.info("memory"))["used_memory"] / 2**20
                    nkeys = int(await r.dbsize())
                except redis.RedisError:  # restarting (--chaos-s)
                    used, nkeys = math.nan, -1
                now = time.perf_counter() - t0
                window = [o for o in outcomes[last_done:] if o.ttft_s is not None and o.right]
                window = [o for o in window if o.kind in (OK_STREAM, OK_JSON)]
                last_done = len(outcomes)
                ttfts = [o.ttft_s for o in window if o.ttft_s is not None]
                samples.append(
                    Sample(
                        now,
                        rss,
                        fds,
                        threads,
                        metric_series(text),
                        int(metric_value(text, "kvgate_in_flight_requests") or 0),
                        used,
                        nkeys,
                        len(outcomes),
                        sum(
                            1 for o in outcomes if not o.right and not cut_by_restart(o, chaos_log)
                        ),
                        percentile(ttfts, 50),
                        percentile(ttfts, 99),
                        cpu - cpu0,
                    )
                )

        async def reloader() -> None:
            async for _ in every(args.reload_s, stop):
                resp = await probe.post(base + "/admin/policy", content=policy_text, headers=admin)
                reloads[0] += 1
                reloads[1] += resp.status_code != 200

        late = 0
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:

            async def one(req: SoakRequest) -> None:
                outcomes.append(await send(client, base, req, keys, t0))

            async def chaos() -> None:
                rng = random.Random(args.seed + 7)
                async for k in every(args.chaos_s, stop):
                    fault = CHAOS_FAULTS[k % len(CHAOS_FAULTS)]
                    ep = rng.choice(fleet.endpoints)
                    rid = None if fault == REDIS_RESTART else f"r{ep.index}"
                    chaos_log.append(ChaosEvent(time.perf_counter() - t0, fault, rid))
                    if fault == REDIS_RESTART:  # data lost, same port: agents must resync
                        await asyncio.to_thread(server.restart)
                    elif fault == DROP_EVENTS:  # a gap: the agent replays from the buffer
                        await probe.post(ep.url + "/debug/drop_events", json={"n": 5})
                    elif fault == PAUSE:  # a stalled engine
                        await probe.post(ep.url + "/debug/pause", json={"seconds": 2.0})
                    elif fault == UNHEALTHY:  # failing health checks, then back
                        await probe.post(ep.url + "/debug/health", json={"healthy": False})
                        await asyncio.sleep(5.0)
                        await probe.post(ep.url + "/debug/health", json={"healthy": True})
                    elif fault == ENGINE_RESTART:  # in-flight requests fail, cache empty
                        await probe.post(ep.url + "/debug/restart")

            tasks = [asyncio.create_task(sampler()), asyncio.create_task(reloader())]
            if args.chaos_s > 0:
                tasks.append(asyncio.create_task(chaos()))
            sends: list[asyncio.Task[None]] = []
            for req in schedule:
                delay = t0 + req.t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif delay < -LATE_SEND_S:
                    late += 1
                sends.append(asyncio.create_task(one(req)))
            rest = t0 + dur - time.perf_counter()
            if rest > 0:
                await asyncio.sleep(rest)
            _, unanswered = await asyncio.wait(sends, timeout=args.drain_s)
            for task in unanswered:  # counted as wrong: no answer within the bound
                task.cancel()
                outcomes.append(
                    Outcome(
                        OK_STREAM,
                        time.perf_counter() - t0,
                        0,
                        None,
                        f"no answer within --drain-s {args.drain_s}",
                    )
                )
            stop.set()
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        await asyncio.sleep(1.0)  # the client's connections are closed: let the server see it
        _, final_fds, _, cpu1 = proc_stats(pid)
        final_upstream = upstream_sockets(pid, ports)
        final_metrics = await metrics_text()
        state = (await probe.get(base + "/admin/replicas", headers=admin)).json()
        accounts = state["replicas"]
        exactness = await _exactness(probe, fleet, redis_url, args.settle_s)
    await r.aclose()
    return SoakReport(
        samples,
        outcomes,
        baseline_fds,
        baseline_upstream,
        final_fds,
        final_upstream,
        MAX_IDLE_PER_HOST * len(fleet.endpoints),
        int(state.get("in_flight", -1)),
        accounts,
        exactness,
        reloads[0],
        reloads[1],
        wall,
        cpu1 - cpu0,
        late,
        final_metrics,
        chaos_log,
    )


async def _exactness(
    client: httpx.AsyncClient, fleet: FleetProcess, redis_url: str, settle_s: float
) -> dict[str, tuple[int, int, int]]:
    """Per replica: (keys in Redis, keys its engine's blocks give, size of the symmetric
    difference), once the agents have had ``settle_s`` to catch up with the last events."""
    index = RedisIndex.from_url(redis_url)
    out: dict[str, tuple[int, int, int]] = {}
    try:
        for ep in fleet.endpoints:
            rid = f"r{ep.index}"
            deadline = time.monotonic() + settle_s
            while True:
                want = expected_keys(await dump_when_idle(client, ep.url), ep.model)
                held = set((await index.replica_blocks(rid)).keys())
                diff = len(held ^ want)
                if not diff or time.monotonic() > deadline:
                    out[rid] = (len(held), len(want), diff)
                    break
                await asyncio.sleep(0.25)
    finally:
        await index.close()
    return out


def format_report(rep: SoakReport, checks: list[tuple[str, bool, str]], every: int) -> str:
    lines = [
        "| t s | requests done | wrong | gateway RSS MiB | fds | threads | metric series | "
        "in flight | Redis MiB | Redis keys | TTFT p50 s | TTFT p99 s | gateway CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shown = rep.samples[::every]
    if rep.samples and rep.samples[-1] is not shown[-1]:
        shown.append(rep.samples[-1])
    for s in shown:
        lines.append(
            f"| {s.t:.0f} | {s.done:,} | {s.wrong} | {s.rss_mib:.1f} | {s.fds} | {s.threads} | "
            f"{s.series} | {s.in_flight} | {s.redis_mib:.1f} | {s.redis_keys:,} | "
            f"{s.ttft_p50_s:.3f} | {s.ttft_p99_s:.3f} | {s.cpu_s:.1f} |"
        )
    n = len(rep.outcomes)
    lines += [
        "",
        f"{n:,} requests in {rep.wall_s:.0f} s ({n / rep.wall_s:.1f}/s, {rep.late_sends} sent "
        f">{LATE_SEND_S * 1000:.0f} ms late); gateway process CPU (its embedded agents included) "
        f"{rep.gateway_cpu_s:.1f} s, {rep.gateway_cpu_s / max(1, n) * 1e6:,.0f} us per request.",
    ]
    m = rep.final_metrics
    prompt = metric_sum(m, "kvgate_prompt_tokens_total")
    cached = metric_sum(m, "kvgate_actual_cached_tokens_total")
    err = metric_value(m, "kvgate_cached_tokens_error_ratio")
    lines.append(
        f"Engine-reported token hit rate {cached / prompt if prompt else 0:.1%}, "
        f"predicted-vs-actual cached-token error {err if err is not None else math.nan:.2%}; "
        + ", ".join(
            f"{label} {metric_sum(m, name, where):.0f}" for name, where, label in REPORTED_COUNTERS
        )
        + "."
    )
    lines += ["", "| check | result | figures |", "|---|---|---|"]
    lines += [f"| {name} | {'pass' if ok else 'FAIL'} | {fig} |" for name, ok, fig in checks]
    return "\n".join(lines)


def plot(rep: SoakReport, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.t for s in rep.samples]
    fig, ax = plt.subplots(1, 4, figsize=(18, 3.8))
    ax[0].plot(t, [s.rss_mib for s in rep.samples])
    ax[0].set_title("gateway RSS (MiB)")
    ax[1].plot(t, [s.fds for s in rep.samples], label="fds")
    ax[1].plot(t, [s.in_flight for s in rep.samples], label="in flight")
    ax[1].set_title("gateway fds / in flight")
    ax[1].legend(fontsize=8)
    ax[2].plot(t, [s.redis_mib for s in rep.samples])
    ax[2].set_title("Redis used memory (MiB)")
    ax[3].plot(t, [s.ttft_p50_s for s in rep.samples], label="p50")
    ax[3].plot(t, [s.ttft_p99_s for s in rep.samples], label="p99")
    ax[3].set_title("TTFT per window (s)")
    ax[3].legend(fontsize=8)
    for a in ax:
        a.set_xlabel("s")
        a.grid(True, alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ CLI


def soak_policy(time_scale: float, slots: int) -> str:
    """The benchmarks' time-scaled default policy; tenants may ask for sensitive handling
    by header (the soak's sensitive requests do)."""
    data = yaml.safe_load(scaled_policy("expected_latency", time_scale, slots))
    data.setdefault("default_tenant", {}).setdefault("sensitive", {})["allow_header"] = True
    return str(yaml.safe_dump(data, sort_keys=False))


def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--minutes", type=positive_float, default=10.0, help="traffic duration")
    a("--rate", type=positive_float, default=8.0, help="offered requests/s (all kinds)")
    # checked by argparse: --replicas 0 started Redis and a gateway with no replica, then hung
    a("--replicas", type=positive_int, default=4)
    a("--blocks", type=positive_int, default=1024, help="KV blocks per replica (small: churn)")
    a("--time-scale", type=positive_float, default=0.5, help="replicas' time scale")
    a("--sample-s", type=positive_float, default=5.0)
    a("--reload-s", type=positive_float, default=30.0, help="admin policy reload period")
    a(
        "--warmup-frac",
        type=float_between(0, 1, high_open=True),
        default=0.3,
        help="share of the run that is warm-up",
    )
    a("--drain-s", type=positive_float, default=120.0, help="bound on waiting for the last answers")
    a(
        "--settle-s",
        type=positive_float,
        default=20.0,
        help="bound on waiting for the index to agree",
    )
    a("--seed", type=int, default=0)
    a(
        "--chaos-s",
        type=nonnegative_float,
        default=0.0,
        help="inject a fault this often (0: none): event drops, an engine pause, a Redis "
        "restart, failing health checks, an engine restart, in rotation",
    )
    a(
        "--tokenizer-cache-tokens",
        type=positive_int,
        default=50_000,
        help="the gateway's segment cache bound (small, so bounded caches fill during "
        "warm-up and what still grows after it is a leak; serving default 1,000,000)",
    )
    # checked up front: a write that fails at the end loses the soak
    a("--plot", type=writable_file, default=None, help="write a PNG of the samples here")


def run(args: argparse.Namespace) -> int:
    admin_key = "soak-admin-" + secrets.token_hex(8)
    keys = {t: f"sk-soak-{t}-{secrets.token_hex(8)}" for t in TENANTS}
    slots = get_profile(PROFILE).max_num_seqs
    policy_text = soak_policy(args.time_scale, slots)
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp, RedisServer() as server:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(policy_text)
        key_file = Path(tmp) / "keys.yaml"
        write_api_keys(key_file, keys)
        fleet_args = [
            "--profile",
            PROFILE,
            "--time-scale",
            str(args.time_scale),
            "--model",
            MODEL,
            "--blocks",
            str(args.blocks),
        ]
        print(
            f"# soak: {args.minutes} min at {args.rate}/s, {args.replicas} replicas x "
            f"{args.blocks} blocks, time scale {args.time_scale}, Redis {server.url}",
            flush=True,
        )
        with (
            launch_fleet(
                args.replicas,
                fleet_args,
                log_path=Path(tmp) / "fleet.log",
                process_per_replica=True,
            ) as fleet,
            gateway_process(
                fleet,
                free_port(),
                policy,
                key_file,
                admin_key,
                ["--redis", server.url],
                {"KVGATE_TOKENIZER_CACHE_TOKENS": str(args.tokenizer_cache_tokens)},
            ) as (base, proc),
        ):
            rep = asyncio.run(
                _run_traffic(args, base, proc.pid, keys, admin_key, policy_text, server, fleet)
            )
    checks = verdicts(rep, args.warmup_frac)
    every = max(1, round(30.0 / args.sample_s))  # one row per ~30 s
    print(format_report(rep, checks, every))
    if args.plot is not None:
        plot(rep, args.plot)
        print(f"\nplot: {args.plot}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0 if all(ok for _, ok, _ in checks) else 1
