"""Engine scraping: vLLM's Prometheus ``/metrics`` (facts §3) and ``/v1/models``.

SGLang's load gauges are read too (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage``), and its pool (``sglang:page_size`` and ``sglang:num_pages`` where
the version exports them, else the labels of ``sglang:cache_config_info{page_size,
num_pages}``, which SGLang exports since February 2026 (its PR 17273), else
``sglang:max_total_num_tokens`` in whole blocks), so an SGLang replica's agent publishes its
load. Every scheduler may export them
(``--enable-metrics-for-all-schedulers``): tensor-parallel ranks report the same batch and
pool, so a series counts once per ``dp_rank`` (the largest of its ranks) and is summed over
data-parallel ranks. Its token counters are deliberately not read: SGLang adds a request's
prompt and generated tokens to ``sglang:prompt_tokens_total`` and
``sglang:generation_tokens_total`` only when the request finishes
(``TokenizerMetricsCollector.observe_one_finished_request``), so an engine busy with long
generations would look stalled to D17's progress tracker. An SGLang that exports no page
size needs ``--block-size`` on its agent (the engine's ``--page-size``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachecore.httpread import AnswerTimeout, AnswerTooLarge, read_answer

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM v0 name, still seen in the wild
CACHE_CONFIG = "vllm:cache_config_info"
START_TIME = "process_start_time_seconds"
# monotonic work counters (prometheus_client's parser names a counter's sample ``..._total``):
# an engine with requests whose counters stand still is stalled (cachecore.agent.progress)
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
# prompt tokens looked up in the prefix cache at admission, and those it served: their
# difference is the prompt tokens the engine computed (and stored in new blocks), which
# tells an engine serving without publishing KV events from an idle one (silence.py)
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
FINISHED = "vllm:request_success_total"  # finished requests (summed over finished_reason)
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"  # fraction of the KV pool's tokens in use, 0..1
SGLANG_MAX_TOKENS = "sglang:max_total_num_tokens"  # the KV pool's size in tokens
SGLANG_PAGE_SIZE = "sglang:page_size"  # tokens per KV page (recent versions)
SGLANG_NUM_PAGES = "sglang:num_pages"
# an info-style gauge whose labels say the page size and the page count (no rank label:
# ranks with equal pools export one sample, so its count is one rank's)
SGLANG_CACHE_CONFIG = "sglang:cache_config_info"
_SGLANG_PER_RANK = (
    SGLANG_RUNNING,
    SGLANG_WAITING,
    SGLANG_MAX_TOKENS,
    SGLANG_PAGE_SIZE,
    SGLANG_NUM_PAGES,
)
MAX_METRICS_BYTES = 8 * 1024 * 1024
MAX_SMALL_BYTES = 1024 * 1024  # /health, /v1/models


class ScrapeError(RuntimeError):
    """The engine did not answer, or answered something that is not its metrics."""


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One engine core's share of a vLLM ``/metrics``: a data-parallel server exports every
    series once per core (label ``engine``), and D17 judges each core's progress apart (a
    wedged core beside working ones would not show in the sums)."""

    busy: float = 0.0  # running + waiting
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None  # the core's own KV pool use (vLLM labels it per engine)
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    finished: float | None = None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What one scrape of the engine's ``/metrics`` says."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    start_time: float | None = None
    model_name: str | None = None
    # None when the engine does not export the series
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    # the KV pool in tokens, for engines that do not export their block count (SGLang)
    max_total_tokens: int | None = None
    # vLLM's prefix-cache lookups and hits (tokens) and finished requests; None when absent
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    finished: float | None = None
    # vLLM's busy gauges and token counters by ``engine`` label, for a data-parallel server
    # (several cores); empty otherwise, when the totals above are judged
    engines: Mapping[str, EngineCounters] = field(default_factory=dict)
    # SGLang's queues by ``dp_rank`` label, for a server with several data-parallel ranks
    # (only for :meth:`for_core`: SGLang exports no token counters to judge progress by)
    dp_ranks: Mapping[str, EngineCounters] = field(default_factory=dict)
    # whether the engine exports its request gauges (vLLM's or SGLang's running or waiting):
    # a vLLM started with --disable-log-stats has none, and its 0 running and 0 waiting
    # above were never measured
    busy_reported: bool = True

    def for_core(self, rank: int | None) -> EngineSnapshot:
        """This snapshot as one data-parallel rank's engine core sees it: its own queues and
        token counters (vLLM's ``engine`` label, SGLang's ``dp_rank``, is the rank), the
        pool-wide figures kept.
        Unchanged when ``rank`` is None or the server exports no such core."""
        if rank is None:
            return self
        core = self.engines.get(str(rank)) or self.dp_ranks.get(str(rank))
        if core is None:
            return self
        return replace(
            self,
            running=core.running,
            waiting=core.waiting,
            kv_usage=self.kv_usage if core.kv_usage is None else core.kv_usage,
            prompt_tokens=core.prompt_tokens,
            generation_tokens=core.generation_tokens,
            prefix_queries=core.prefix_queries,
            prefix_hits=core.prefix_hits,
            finished=core.finished,
            engines={},
            dp_ranks={},
        )

    def capacity_blocks(self, block_size: int) -> int | None:
        """The KV pool in blocks of ``block_size``: the engine's own count if it exports
        one, else its token capacity in whole blocks."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        if self.max_total_tokens is not None and block_size > 0:
            return self.max_total_tokens // block_size
        return None


def _as_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(float(text))
    except (ValueError, OverflowError):  # not a number; "inf" (int() of it overflows)
        return None


def parse_metrics(text: str) -> EngineSnapshot:
    """Read the few series a router needs; every metric is summed over its ``model_name``
    labels (one engine serves one model, but be tolerant). vLLM's names win where an
    engine exports both (a vLLM behind an SGLang-compatible shim, or the other way round
    would otherwise count its requests twice)."""
    running = waiting = 0.0
    kv_usage: float | None = None
    kv_usage_old: float | None = None
    block_size = num_blocks = None
    start: float | None = None
    model: str | None = None
    prompt: float | None = None
    generation: float | None = None
    queries: float | None = None
    hits: float | None = None
    finished: float | None = None
    sgl_usage: float | None = None
    sgl_info_bs = sgl_info_pages = None
    # SGLang series by dp_rank: the largest value its (tensor-parallel) ranks report
    sgl: dict[str, dict[str, float]] = {}
    vllm_running = vllm_waiting = False
    # per engine core: [busy, prompt tokens, generation tokens, running, waiting, KV usage,
    # prefix-cache queries, prefix-cache hits, finished requests]
    cores: dict[str, list[float | None]] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise ScrapeError(f"unparseable metrics: {exc}") from exc
    for fam in families:
        for s in fam.samples:
            value = float(s.value)
            if not math.isfinite(value):  # NaN, or an infinity no gauge here can mean
                continue
            name = s.name
            if name == RUNNING:
                running += value
                vllm_running = True
                _add(cores, s.labels, 0, value)
                _add(cores, s.labels, 3, value)
            elif name == WAITING:
                waiting += value
                vllm_waiting = True
                _add(cores, s.labels, 0, value)
                _add(cores, s.labels, 4, value)
            elif name == KV_USAGE:
                kv_usage = max(kv_usage or 0.0, value)
                _max(cores, s.labels, 5, value)
            elif name == KV_USAGE_OLD:
                kv_usage_old = max(kv_usage_old or 0.0, value)
                _max(cores, s.labels, 5, value)
            elif name == CACHE_CONFIG:
                block_size = _as_int(s.labels.get("block_size")) or block_size
                num_blocks = _as_int(s.labels.get("num_gpu_blocks")) or num_blocks
            elif name == START_TIME:
                start = value
            elif name == PROMPT_TOKENS:
                prompt = (prompt or 0.0) + value
                _add(cores, s.labels, 1, value)
            elif name == GENERATION_TOKENS:
                generation = (generation or 0.0) + value
                _add(cores, s.labels, 2, value)
            elif name == PREFIX_QUERIES:
                queries = (queries or 0.0) + value
                _add(cores, s.labels, 6, value)
            elif name == PREFIX_HITS:
                hits = (hits or 0.0) + value
                _add(cores, s.labels, 7, value)
            elif name == FINISHED:
                finished = (finished or 0.0) + value
                _add(cores, s.labels, 8, value)
            elif name in _SGLANG_PER_RANK:
                ranks = sgl.setdefault(name, {})
                rank = s.labels.get("dp_rank", "")
                ranks[rank] = max(ranks.get(rank, value), value)
            elif name == SGLANG_KV_USAGE:
                sgl_usage = max(sgl_usage or 0.0, value)
            elif name == SGLANG_CACHE_CONFIG:
                page = _as_int(s.labels.get("page_size"))
                pages = _as_int(s.labels.get("num_pages"))
                if page is not None and page > 0:
                    sgl_info_bs = max(sgl_info_bs or 0, page)
                if pages is not None and pages > 0:
                    sgl_info_pages = max(sgl_info_pages or 0, pages)
            else:
                continue
            model = model or s.labels.get("model_name")
    usage = kv_usage if kv_usage is not None else kv_usage_old
    # vLLM's series first, each on its own (an engine exporting both is counted once)
    if not vllm_running and SGLANG_RUNNING in sgl:
        running = sum(sgl[SGLANG_RUNNING].values())
    if not vllm_waiting and SGLANG_WAITING in sgl:
        waiting = sum(sgl[SGLANG_WAITING].values())
    if usage is None:
        usage = sgl_usage
    if block_size is None and SGLANG_PAGE_SIZE in sgl:
        block_size = int(max(sgl[SGLANG_PAGE_SIZE].values())) or None
    if num_blocks is None and SGLANG_NUM_PAGES in sgl:
        num_blocks = int(sum(sgl[SGLANG_NUM_PAGES].values())) or None
    if block_size is None:
        block_size = sgl_info_bs
    if num_blocks is None:
        num_blocks = sgl_info_pages
    max_tokens = sgl.get(SGLANG_MAX_TOKENS)
    return EngineSnapshot(
        running,
        waiting,
        usage or 0.0,
        block_size,
        num_blocks,
        start,
        model,
        prompt,
        generation,
        int(sum(max_tokens.values())) if max_tokens else None,
        queries,
        hits,
        finished,
        # per core only where vLLM says which core is busy: one core (or busy gauges from
        # SGLang's names) is judged on the totals, as it always was
        {
            k: EngineCounters(
                v[0] or 0.0, v[1], v[2], v[3] or 0.0, v[4] or 0.0, v[5], v[6], v[7], v[8]
            )
            for k, v in cores.items()
        }
        if len(cores) > 1 and (vllm_running or vllm_waiting)
        else {},
        _sglang_ranks(sgl) if not (vllm_running or vllm_waiting) else {},
        busy_reported=(
            vllm_running or vllm_waiting or SGLANG_RUNNING in sgl or SGLANG_WAITING in sgl
        ),
    )


def _sglang_ranks(sgl: Mapping[str, Mapping[str, float]]) -> dict[str, EngineCounters]:
    """SGLang's running and queued requests per ``dp_rank``, when it labels several."""
    run, wait = sgl.get(SGLANG_RUNNING, {}), sgl.get(SGLANG_WAITING, {})
    ranks = (run.keys() | wait.keys()) - {""}
    if len(ranks) < 2:
        return {}
    return {
        r: EngineCounters(
            run.get(r, 0.0) + wait.get(r, 0.0), running=run.get(r, 0.0), waiting=wait.get(r, 0.0)
        )
        for r in ranks
    }


