"""vLLM's prompt counters and labels on the simulated replica (review 3, E1 and E2).

vLLM adds a request's WHOLE prompt (cache hits included) to ``vllm:prompt_tokens_total``
once, when its first token comes out (``IterationStats.update_from_output``), never a
preempted request's recomputation; newer versions export the hit part as
``vllm:prompt_tokens_cached_total``. Every v1 series has ``model_name`` and ``engine``
("0" for a single core: ``PrometheusStatLogger``'s ``labelnames``)."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachecore.agent.scrape import parse_metrics
from cachecore.engine import PROFILES, EngineConfig, EngineCore, EngineRequest, LatencyProfile
from cachecore.replica.metrics import ReplicaMetrics

VOCAB = tuple(range(1000, 1500))


def _drain(core: EngineCore, now: float = 0.0) -> float:
    for _ in range(10_000):  # bounded
        if not core.has_work():
            return now
        now += core.step(now).duration_s
    raise AssertionError("engine never drained")


def test_a_prompt_counts_whole_once_at_its_first_token() -> None:
    core = EngineCore(EngineConfig(profile=PROFILES["8b-h100"], num_blocks=4096), VOCAB)
    prefix = list(range(1000, 1000 + 8192))
    core.add_request(EngineRequest("warm", prefix, max_tokens=1), 0.0)
    now = _drain(core)
    st = core.stats()
    assert (st.num_prompt_tokens, st.num_prompt_tokens_cached) == (8192, 0)
    prompt = prefix + list(range(50_000, 50_000 + 20_480))  # 8,192 cached + 20,480 computed
    core.add_request(EngineRequest("long", prompt, max_tokens=2), now)
    seen = []
    for _ in range(10):
        if not core.has_work():
            break
        r = core.step(now)
        now += r.duration_s
        st = core.stats()
        seen.append((r.num_prefill_tokens, st.num_prompt_tokens, st.num_prompt_tokens_cached))
    # two full 8,192-token chunks: unchanged; the last chunk gives the first token: the
    # whole prompt, its 8,192 hit tokens as cached
    assert seen[:3] == [
        (8192, 8192, 0),
        (8192, 8192, 0),
        (4096, 8192 + len(prompt), 8192),
    ], seen
    assert core.stats().num_prompt_tokens_computed == 8192 + 20_480  # kvgate's: computed


def test_a_preempted_requests_recomputation_is_not_a_prompt() -> None:
    flat = LatencyProfile("flat", 0.01, 0.001, 0.005, max_num_seqs=8)
    core = EngineCore(
        EngineConfig(profile=flat, block_size=4, num_blocks=12, max_num_batched_tokens=64),
        VOCAB,
    )
    core.add_request(EngineRequest("R1", list(range(16)), max_tokens=20), 0.0)
    core.add_request(EngineRequest("R2", list(range(100, 116)), max_tokens=20), 0.0)
    _drain(core)
    st = core.stats()
    assert st.num_preemptions >= 1
    assert st.num_prompt_tokens == 32  # each prompt once
    assert st.num_prompt_tokens_computed > 32  # the recomputation is work all the same


def _exposition(metrics: ReplicaMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_every_vllm_series_is_labelled_engine_0_and_the_counters_are_exported() -> None:
    core = EngineCore(EngineConfig(profile=PROFILES["8b-h100"], num_blocks=256), VOCAB)
    metrics = ReplicaMetrics("m", lambda: core, 1000.0)
    metrics.ttft.observe(0.1)
    core.add_request(EngineRequest("a", list(range(100)), max_tokens=2), 0.0)
    _drain(core)
    core.add_request(EngineRequest("b", list(range(100)), max_tokens=2), 1.0)
    _drain(core, 1.0)
    values: dict[str, float] = {}
    vllm_samples = 0
    for fam in text_string_to_metric_families(_exposition(metrics)):
        for s in fam.samples:
            if s.name.startswith("vllm:"):
                vllm_samples += 1
                assert s.labels.get("engine") == "0" and s.labels["model_name"] == "m", s
            values[s.name] = s.value
    assert vllm_samples > 20
    assert values["vllm:prompt_tokens_total"] == 200.0
    assert values["vllm:prompt_tokens_cached_total"] == 96.0  # b's 6 full blocks
    assert values["kvgate_prefill_tokens_computed_total"] == 104.0
    assert values["vllm:prefix_cache_queries_total"] == values["vllm:prompt_tokens_total"]
    # the agent reads a single core's "0" as the engine's totals (no per-core split)
    snap = parse_metrics(_exposition(metrics))
    assert snap.engines == {} and snap.prompt_tokens == 200.0 and snap.block_size == 16
    assert snap.for_core(0) is snap
