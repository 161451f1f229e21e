"""Engine progress from its token counters (D17): busy without progress is a stall; idle,
restarted or counter-less engines never are."""

from __future__ import annotations

import time

from prometheus_client.exposition import generate_latest

from cachecore.agent.links import LoadLink
from cachecore.agent.metrics import AgentMetrics
from cachecore.agent.progress import ProgressTracker
from cachecore.agent.scrape import EngineCounters, EngineSnapshot, parse_metrics
from cachecore.agent.settings import AgentSettings
from cachecore.engine import EngineConfig, EngineCore, EngineRequest, LatencyProfile
from cachecore.loadstate import MemoryLoadStore
from cachecore.replica.metrics import ReplicaMetrics

VOCAB = tuple(range(1000, 1500))
FLAT = LatencyProfile("flat", 0.01, 0.001, 0.005, max_num_seqs=8)


def snap(
    prompt: float | None = 100.0,
    gen: float | None = 10.0,
    running: float = 1.0,
    waiting: float = 0.0,
    start: float | None = 1000.0,
) -> EngineSnapshot:
    return EngineSnapshot(
        running=running,
        waiting=waiting,
        start_time=start,
        prompt_tokens=prompt,
        generation_tokens=gen,
    )


def test_busy_without_progress_counts_from_the_last_scrape_that_saw_progress() -> None:
    t = ProgressTracker()
    assert t.observe(snap(), 0.0) == 0.0  # first scrape: no baseline
    assert t.observe(snap(gen=11.0), 1.0) == 0.0  # progress
    assert t.observe(snap(gen=11.0), 2.0) == 1.0  # none since the scrape at 1.0
    assert t.observe(snap(gen=11.0, running=0.0, waiting=3.0), 3.0) == 2.0  # waiting counts
    # either counter moving is progress, and it starts the count over
    assert t.observe(snap(prompt=150.0, gen=11.0), 4.0) == 0.0
    assert t.observe(snap(prompt=150.0, gen=11.0), 6.5) == 2.5


def test_an_idle_engine_is_never_stalled() -> None:
    t = ProgressTracker()
    for i in range(5):
        assert t.observe(snap(running=0.0), float(i)) == 0.0
    # requests arrive between scrapes: the first busy scrape starts the count (they may
    # have just arrived), the next one without progress measures from it
    assert t.observe(snap(running=2.0), 5.0) == 0.0
    assert t.observe(snap(running=2.0), 6.0) == 1.0
    assert t.observe(snap(running=0.0), 7.0) == 0.0  # idle again: over
    assert t.observe(snap(running=1.0), 8.0) == 0.0
    assert t.observe(snap(running=1.0), 9.0) == 1.0


def test_a_restart_or_a_counter_going_back_starts_the_tracking_over() -> None:
    t = ProgressTracker()
    t.observe(snap(), 0.0)
    assert t.observe(snap(), 1.0) == 1.0
    # a new process (start time), counters not yet moved: not a stall
    assert t.observe(snap(start=2000.0), 2.0) == 0.0
    assert t.observe(snap(start=2000.0), 3.0) == 1.0
    # counters back to 0 with the same start time (an engine that does not export one, or a
    # restart within its resolution): reset, never a stall on the reset scrape
    assert t.observe(snap(prompt=0.0, gen=0.0, start=2000.0), 4.0) == 0.0
    assert t.observe(snap(prompt=0.0, gen=0.0, start=2000.0), 5.0) == 1.0
    assert t.observe(snap(prompt=0.0, gen=0.0, start=None), 6.0) == 2.0  # no start time
    t.reset()
    assert t.observe(snap(), 7.0) == 0.0


def test_an_engine_without_the_counters_is_never_stalled() -> None:
    t = ProgressTracker()
    for i in range(5):
        assert t.observe(snap(prompt=None, gen=None, running=4.0), float(i)) == 0.0
    # one counter is enough; a series appearing or vanishing starts the tracking over
    assert t.observe(snap(prompt=None, gen=5.0), 5.0) == 0.0
    assert t.observe(snap(prompt=None, gen=5.0), 6.0) == 1.0
    assert t.observe(snap(prompt=7.0, gen=5.0), 7.0) == 0.0
    assert t.observe(snap(prompt=None, gen=None), 8.0) == 0.0
    assert t.observe(snap(prompt=7.0, gen=5.0), 9.0) == 0.0


def test_parse_metrics_reads_the_token_counters() -> None:
    text = (
        "# TYPE vllm:prompt_tokens counter\n"
        'vllm:prompt_tokens_total{model_name="m"} 120.0\n'
        'vllm:prompt_tokens_created{model_name="m"} 1.7e9\n'
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{model_name="m"} 30.0\n'
        'vllm:generation_tokens_total{model_name="m2"} 5.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 2.0\n'
    )
    s = parse_metrics(text)
    assert (s.prompt_tokens, s.generation_tokens, s.running) == (120.0, 35.0, 2.0)
    bare = parse_metrics('vllm:num_requests_running{model_name="m"} 2.0\n')
    assert (bare.prompt_tokens, bare.generation_tokens) == (None, None)