def _core(cores: dict[str, list[float | None]], labels: Mapping[str, str]) -> list[float | None]:
    """The fields of the sample's engine core (label ``engine``)."""
    name = labels.get("engine", "")
    core = cores.get(name)
    if core is None:
        core = cores[name] = [None] * 9
    return core


def _add(cores: dict[str, list[float | None]], labels: Mapping[str, str], i: int, v: float) -> None:
    """Add ``v`` to field ``i`` of the sample's engine core (summed over its other labels)."""
    core = _core(cores, labels)
    core[i] = (core[i] or 0.0) + v


def _max(cores: dict[str, list[float | None]], labels: Mapping[str, str], i: int, v: float) -> None:
    """Field ``i`` of the sample's engine core is the largest value seen (a fraction)."""
    core = _core(cores, labels)
    core[i] = max(core[i] or 0.0, v)


class EngineScraper:
    """HTTP access to one engine. ``timeout_s`` bounds every call as a whole: an engine that
    hangs is as unavailable as one that refuses. httpx's own timeout bounds each read, so
    an answer dribbled a few bytes a second held a call (and the event stream waiting on
    its restart check) for as long as it dribbled."""

    def __init__(self, engine_url: str, timeout_s: float = 2.0) -> None:
        self.engine_url = engine_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def _get(self, path: str, max_bytes: int) -> tuple[int, bytes]:
        """GET ``path``: its status and body (unread unless 200), within ``timeout_s``; a
        body over ``max_bytes`` is refused as it arrives, never held whole."""
        try:
            r = await read_answer(
                self._client,
                "GET",
                f"{self.engine_url}{path}",
                timeout_s=self.timeout_s,
                deadline_s=self.timeout_s,
                cap=max_bytes,
                read_unless_ok=False,
            )
        except AnswerTooLarge as exc:
            raise ScrapeError(f"{path} larger than {max_bytes} bytes") from exc
        except AnswerTimeout as exc:
            raise ScrapeError(f"{path} took over {self.timeout_s} s") from exc
        except httpx.HTTPError as exc:
            raise ScrapeError(f"{type(exc).__name__}: {exc}") from exc
        return r.status_code, r.content

    async def metrics(self) -> EngineSnapshot:
        status, body = await self._get("/metrics", MAX_METRICS_BYTES)
        if status != 200:
            raise ScrapeError(f"/metrics answered {status}")
        return parse_metrics(body.decode(errors="replace"))

    async def healthy(self) -> bool:
        """``/health`` answers 200 within the timeout: tells an engine whose metrics fail
        (slow, broken) from one that is gone or sick."""
        try:
            status, _ = await self._get("/health", MAX_SMALL_BYTES)
        except ScrapeError:
            return False
        return status == 200

    async def model(self) -> str | None:
        """The first model id of ``/v1/models`` (None when the engine does not say)."""
        try:
            status, raw = await self._get("/v1/models", MAX_SMALL_BYTES)
            body = json.loads(raw) if status == 200 else None
        except (ScrapeError, ValueError):
            return None
        if isinstance(body, dict):
            data = body.get("data")
            if isinstance(data, list) and data and isinstance(data[0], dict):
                mid = data[0].get("id")
                if isinstance(mid, str) and mid:
                    return mid
        return None

    async def close(self) -> None:
        await self._client.aclose()
