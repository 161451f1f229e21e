"""Open-loop replay of a :class:`~loadtest.workloads.Workload` against any OpenAI-compatible
URL (the kvgate gateway, a peer router, or a replica directly).

Open loop: each request is sent at its arrival time whether or not earlier ones have
finished (a closed loop hides queueing, which is what routing is about). Streaming requests
measure TTFT as the time from the request's due time (not its actual send: a late send's
wait counts) to the first content chunk and read the engine-reported
``usage.prompt_tokens_details.cached_tokens`` from the final usage chunk.

``time_scale`` maps trace seconds to wall seconds (``wall = t * time_scale``), the same
factor simulated replicas apply to their step times, so a trace replayed at 0.1 against
replicas at ``--time-scale 0.1`` keeps the trace's load, ten times faster.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from cachecore.traceanalysis import percentile
from gateway.upstream import LeanTransport
from loadtest.workloads import WorkItem, Workload

LATE_SEND_S = 0.05
"""An open-loop send this long (wall) after its due time counts as late."""


@dataclass(slots=True)
class RequestResult:
    index: int
    item: WorkItem
    t_sched: float  # wall seconds after replay start when it was due
    t_sent: float = math.nan
    ttft_s: float | None = None
    e2e_s: float | None = None
    status: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    replica: str | None = None
    predicted_cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


@dataclass(slots=True)
class ReplayReport:
    workload: str
    results: list[RequestResult]
    wall_s: float
    time_scale: float
    late_sends: int = 0  # requests sent more than LATE_SEND_S (wall) after their due time
    meta: dict[str, Any] = field(default_factory=dict)

    def ok_results(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def summary(self, replicas: Sequence[str] | None = None) -> dict[str, float]:
        """The run's figures. ``replicas``: every replica id of the fleet, so one that got
        no request counts in the imbalance (without it only the replicas seen do)."""
        ok = self.ok_results()
        scale = self.time_scale or 1.0
        ttft = [r.ttft_s / scale for r in ok if r.ttft_s is not None]
        e2e = [r.e2e_s / scale for r in ok if r.e2e_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        pred = [r for r in ok if r.predicted_cached_tokens is not None]
        pred_prompt = sum(r.prompt_tokens for r in pred)
        per_replica = Counter(r.replica for r in ok if r.replica)
        if per_replica:
            for rid in replicas or ():
                per_replica.setdefault(rid, 0)
        imbalance = (
            max(per_replica.values()) / (sum(per_replica.values()) / len(per_replica))
            if per_replica
            else math.nan
        )
        return {
            "requests": float(len(self.results)),
            "errors": float(len(self.results) - len(ok)),
            "token_hit_rate": cached / prompt if prompt else 0.0,
            "prefill_tokens": float(prompt - cached),
            "prompt_tokens": float(prompt),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else math.nan,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "e2e_p99_s": percentile(e2e, 99),
            "throughput_rps": len(ok) / (self.wall_s / scale) if self.wall_s > 0 else 0.0,
            "load_imbalance": imbalance,
            "cached_pred_error": (
                sum(abs((r.predicted_cached_tokens or 0) - r.cached_tokens) for r in pred)
                / pred_prompt
                if pred_prompt
                else math.nan
            ),
            "late_sends": float(self.late_sends),
        }


class BadAnswer(ValueError):
    """A 2xx answer that is not an OpenAI-compatible one (not a JSON object, a stream cut
    before ``data: [DONE]``, a usage count that is no count)."""


def _usage_of(obj: Mapping[str, Any], res: RequestResult) -> None:
    usage = obj.get("usage")
    if not isinstance(usage, Mapping):
        return
    res.prompt_tokens = _count(usage.get("prompt_tokens"))
    res.completion_tokens = _count(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        res.cached_tokens = _count(details.get("cached_tokens"))


def _count(value: object) -> int:
    """A token count of a usage object; null or absent is 0, anything else that is no
    count raises BadAnswer (a server's bug: the request did not answer as it should)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadAnswer(f"usage count is not a count: {value!r}"[:200])
    return value


def _error_text(data: object, fallback: str) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message"}}``, a bare
    ``{"error": "..."}`` (some routers) or ``{"message": ...}`` (older vLLM), else the
    body itself."""
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping) and err.get("message") is not None:
            return str(err["message"])[:200]
        if isinstance(err, str):
            return err[:200]
        if data.get("message") is not None:
            return str(data["message"])[:200]
    return fallback[:200]


def _object(payload: str) -> Mapping[str, Any]:
    obj = json.loads(payload)
    if not isinstance(obj, Mapping):
        raise BadAnswer(f"not a JSON object: {payload[:80]!r}")
    return obj


def _has_content(obj: Mapping[str, Any]) -> bool:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, Mapping):
            continue
        delta = choice.get("delta")
        if isinstance(delta, Mapping) and delta.get("content"):
            return True
        if choice.get("text"):
            return True
    return False


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    item: WorkItem,
    res: RequestResult,
    headers: Mapping[str, str],
    stream: bool,
    body: Mapping[str, Any] | None = None,
    t_due: float | None = None,
) -> None:
    """Send one request and record what came back in ``res``. ``body`` overrides the
    item's own body (a request with extra fields, e.g. the attack suite's spoofed salts).
    ``t_due`` (``time.perf_counter()`` clock): when an open loop meant to send it; TTFT and
    e2e are then timed from it, so a send the load generator made late (its loop starved,
    the in-flight gate full) counts its wait, as a user's request would (no coordinated
    omission). Without it they are timed from the send (a closed-loop probe)."""
    path = "/v1/chat/completions" if item.api == "chat" else "/v1/completions"
    body = dict(body) if body is not None else item.body(model, stream)
    res.t_sent = time.perf_counter()
    t0 = res.t_sent if t_due is None else min(t_due, res.t_sent)
    try:
        if not stream:
            resp = await client.post(base_url + path, json=body, headers=headers)
            res.status = resp.status_code
            res.e2e_s = res.ttft_s = time.perf_counter() - t0
            res.replica = resp.headers.get("x-kvgate-replica")
            _predicted(resp.headers, res)
            if resp.is_success:
                _usage_of(_object(resp.text), res)
            else:
                try:
                    data: object = resp.json()
                except ValueError:  # an error page that is no JSON (a proxy's HTML)
                    data = None
                res.error = _error_text(data, resp.text)
            return
        async with client.stream("POST", base_url + path, json=body, headers=headers) as resp:
            res.status = resp.status_code
            res.replica = resp.headers.get("x-kvgate-replica")
            _predicted(resp.headers, res)
            if not resp.is_success:
                raw = await resp.aread()
                res.error = raw.decode(errors="replace")[:200]
                return
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    obj = _object(payload)
                except ValueError:
                    res.error = "bad SSE payload"
                    return
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    return
                if res.ttft_s is None and _has_content(obj):
                    res.ttft_s = time.perf_counter() - t0
                _usage_of(obj, res)
            if not done:  # every OpenAI-compatible stream ends so: this one was cut short
                raise BadAnswer("stream ended without data: [DONE]")
            res.e2e_s = time.perf_counter() - t0
            if res.ttft_s is None:
                res.ttft_s = res.e2e_s
    except (httpx.HTTPError, ValueError) as exc:  # JSONDecodeError and BadAnswer too
        res.error = f"{type(exc).__name__}: {exc}"[:200]


def _predicted(headers: httpx.Headers, res: RequestResult) -> None:
    raw = headers.get("x-kvgate-predicted-cached-tokens")
    if raw is not None and raw.isdigit():
        res.predicted_cached_tokens = int(raw)


async def replay(
    workload: Workload,
    base_url: str,
    model: str,
    api_keys: Mapping[str, str] | None = None,
    time_scale: float = 1.0,
    stream: bool = True,
    timeout_s: float = 120.0,
    max_in_flight: int = 2048,
    extra_headers: Mapping[str, str] | None = None,
    client: httpx.AsyncClient | None = None,
) -> ReplayReport:
    """Send every item at ``t * time_scale`` after the start; wait for all to finish."""
    base_url = base_url.rstrip("/")
    results = [RequestResult(i, it, it.t * time_scale) for i, it in enumerate(workload.items)]
    own_client = client is None
    # the gateway's upstream transport, not httpx's: on a 2-core machine httpcore's
    # per-chunk cost made this load generator the fleet's biggest CPU rival (~30 ms of CPU
    # per 128-token stream), and the fleet's loop lag is what invalidates a run. Kept from
    # httpx's pool: 256 kept-alive connections. Unlike it: no proxy from the environment
    # (the bench and the demo send to loopback), and a body must be framed (content-length
    # or chunked, as uvicorn, hyper and SGLang's servers frame every one)
    http = client or httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s),
        transport=LeanTransport(max_connections=max_in_flight, max_idle_per_host=256),
    )
    gate = asyncio.Semaphore(max_in_flight)

    def headers_for(item: WorkItem) -> dict[str, str]:
        h = dict(extra_headers or {})
        if api_keys is not None:
            h["authorization"] = f"Bearer {api_keys[item.tenant]}"
        if item.session:
            h["x-session-id"] = item.session
        if item.sensitive:
            h["x-kvgate-sensitive"] = item.sensitive
        return h

    async def one(res: RequestResult, due: float) -> None:
        async with gate:
            await send_one(
                http, base_url, model, res.item, res, headers_for(res.item), stream, t_due=due
            )

    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    try:
        for res in results:
            delay = start + res.t_sched - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(res, start + res.t_sched)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        if own_client:
            await http.aclose()
    wall = time.perf_counter() - start
    for res in results:
        res.t_sent -= start
    # late at the send itself: a task created on time still waits for a starved loop
    late = sum(1 for r in results if r.t_sent - r.t_sched > LATE_SEND_S)
    return ReplayReport(workload.name, results, wall, time_scale, late)


def format_table(
    rows: Sequence[tuple[str, Mapping[str, float]]],
    extra: Sequence[tuple[str, Sequence[str]]] = (),
) -> str:
    """One markdown table row per system (TTFT in trace seconds, i.e. wall / time_scale).
    ``extra``: more columns, each a header and one cell per row."""
    heads = [h for h, _ in extra]
    head = (
        "| system | hit rate | prefill tokens | TTFT mean | p50 | p90 | p99 | e2e p99 | "
        "req/s | errors | imbalance | pred. error |"
        + "".join(f" {h} |" for h in heads)
        + "\n|---|---|---|---|---|---|---|---|---|---|---|---|"
        + "---|" * len(heads)
    )
    lines = [head]
    for i, (name, s) in enumerate(rows):
        pe = s.get("cached_pred_error", math.nan)
        lines.append(
            f"| {name} | {s['token_hit_rate']:.1%} | {s['prefill_tokens']:,.0f} | "
            f"{s['ttft_mean_s']:.3f} | {s['ttft_p50_s']:.3f} | {s['ttft_p90_s']:.3f} | "
            f"{s['ttft_p99_s']:.3f} | {s['e2e_p99_s']:.3f} | {s['throughput_rps']:.2f} | "
            f"{s['errors']:.0f} | {s['load_imbalance']:.2f} | "
            f"{'-' if math.isnan(pe) else f'{pe:.2%}'} |"
            + "".join(f" {cells[i]} |" for _, cells in extra)
        )
    return "\n".join(lines)