def test_the_simulated_replicas_metrics_show_a_stall_and_its_end() -> None:
    """The replica's own exposition (its collector over a real engine): a request added
    and no step taken (a paused engine) is a stall; a step is progress."""
    core = EngineCore(EngineConfig(profile=FLAT, hash_seed=1), VOCAB)
    metrics = ReplicaMetrics("m", lambda: core, 1000.0)

    def scrape() -> EngineSnapshot:
        return parse_metrics(generate_latest(metrics.registry).decode())

    t = ProgressTracker()
    first = scrape()
    assert (first.prompt_tokens, first.generation_tokens) == (0.0, 0.0)
    assert t.observe(first, 0.0) == 0.0
    core.add_request(EngineRequest("a", list(range(200)), max_tokens=4), 0.0)
    assert t.observe(scrape(), 1.0) == 0.0  # busy from here
    assert t.observe(scrape(), 2.0) == 1.0  # no step: stalled
    assert t.observe(scrape(), 3.5) == 2.5
    core.step(3.6)
    after = scrape()
    assert after.prompt_tokens is not None and after.prompt_tokens > 0
    assert t.observe(after, 4.0) == 0.0
    # restarted (a new collector over a new engine, counters at 0, new start time)
    core2 = EngineCore(EngineConfig(profile=FLAT, hash_seed=1), VOCAB)
    core2.add_request(EngineRequest("b", list(range(50)), max_tokens=4), 4.5)
    metrics = ReplicaMetrics("m", lambda: core2, 2000.0)
    assert t.observe(scrape(), 5.0) == 0.0
    assert t.observe(scrape(), 6.0) == 1.0


async def test_the_load_link_publishes_the_stall_as_its_start() -> None:
    store = MemoryLoadStore()
    link = LoadLink(store, AgentSettings(replica_id="a", engine_url="http://x", events="tcp://x:1"))
    m = AgentMetrics()
    await link.publish("a", snap(running=2.0), m, 2.5)
    rec = (await store.snapshot(["a"], int(time.time() * 1000)))["a"]
    assert rec.stalled_ms == 2500 and rec.stalled_since_ms == rec.metrics_ts_ms - 2500
    await link.publish("a", snap(running=2.0), m)
    rec = (await store.snapshot(["a"], int(time.time() * 1000)))["a"]
    assert (rec.stalled_since_ms, rec.stalled_ms, rec.num_running) == (0, 0, 2)


