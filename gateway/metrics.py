"""The gateway's Prometheus metrics, on a registry owned by one app instance.

Names are ``kvgate_*``. The precision metric ``kvgate_cached_tokens_error_total`` has two
parts: ``part="abs_error"`` sums ``|predicted - actual cached tokens|`` and ``part="prompt"``
sums prompt tokens, so the error fraction is ``abs_error / prompt`` over any window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge as _Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class _CachedLabels:
    """``labels()`` answered from a dict once a label set has been seen: prometheus-client
    validates the values and takes a lock on every call, ~5 us each, several per request.
    A label set is removed only through :meth:`remove_where`, which drops it from the cache
    too: a cached child is always the registered one (a stale one would count unseen)."""

    _children: dict[tuple[str, ...], Any]
    _labelnames: tuple[str, ...]
    _metrics: dict[Any, Any]
    _lock: Any

    def labels(self, *values: Any, **by_name: Any) -> Any:
        if by_name:
            return super().labels(*values, **by_name)  # type: ignore[misc]
        try:
            return self._children[values]
        except AttributeError:
            self._children = {}
        except KeyError:
            pass
        child = self._children[values] = super().labels(*values)  # type: ignore[misc]
        return child

    def remove_where(self, label: str, value: str) -> None:
        """Remove every label set whose ``label`` is ``value`` (all of a departed replica's
        series, whatever its other labels), from the cache as well: a later ``labels()``
        registers a new child."""
        if label not in self._labelnames:
            return
        at = self._labelnames.index(label)
        with self._lock:  # the registered children, those made by name included
            gone = [lv for lv in self._metrics if lv[at] == value]
        for lv in gone:
            self.remove(*lv)  # type: ignore[attr-defined]
        cache = getattr(self, "_children", None)
        if cache:
            for values in [v for v in cache if str(v[at]) == value]:
                del cache[values]


class Counter(_CachedLabels, _Counter):
    pass


class Gauge(_CachedLabels, _Gauge):
    pass


class Histogram(_CachedLabels, _Histogram):
    pass


_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_LOOKUP_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
)  # fmt: skip
_LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

STAGES = ("parse", "tokenize", "keys", "lookup", "score", "proxy")


@dataclass(slots=True)
class StageTimes:
    """Time per request stage, measured around *synchronous* sections only (so it is the
    CPU time of the event-loop thread: nothing inside awaits I/O), except ``lookup`` with a
    Redis index, which includes the round trip. ``perf_counter_ns`` rather than
    ``thread_time_ns``: the thread CPU clock is a syscall, several times dearer, and it
    would be paid ~12 times per request."""

    cpu_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    count: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))

    def add(self, stage: str, ns: int) -> None:
        self.cpu_ns[stage] = self.cpu_ns.get(stage, 0) + ns
        self.count[stage] = self.count.get(stage, 0) + 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            s: {
                "cpu_us_total": self.cpu_ns.get(s, 0) / 1e3,
                "count": self.count.get(s, 0),
                "cpu_us_mean": self.cpu_ns.get(s, 0) / 1e3 / max(1, self.count.get(s, 0)),
            }
            for s in self.cpu_ns
        }

    def reset(self) -> None:
        for s in list(self.cpu_ns):
            self.cpu_ns[s] = 0
            self.count[s] = 0

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self.add(name, time.perf_counter_ns() - t0)


class _StageCollector(Collector):
    """Exports :class:`StageTimes` at scrape time (no per-request metric call)."""

    def __init__(self, stages: StageTimes) -> None:
        self._stages = stages

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily(
            "kvgate_stage_cpu_seconds", "Gateway CPU time by request stage", labels=["stage"]
        )
        for stage, ns in self._stages.cpu_ns.items():
            fam.add_metric([stage], ns / 1e9)
        yield fam
        cnt = CounterMetricFamily(
            "kvgate_stage_calls", "Requests that went through each stage", labels=["stage"]
        )
        for stage, n in self._stages.count.items():
            cnt.add_metric([stage], n)
        yield cnt


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvgate_requests", "Client requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "kvgate_route_decisions", "Routing decisions", ["strategy", "reason"], registry=r
        )
        self.predicted_cached = Counter(
            "kvgate_predicted_cached_tokens", "Predicted cached prompt tokens", ["replica"],
            registry=r,
        )  # fmt: skip
        self.actual_cached = Counter(
            "kvgate_actual_cached_tokens", "Engine-reported cached prompt tokens", ["replica"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "kvgate_prompt_tokens", "Prompt tokens of answered requests", ["replica"], registry=r
        )
        self.cached_error = Counter(
            "kvgate_cached_tokens_error",
            "Precision check: part=abs_error sums |predicted-actual| cached tokens, "
            "part=prompt sums prompt tokens",
            ["part"],
            registry=r,
        )
        self.cached_error_ratio = Gauge(
            "kvgate_cached_tokens_error_ratio",
            "sum |predicted-actual| / sum prompt tokens since start",
            registry=r,
        )
        self.precision_warnings = Counter(
            "kvgate_precision_warnings", "Requests whose prediction missed by > the bound",
            registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "kvgate_ttft_seconds", "Time to first token seen by the gateway", ["replica"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "kvgate_e2e_seconds", "End-to-end request latency", ["replica"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.lookup = Histogram(
            "kvgate_index_lookup_seconds", "Prefix index lookup latency", ["source"],
            buckets=_LOOKUP_BUCKETS, registry=r,
        )  # fmt: skip
        self.index_fallbacks = Counter(
            "kvgate_index_fallbacks", "Lookups answered by the local index", ["reason"],
            registry=r,
        )  # fmt: skip
        # every child of these exported from the start (Prometheus' "avoid missing
        # metrics"): a first index timeout late in a run added a 16-series histogram
        # child then, which a dashboard's rate() misses and a growth check reads as a leak
        for source in ("primary", "local"):
            self.lookup.labels(source)
        for reason in ("timeout", "error"):
            self.index_fallbacks.labels(reason)
        self.index_unreadable = Counter(
            "kvgate_index_unreadable",
            "Lookups that found one of a replica's agent-owned index keys of the wrong type "
            "and read that replica as holding nothing (a broken or rogue agent; the other "
            "replicas' matches stand)",
            ["replica"], registry=r,
        )  # fmt: skip
        self.index_evicting = Gauge(
            "kvgate_index_evicting",
            "1 when the shared index's Redis had an allkeys-* maxmemory-policy at start-up "
            "(it evicts replicas' entries; the index requires noeviction or volatile-*)",
            registry=r,
        )
        self.pending_write_errors = Counter(
            "kvgate_pending_write_errors", "Pending writes the index refused or lost", registry=r
        )
        self.quarantined = Gauge(
            "kvgate_replica_quarantined", "1 while a replica is quarantined", ["replica"],
            registry=r,
        )  # fmt: skip
        self.quarantine_changes = Counter(
            "kvgate_quarantine_transitions", "Quarantine entries and exits", ["replica", "to"],
            registry=r,
        )  # fmt: skip
        self.claim_checks = Counter(
            "kvgate_claim_checks",
            "Index claims checked against the engine's cached tokens, by outcome: agree, "
            "evicted (the removal was in the index at the first look), evicted_late (it "
            "arrived within quarantine.settle_s), evicted_restored (the first missing block "
            "was removed after the lookup and stored again before the check), false, "
            "tampered (the removal log could not tell, at a floor no honest log has: a false "
            "claim), unverifiable (it could not tell, at a possible floor), skipped",
            ["replica", "outcome"], registry=r,
        )  # fmt: skip
        self.rate_limited = Counter(
            "kvgate_rate_limited", "Requests rejected by admission control", ["tenant", "limit"],
            registry=r,
        )  # fmt: skip
        self.upstream_errors = Counter(
            "kvgate_upstream_errors", "Upstream failures", ["replica", "kind"], registry=r
        )
        self.retries = Counter(
            "kvgate_upstream_retries", "Requests retried on another replica", registry=r
        )
        self.client_write_timeouts = Counter(
            "kvgate_client_write_timeouts",
            "Answers cut off because the client read none of it for "
            "KVGATE_CLIENT_WRITE_TIMEOUT_S (connection closed, upstream request cancelled; "
            "outcome 499)",
            registry=r,
        )
        self.salt_secret = Counter(
            "kvgate_salt_secret_used",
            "Requests sent with the primary salt secret's salt or the previous one's (during "
            "a rotation; drop the previous secret once its count stops growing)",
            ["secret"], registry=r,
        )  # fmt: skip
        self.healthy = Gauge(
            "kvgate_replica_healthy", "1 while a replica is routable", ["replica"], registry=r
        )
        self.in_flight = Gauge(
            "kvgate_in_flight_requests", "Requests in flight through this gateway", registry=r
        )
        # the Responses API's background mode (D33)
        self.background_watched = Gauge(
            "kvgate_background_responses_watched",
            "Background responses whose replica ticket is held until they are terminal",
            registry=r,
        )
        self.background_responses = Counter(
            "kvgate_background_responses",
            "Background responses by how their watch ended: completed, incomplete, "
            "cancelled, failed (terminal), lost (engine or replica no longer has it), "
            "expired (KVGATE_BACKGROUND_WATCH_MAX_S), shutdown; refused_share (429: the "
            "tenant's KVGATE_BACKGROUND_WATCH_TENANT_SHARE of the cap) and refused_capacity "
            "(503: KVGATE_BACKGROUND_WATCH_MAX), before any work; orphan_cancelled (a run "
            "whose answer never reached the client, cancelled on its replica); "
            "stream_failed (a streamed run whose stream ended on the replica's side without "
            "its terminal event after its first output: its watch ended, the run cancelled "
            "on its replica); engine_idle (a dead run: non-terminal while its replica's "
            "engine reported no running and no waiting request on consecutive scrapes; "
            "cancelled on its replica); too_large (its stored response over "
            "KVGATE_MAX_UPSTREAM_BODY_BYTES: the run had ended, not read)",
            ["outcome"],
            registry=r,
        )
        self.loop_lag = Histogram(
            "kvgate_event_loop_lag_seconds",
            "How late the gateway's event loop woke a 50 ms timer (CPU starvation: a "
            "cgroup quota's throttling, a noisy neighbour, a blocking call)",
            buckets=_LOOP_LAG_BUCKETS, registry=r,
        )  # fmt: skip
        self.health_inconclusive = Counter(
            "kvgate_health_probes_inconclusive",
            "Health probes that timed out while the gateway's own event loop was starved: "
            "not held against the replica",
            ["replica"], registry=r,
        )  # fmt: skip
        self.alignment = Counter(
            "kvgate_tokenizer_alignment_mismatches",
            "Start-up probes where the gateway's tokens differ from the engine's",
            registry=r,
        )
        self.policy_reloads = Counter(
            "kvgate_policy_reloads", "Policy reloads by outcome", ["outcome"], registry=r
        )
        self.api_key_reloads = Counter(
            "kvgate_api_key_reloads",
            "API key file reloads by outcome (invalid: refused, the old keys kept)",
            ["outcome"], registry=r,
        )  # fmt: skip
        for outcome in ("ok", "invalid"):
            self.api_key_reloads.labels(outcome)
        self.api_keys = Gauge(
            "kvgate_api_keys", "API keys loaded from the key file (--api-keys)", registry=r
        )
        self.api_key_lookups_refused = Counter(
            "kvgate_api_key_lookups_refused",
            "Requests whose unknown API key was not looked up in Redis: miss_budget (429, "
            "the client address spent its budget), miss_budget_global (429, all addresses "
            "together spent theirs), lookup_cap (503, no lookup slot freed)",
            ["reason"], registry=r,
        )  # fmt: skip
        for reason in ("miss_budget", "miss_budget_global", "lookup_cap"):
            self.api_key_lookups_refused.labels(reason)
        self.discovery = Counter(
            "kvgate_discovery_events",
            "Replica discovery: registrations refused by the allowlist (rejected) and "
            "registry reads that failed (error)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.stages = StageTimes()
        r.register(_StageCollector(self.stages))
        self._err_abs = 0
        self._err_prompt = 0

    def observe_precision(self, replica: str, predicted: int, actual: int, prompt: int) -> float:
        """Record one precision check; return this request's error fraction."""
        err = abs(predicted - actual)
        self.predicted_cached.labels(replica).inc(predicted)
        self.actual_cached.labels(replica).inc(actual)
        self.prompt_tokens.labels(replica).inc(prompt)
        self.cached_error.labels("abs_error").inc(err)
        self.cached_error.labels("prompt").inc(prompt)
        self._err_abs += err
        self._err_prompt += prompt
        if self._err_prompt:
            self.cached_error_ratio.set(self._err_abs / self._err_prompt)
        return err / prompt if prompt else 0.0

    def forget_replica(self, replica: str) -> None:
        """Drop every series of ``replica`` (a replica removed for good): each metric with a
        ``replica`` label, found by its labels, so one added later is not forgotten here."""
        for metric in vars(self).values():
            if isinstance(metric, _CachedLabels):
                metric.remove_where("replica", replica)

    @property
    def precision(self) -> tuple[int, int]:
        return self._err_abs, self._err_prompt
