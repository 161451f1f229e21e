"""Prometheus metrics of one replica under vLLM's names and labels (``model_name`` and
``engine``, the core's index: "0" for a single core, as ``vllm serve`` labels every v1
series), in a registry of its own (never the process-wide default registry).

Gauges and counters are read from the engine at scrape time; latency histograms are observed
by the driver in wall-clock seconds, as a client sees them (i.e. already multiplied by the
time scale). ``process_start_time_seconds`` is the simulated engine process's start: it
changes on ``/debug/restart`` so agents can tell a restarted engine from a reconnect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cachecore.engine import EngineCore

# vLLM's buckets
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class _EngineCollector(Collector):
    def __init__(
        self, model: str, engine: Callable[[], EngineCore], start_time: float, index: str
    ) -> None:
        self._model = model
        self._engine = engine
        self._start_time = start_time
        self._index = index

    def collect(self) -> Iterator[Metric]:
        core = self._engine()
        st = core.stats()
        m = [self._model, self._index]
        lbl = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(m, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Requests in the model execution batch.", st.num_running
        )
        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be processed.", st.num_waiting
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            st.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", st.prefix_cache_queries
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", st.prefix_cache_hits
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", st.num_preemptions
        )
        # vLLM's meaning: each request's whole prompt, added at its first token (a long
        # chunked prefill leaves it still until then; D17 reads it)
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", st.num_prompt_tokens
        )
        yield counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local prefix cache hits).",
            st.num_prompt_tokens_cached,
        )
        yield counter(
            "kvgate_prefill_tokens_computed",
            "Prefill tokens computed by the simulated engine, every chunk and recomputation.",
            st.num_prompt_tokens_computed,
        )
        yield counter(
            "vllm:generation_tokens", "Generation tokens processed.", st.num_generation_tokens
        )
        yield counter("vllm:request_success", "Successfully processed requests.", st.num_finished)
        cfg = core.config
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            labels=[
                "model_name",
                "engine",
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric(
            [*m, str(cfg.block_size), str(cfg.num_blocks), "True", cfg.hash_algo.value], 1.0
        )
        yield info
        yield GaugeMetricFamily(
            "process_start_time_seconds",
            "Start time of the (simulated) engine process since unix epoch in seconds.",
            value=self._start_time,
        )  # fmt: skip


class ReplicaMetrics:
    """One replica's registry. Rebuilt on a simulated restart (counters start over)."""

    def __init__(
        self,
        model: str,
        engine: Callable[[], EngineCore],
        start_time: float,
        engine_index: int = 0,
    ) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        lbl = ["model_name", "engine"]
        idx = str(engine_index)
        reg = self.registry
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.",
            lbl, registry=reg, buckets=_TTFT_BUCKETS,
        ).labels(model_name=model, engine=idx)  # fmt: skip
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time spent in the WAITING phase.",
            lbl, registry=reg, buckets=_LATENCY_BUCKETS,
        ).labels(model_name=model, engine=idx)  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End to end request latency in seconds.",
            lbl, registry=reg, buckets=_LATENCY_BUCKETS,
        ).labels(model_name=model, engine=idx)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.",
            lbl, registry=reg, buckets=_ITL_BUCKETS,
        ).labels(model_name=model, engine=idx)  # fmt: skip
        self.loop_lag = Histogram(
            "kvgate_replica_loop_lag_seconds",
            "How late the replica's engine loop woke up after a step (event-loop lag).",
            registry=reg, buckets=_LAG_BUCKETS,
        )  # fmt: skip
        reg.register(_EngineCollector(model, engine, start_time, idx))
