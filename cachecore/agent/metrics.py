"""The agent's own Prometheus metrics, in a per-agent :class:`CollectorRegistry` (never the
process-wide default registry: the gateway runs several agents in one process)."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

# Event-to-index latency lives in milliseconds to tens of milliseconds when healthy and in
# seconds during a replay or an index outage: buckets cover both.
_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_WRITE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

LATENCY_WINDOW = 20_000
"""Event-to-index latencies kept for exact percentiles in ``/health``."""


class LatencyWindow:
    """The last ``size`` event-to-index latencies, seconds (for exact p50/p99 where the
    histogram's buckets are too coarse, e.g. in ``kvgate bench ingest``).

    A ring of C doubles allocated whole at construction (8 bytes a value, 160 KB at the
    default size): a gateway runs one agent per replica, and a deque of float objects
    (~32 bytes a value) grew for the better part of an hour at soak rates before reaching
    its bound, which read as a memory leak in RSS.
    """

    __slots__ = ("_buf", "_count", "_next")

    def __init__(self, size: int = LATENCY_WINDOW) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self._buf = array("d", bytes(8 * size))
        self._next = 0  # slot the next value goes to
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, seconds: float) -> None:
        buf = self._buf
        buf[self._next] = seconds
        self._next = (self._next + 1) % len(buf)
        if self._count < len(buf):
            self._count += 1

    def values(self) -> list[float]:
        """The kept values, oldest first."""
        if self._count < len(self._buf):
            return self._buf[: self._count].tolist()
        return (self._buf[self._next :] + self._buf[: self._next]).tolist()

    def percentile(self, q: float) -> float | None:
        if not self._count:
            return None
        # nearest rank: the smallest value with at least q% of the values at or below it
        ordered = sorted(self._buf[: self._count])
        rank = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
        return ordered[rank]

    def clear(self) -> None:
        self._next = self._count = 0


class AgentMetrics:
    """Every counter the agent keeps. Labels: ``replica`` is the index replica id (with its
    ``@dpN`` suffix), ``reason`` the drop reason of :class:`MalformedEventError` or the
    agent's own checks."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.batches_received = Counter(
            "kvgate_agent_batches_received", "Event batches received (live and replay)",
            ["source"], registry=r,
        )  # fmt: skip
        self.events_applied = Counter(
            "kvgate_agent_events_applied", "Engine events applied to the mirror", ["replica"],
            registry=r,
        )  # fmt: skip
        self.blocks_stored = Counter(
            "kvgate_agent_blocks_stored", "Blocks indexed by BlockStored", ["replica"],
            registry=r,
        )  # fmt: skip
        self.blocks_removed = Counter(
            "kvgate_agent_blocks_removed", "Blocks removed by BlockRemoved", ["replica"],
            registry=r,
        )  # fmt: skip
        self.blocks_dropped = Counter(
            "kvgate_agent_blocks_dropped",
            "Blocks not indexed: unscoped, ephemeral, unknown parent, other group",
            ["replica", "reason"], registry=r,
        )  # fmt: skip
        self.messages_dropped = Counter(
            "kvgate_agent_messages_dropped", "Messages dropped as malformed, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        self.events_skipped = Counter(
            "kvgate_agent_events_skipped",
            "Events skipped while the rest of their batch applies: of a type the agent does "
            "not know, or stores with nothing to key (masked blocks, tier placeholders)",
            registry=r,
        )  # fmt: skip
        self.conflicts = Counter(
            "kvgate_agent_registration_conflicts",
            "Heartbeats that found another agent registered for this replica id",
            registry=r,
        )  # fmt: skip
        self.stale_batches = Counter(
            "kvgate_agent_stale_batches", "Batches ignored because seq <= last applied",
            registry=r,
        )  # fmt: skip
        self.gaps = Counter("kvgate_agent_gaps", "Sequence gaps detected", registry=r)
        self.resubscribes = Counter(
            "kvgate_agent_resubscribes", "SUB sockets replaced after a lost connection",
            registry=r,
        )  # fmt: skip
        self.replays = Counter(
            "kvgate_agent_replays", "Replay requests, by outcome", ["outcome"], registry=r
        )
        self.replayed_batches = Counter(
            "kvgate_agent_replayed_batches", "Batches received through replay", registry=r
        )
        self.clears = Counter(
            "kvgate_agent_clears", "Replica clears (index epoch bumps), by cause",
            ["replica", "cause"], registry=r,
        )  # fmt: skip
        self.resyncs = Counter(
            "kvgate_agent_resyncs", "Index rewrites from the mirror, by cause",
            ["replica", "cause"], registry=r,
        )  # fmt: skip
        self.engine_restarts = Counter(
            "kvgate_agent_engine_restarts", "Engine restarts detected, by signal", ["signal"],
            registry=r,
        )  # fmt: skip
        self.index_writes = Counter(
            "kvgate_agent_index_writes", "Index write calls (coalesced batches)", ["replica"],
            registry=r,
        )  # fmt: skip
        self.index_errors = Counter(
            "kvgate_agent_index_errors", "Failed index calls", ["replica", "op"], registry=r
        )
        self.index_write_seconds = Histogram(
            "kvgate_agent_index_write_seconds", "Latency of one index write call",
            buckets=_WRITE_BUCKETS, registry=r,
        )  # fmt: skip
        self.event_to_index_seconds = Histogram(
            "kvgate_agent_event_to_index_seconds",
            "Engine batch timestamp to the index write that covers it completing",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.lag_seconds = Gauge(
            "kvgate_agent_lag_seconds", "now - ts of the last batch written to the index",
            ["replica"], registry=r,
        )  # fmt: skip
        self.seq_lag = Gauge(
            "kvgate_agent_seq_lag", "last received seq - last seq written to the index",
            ["replica"], registry=r,
        )  # fmt: skip
        self.last_seq = Gauge(
            "kvgate_agent_last_seq", "Last engine seq written to the index", ["replica"],
            registry=r,
        )  # fmt: skip
        self.mirror_blocks = Gauge(
            "kvgate_agent_mirror_blocks", "Keys in the agent's mirror", ["replica"], registry=r
        )
        self.engine_up = Gauge(
            "kvgate_agent_engine_up", "1 when the last engine scrape succeeded", registry=r
        )
        self.index_evicting = Gauge(
            "kvgate_agent_index_evicting",
            "1 when the index's Redis has an allkeys-* maxmemory-policy (it evicts replicas' "
            "entries; the index requires noeviction or volatile-*)",
            registry=r,
        )
        self.engine_stalled = Gauge(
            "kvgate_agent_engine_stalled_seconds",
            "How long the engine has had requests without advancing its token counters, "
            "as of the last scrape (0: progressing, idle, or no counters)",
            registry=r,
        )
        self.events_silent = Gauge(
            "kvgate_agent_events_silent",
            "1 while the engine computes (its counters prove new blocks) and publishes no "
            "KV events: a broken publisher or kv_events_config, an unreachable event port",
            registry=r,
        )
        self.silences = Counter(
            "kvgate_agent_events_silences",
            "Times the engine was found computing without publishing KV events",
            registry=r,
        )
        self.scrape_errors = Counter(
            "kvgate_agent_scrape_errors", "Failed engine /metrics scrapes", registry=r
        )
        self.heartbeats = Counter(
            "kvgate_agent_heartbeats", "Registration heartbeats, by outcome", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.loop_restarts = Counter(
            "kvgate_agent_loop_restarts",
            "Background loops (scrape, check, heartbeat, stream) and start-up (start) "
            "restarted after an unexpected error",
            ["replica", "loop"], registry=r,
        )  # fmt: skip
        self.load_publishes = Counter(
            "kvgate_agent_load_publishes", "Load records published, by outcome", ["outcome"],
            registry=r,
        )  # fmt: skip
        self.latency = LatencyWindow()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class AgentsCollector:
    """Exposes the per-agent registries of embedded agents through one registry (the
    gateway's ``/metrics``): one family per metric name, each sample labelled with its
    agent's replica (samples that already carry ``replica`` keep it)."""

    def __init__(self, agents: Mapping[str, CollectorRegistry]) -> None:
        self._agents = dict(agents)  # replica id -> that agent's registry

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica, registry in self._agents.items():
            for fam in registry.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    labels = s.labels if "replica" in s.labels else {**s.labels, "replica": replica}
                    out.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