# an SGLang engine's /metrics (names and labels of sglang/srt/metrics/collector.py): its
# token counters move only when a request finishes
SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} {running}
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 0.28
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{engine_type="unified",model_name="m",pp_rank="0",tp_rank="0"} 65536.0
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 8128902.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 7557572.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e9
"""


def test_parse_metrics_reads_sglang_load_but_not_its_token_counters() -> None:
    s = parse_metrics(SGLANG_PAGE.replace("{running}", "3.0"))
    assert (s.running, s.waiting, s.kv_usage) == (3.0, 2.0, 0.28)
    assert s.model_name == "m" and s.start_time == 1.7e9
    # SGLang exports its pool in tokens, not blocks
    assert s.block_size is None and s.num_gpu_blocks is None
    assert s.capacity_blocks(16) == 4096 and s.capacity_blocks(1) == 65536
    # counted at request end: not progress evidence, so not read
    assert (s.prompt_tokens, s.generation_tokens) == (None, None)


def test_an_sglang_engine_busy_for_long_is_never_called_stalled() -> None:
    t = ProgressTracker()
    page = SGLANG_PAGE.replace("{running}", "5.0")
    assert all(t.observe(parse_metrics(page), float(k)) == 0.0 for k in range(30))


def test_vllm_names_win_where_both_are_exported() -> None:
    both = SGLANG_PAGE.replace("{running}", "9.0") + (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 1.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 0.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    s = parse_metrics(both)
    assert (s.running, s.waiting, s.kv_usage) == (1.0, 0.0, 0.5)
    vllm_blocks = EngineSnapshot(num_gpu_blocks=777, max_total_tokens=65536)
    assert vllm_blocks.capacity_blocks(16) == 777


def _sglang_rank(dp: int, tp: int, running: float, pages: float) -> str:
    labels = f'dp_rank="{dp}",engine_type="unified",model_name="m",tp_rank="{tp}"'
    return (
        f"sglang:num_running_reqs{{{labels}}} {running}\n"
        f"sglang:num_queue_reqs{{{labels}}} 1.0\n"
        f"sglang:page_size{{{labels}}} 16.0\n"
        f"sglang:num_pages{{{labels}}} {pages}\n"
        f"sglang:max_total_num_tokens{{{labels}}} {pages * 16}\n"
    )


def test_sglang_ranks_count_once_per_data_parallel_rank() -> None:
    # every scheduler exporting (--enable-metrics-for-all-schedulers): two tensor-parallel
    # ranks of one batch and pool report the same values; two data-parallel ranks differ
    page = (
        "# TYPE sglang:num_running_reqs gauge\n# TYPE sglang:num_queue_reqs gauge\n"
        "# TYPE sglang:page_size gauge\n# TYPE sglang:num_pages gauge\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        + _sglang_rank(0, 0, 5.0, 1000.0)
        + _sglang_rank(0, 1, 5.0, 1000.0)
        + _sglang_rank(1, 0, 2.0, 1000.0)
        + _sglang_rank(1, 1, 2.0, 1000.0)
    )
    s = parse_metrics(page)
    assert (s.running, s.waiting) == (7.0, 2.0)
    # recent SGLang versions export the page size and count: no --block-size needed
    assert (s.block_size, s.num_gpu_blocks) == (16, 2000)
    assert s.capacity_blocks(16) == 2000 and s.max_total_tokens == 32000


def test_a_non_finite_gauge_is_skipped_not_fatal() -> None:
    page = SGLANG_PAGE.replace("{running}", "3.0").replace("} 65536.0", "} +Inf")
    assert "+Inf" in page
    s = parse_metrics(page)
    assert s.running == 3.0 and s.max_total_tokens is None
    nan_running = 'vllm:num_requests_running{model_name="m"} NaN\n'
    assert parse_metrics(nan_running).running == 0.0


def test_each_load_series_falls_back_to_sglang_on_its_own() -> None:
    # a page with vLLM's waiting count only: running comes from SGLang's gauge
    page = SGLANG_PAGE.replace("{running}", "7.0") + (
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 4.0\n'
    )
    s = parse_metrics(page)
    assert (s.running, s.waiting) == (7.0, 4.0)


def test_a_wedged_core_of_a_data_parallel_engine_is_a_stall_beside_working_ones() -> None:
    """vLLM with data parallelism in one server exports each series once per engine core
    (label ``engine``): the sums move while core 1 is wedged, so each core is judged apart
    and the engine's stall is its most stalled core's."""

    def exposition(gen0: float, gen1: float, busy1: float) -> str:
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            f'vllm:num_requests_running{{engine="1",model_name="m"}} {busy1}\n'
            "# TYPE vllm:generation_tokens counter\n"
            f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen0}\n'
            f'vllm:generation_tokens_total{{engine="1",model_name="m"}} {gen1}\n'
            "# TYPE vllm:prompt_tokens counter\n"
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 500.0\n'
            'vllm:prompt_tokens_total{engine="1",model_name="m"} 300.0\n'
            "# TYPE process_start_time_seconds gauge\n"
            "process_start_time_seconds 1000.0\n"
        )

    first = parse_metrics(exposition(10.0, 20.0, 1.0))
    assert (first.running, first.generation_tokens, first.prompt_tokens) == (3.0, 30.0, 800.0)
    assert first.engines["1"] == EngineCounters(1.0, 300.0, 20.0, running=1.0)
    t = ProgressTracker()
    assert t.observe(first, 0.0) == 0.0
    assert t.observe(parse_metrics(exposition(15.0, 25.0, 1.0)), 1.0) == 0.0  # both move
    # core 1 keeps its request and stops after the scrape at 1.0; core 0 goes on, so the
    # sums still grow (the old summed tracker read no stall at all)
    assert t.observe(parse_metrics(exposition(20.0, 25.0, 1.0)), 2.0) == 1.0
    assert t.observe(parse_metrics(exposition(25.0, 25.0, 1.0)), 3.0) == 2.0
    assert t.observe(parse_metrics(exposition(30.0, 25.0, 1.0)), 4.5) == 3.5
    # core 1 idle: nothing to progress on, no stall
    assert t.observe(parse_metrics(exposition(35.0, 25.0, 0.0)), 5.0) == 0.0
    # an unlabelled exposition (one core) is the engine judged on its totals, as before
    single = parse_metrics('vllm:generation_tokens_total{model_name="m"} 1.0\n')
    assert single.engines == {}


def test_a_page_with_vllm_counters_and_sglang_busy_gauges_is_judged_on_its_totals() -> None:
    """vLLM's counters beside SGLang's running gauge (an engine exporting both): busy comes
    from the totals, so a stall still shows (per-core judging read it as idle)."""
    page = (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{model_name="m"} 10.0\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="m"} 2.0\n'
    )
    t = ProgressTracker()
    assert [t.observe(parse_metrics(page), float(i)) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
