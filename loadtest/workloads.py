"""Workloads: trace replays and synthesizers, shared by the demo, Locust, the router benchmark
and the virtual-time simulator.

Every prompt is built from the tokenizer's :class:`~cachecore.tokenizer.WordVocabulary`
(one token per word), so token counts are exact and content is deterministic: the same
seed, or the same Mooncake hash id, always gives the same text. A Mooncake hash id names
one 512-token block *including all blocks before it*, so equal ids at equal positions mean
a reusable prefix; we give every hash id its own deterministic 512-token text.

Workloads (``WORKLOADS``):

* ``shared-prefix``: SGLang's generated-shared-prefix defaults (64 groups x 16 prompts,
  2,048-token system prompt, 128-token question, 256-token output), Poisson arrivals;
* ``multi-turn``: chat sessions whose every turn resends the whole history;
* ``rag``: questions over a pool of shared documents (a few documents per prompt);
* ``mooncake``: the Mooncake JSONL trace (``../shared/traces``), completions API;
* ``azure-conv`` / ``azure-code``: Azure 2023 arrivals and lengths, no sharing;
* boundary cases: ``short-unique`` (short, non-repeating), ``hot-prefix`` (one prefix carries
  50% of the traffic), ``long-prefix-pressure`` (long shared prefixes that overflow one
  replica's cache), ``tenant-mix`` (several tenants, some sending identical prompts).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TextIO

import xxhash

from cachecore.tokenizer import WordVocabulary, builtin_tokenizer
from gateway.cli import CommandError

Api = Literal["chat", "completions"]
MOONCAKE_BLOCK_TOKENS = 512


def trace_dir() -> Path:
    """Where the trace files are: ``KVGATE_TRACE_DIR``, else ``../shared/traces`` beside the
    checkout (read at each call, so a test or a caller can point it elsewhere)."""
    env = os.environ.get("KVGATE_TRACE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "traces"


class TraceError(CommandError, ValueError):
    """A trace file that is missing, empty or malformed; the message names the file (and the
    line) so ``kvgate`` can print it as one line."""


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload. ``t`` is the arrival offset in trace seconds."""

    t: float
    api: Api
    max_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    tenant: str = "default"
    session: str | None = None
    group: str | None = None  # prefix group, for per-group analysis
    sensitive: str | None = None  # "session" | "request" for sensitive requests

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        """The OpenAI request body. Streamed requests ask for the final usage chunk so the
        engine-reported cached tokens come back."""
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens}
        if self.api == "chat":
            body["messages"] = list(self.messages or ())
        else:
            body["prompt"] = self.prompt or ""
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    items: tuple[WorkItem, ...]
    description: str = ""
    tenants: tuple[str, ...] = ("default",)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.items[-1].t if self.items else 0.0

    def rate_scaled(self, factor: float) -> Workload:
        """Arrivals ``factor`` times denser (factor 2: twice the request rate)."""
        items = tuple(replace(it, t=it.t / factor) for it in self.items)
        return replace(self, items=items)

    def at_rate(self, rate: float) -> Workload:
        """Arrivals shifted to start at 0 and rescaled so the mean rate is ``rate`` req/s
        (the order and the shape of the gaps kept)."""
        if len(self.items) < 2:
            return self
        t0 = self.items[0].t
        span = (self.items[-1].t - t0) or 1.0
        factor = rate / (len(self.items) / span)  # > 1: denser
        items = tuple(replace(it, t=(it.t - t0) / factor) for it in self.items)
        return replace(self, items=items)

    def head(self, n: int) -> Workload:
        """The first ``n`` items (a negative ``n`` would slice from the end: refused)."""
        if n < 0:
            raise ValueError(f"head({n}): n must be >= 0")
        return replace(self, items=self.items[:n])

    def sample_groups(self, n: int, seed: int) -> Workload:
        """About ``n`` items taken a whole prefix group at a time, in trace order.

        Groups are visited in an order fixed by ``seed`` (xxh64 of the group name) and each
        is taken with all its items until ``n`` are reached; the last group keeps only its
        earliest items. Sampling rows instead would keep a pair of rows of one group with
        probability (n/N)^2 and so remove the trace's reuse; sampling groups keeps it, and
        keeps every kept request's arrival order and gaps. An item without a group is a
        group of its own."""
        members: dict[str, list[int]] = {}
        for i, it in enumerate(self.items):
            members.setdefault(it.group if it.group is not None else f"#{i}", []).append(i)
        order = sorted(members, key=lambda g: xxhash.xxh64_intdigest(g.encode(), seed))
        chosen: list[int] = []
        for g in order:
            if len(chosen) >= n:
                break
            chosen += members[g][: n - len(chosen)]
        items = tuple(self.items[i] for i in sorted(chosen))
        return replace(
            self,
            items=items,
            description=f"{self.description}; {len(items)} items, whole prefix groups",
        )


class TextSource:
    """Deterministic word text: ``block(name, n)`` always returns the same n tokens."""

    def __init__(self, vocab: WordVocabulary | None = None, cache_blocks: int = 4096) -> None:
        self.vocab = vocab or builtin_tokenizer().word_vocabulary
        # shared prefixes are asked for again and again: keep the recent ones
        self._cache: OrderedDict[tuple[str, int], str] = OrderedDict()
        self._cache_blocks = cache_blocks

    def once(self, name: str, n_tokens: int) -> str:
        """``block(name, n_tokens)``'s text, left out of the cache: for a block the caller
        asks for once (a request's own question), so it does not push the shared prefixes
        out (the shared-prefix workload at 256 replicas drew each system prompt ~10 times
        over)."""
        hit = self._cache.get((name, n_tokens))
        if hit is not None:
            return hit
        return self.vocab.text(n_tokens, random.Random(xxhash.xxh64_intdigest(name.encode())))

    def block(self, name: str, n_tokens: int) -> str:
        key = (name, n_tokens)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        rng = random.Random(xxhash.xxh64_intdigest(name.encode()))
        out = self.vocab.text(n_tokens, rng)
        self._cache[key] = out
        if len(self._cache) > self._cache_blocks:
            self._cache.popitem(last=False)
        return out


def _poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _sorted(items: Iterable[WorkItem]) -> tuple[WorkItem, ...]:
    return tuple(sorted(items, key=lambda it: it.t))


# ------------------------------------------------------------------------ synthesizers


def shared_prefix(
    text: TextSource,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    rate: float = 4.0,
    seed: int = 0,
    tenant: str = "default",
) -> Workload:
    rng = random.Random(seed)
    pairs = [(g, q) for g in range(groups) for q in range(prompts_per_group)]
    rng.shuffle(pairs)
    times = _poisson_times(len(pairs), rate, rng)
    items = []
    for t, (g, q) in zip(times, pairs, strict=True):
        system = text.block(f"sp-{seed}-sys-{g}", system_tokens)
        question = text.once(f"sp-{seed}-q-{g}-{q}", question_tokens)
        items.append(
            WorkItem(
                t=t,
                api="chat",
                max_tokens=output_tokens,
                messages=(
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ),
                tenant=tenant,
                group=f"sys-{g}",
            )
        )
    return Workload(
        "shared-prefix",
        _sorted(items),
        f"{groups} groups x {prompts_per_group} prompts, {system_tokens}-token system prompt, "
        f"{question_tokens}-token question, {output_tokens} output, Poisson {rate}/s",
        (tenant,),
    )


def multi_turn(
    text: TextSource,
    sessions: int = 32,
    turns: int = 6,
    system_tokens: int = 512,
    user_tokens: int = 96,
    assistant_tokens: int = 64,
    output_tokens: int = 64,
    think_time_s: float = 6.0,
    rate: float = 2.0,
    seed: int = 0,
) -> Workload:
    """Sessions start as a Poisson process; turn k+1 follows turn k after ~think_time and
    resends the whole history (the assistant turns are the client's canonical transcript)."""
    rng = random.Random(seed)
    starts = _poisson_times(sessions, rate / turns, rng)
    items = []
    for s, t0 in enumerate(starts):
        history: list[dict[str, str]] = [
            {"role": "system", "content": text.block(f"mt-{seed}-sys-{s % 4}", system_tokens)}
        ]
        t = t0
        for k in range(turns):
            history.append(
                {"role": "user", "content": text.block(f"mt-{seed}-u-{s}-{k}", user_tokens)}
            )
            items.append(
                WorkItem(
                    t=t,
                    api="chat",
                    max_tokens=output_tokens,
                    messages=tuple(history),
                    session=f"s{seed}-{s}",
                    group=f"session-{s}",
                )
            )
            history.append(
                {
                    "role": "assistant",
                    "content": text.block(f"mt-{seed}-a-{s}-{k}", assistant_tokens),
                }
            )
            t += rng.expovariate(1.0 / think_time_s)
    return Workload(
        "multi-turn",
        _sorted(items),
        f"{sessions} sessions x {turns} turns, {system_tokens}-token system prompt, "
        f"{user_tokens}+{assistant_tokens} tokens per turn",
    )


def rag(
    text: TextSource,
    n: int = 600,
    documents: int = 40,
    doc_tokens: int = 1024,
    docs_per_prompt: int = 2,
    question_tokens: int = 64,
    output_tokens: int = 64,
    zipf_s: float = 1.1,
    rate: float = 4.0,
    seed: int = 0,
) -> Workload:
    """Prompts = a fixed instruction + a few documents (Zipf-popular) + a question."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(documents)]
    times = _poisson_times(n, rate, rng)
    instruction = text.block(f"rag-{seed}-instr", 128)
    items = []
    for i, t in enumerate(times):
        docs = sorted(set(rng.choices(range(documents), weights, k=docs_per_prompt)))
        context = "".join(text.block(f"rag-{seed}-doc-{d}", doc_tokens) for d in docs)
        items.append(
            WorkItem(
                t=t,
                api="chat",
                max_tokens=output_tokens,
                messages=(
                    {"role": "system", "content": instruction + context},
                    {"role": "user", "content": text.once(f"rag-{seed}-q-{i}", question_tokens)},
                ),
                group="docs-" + "-".join(map(str, docs)),
            )
        )
    return Workload("rag", _sorted(items), f"{n} questions over {documents} shared documents")


def short_unique(
    text: TextSource,
    n: int = 800,
    min_tokens: int = 32,
    max_tokens_in: int = 256,
    output_tokens: int = 32,
    rate: float = 8.0,
    seed: int = 0,
) -> Workload:
    """The boundary case that must not get worse: short prompts that never repeat."""
    rng = random.Random(seed)
    times = _poisson_times(n, rate, rng)
    items = [
        WorkItem(
            t=t,
            api="completions",
            max_tokens=output_tokens,
            prompt=text.once(f"su-{seed}-{i}", rng.randint(min_tokens, max_tokens_in)),
            group="unique",
        )
        for i, t in enumerate(times)
    ]
    return Workload(
        "short-unique", _sorted(items), f"{n} unique prompts of {min_tokens}-{max_tokens_in} tokens"
    )


def hot_prefix(
    text: TextSource,
    n: int = 800,
    hot_fraction: float = 0.5,
    prefix_tokens: int = 2048,
    cold_groups: int = 64,
    suffix_tokens: int = 96,
    output_tokens: int = 64,
    rate: float = 6.0,
    seed: int = 0,
) -> Workload:
    """One prefix carries ``hot_fraction`` of the traffic; the rest spreads over many
    groups. Pure affinity melts the hot replica; the target is p99 <= least_loaded's."""
    rng = random.Random(seed)
    times = _poisson_times(n, rate, rng)
    items = []
    for i, t in enumerate(times):
        g = "hot" if rng.random() < hot_fraction else f"cold-{rng.randrange(cold_groups)}"
        items.append(
            WorkItem(
                t=t,
                api="chat",
                max_tokens=output_tokens,
                messages=(
                    {"role": "system", "content": text.block(f"hp-{seed}-{g}", prefix_tokens)},
                    {"role": "user", "content": text.once(f"hp-{seed}-q-{i}", suffix_tokens)},
                ),
                group=g,
            )
        )
    return Workload(
        "hot-prefix",
        _sorted(items),
        f"{hot_fraction:.0%} of {n} requests share one {prefix_tokens}-token prefix",
    )


def long_prefix_pressure(
    text: TextSource,
    n: int = 400,
    groups: int = 24,
    prefix_tokens: int = 8192,
    suffix_tokens: int = 128,
    output_tokens: int = 32,
    zipf_s: float = 0.8,
    rate: float = 1.5,
    seed: int = 0,
) -> Workload:
    """Long shared prefixes whose total size overflows a replica's cache: where a prefix
    lives decides whether it survives (partitioning prefixes across replicas pays)."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(groups)]
    times = _poisson_times(n, rate, rng)
    items = []
    for i, t in enumerate(times):
        g = rng.choices(range(groups), weights)[0]
        items.append(
            WorkItem(
                t=t,
                api="completions",
                max_tokens=output_tokens,
                prompt=text.block(f"lp-{seed}-{g}", prefix_tokens)
                + text.once(f"lp-{seed}-q-{i}", suffix_tokens),
                group=f"doc-{g}",
            )
        )
    return Workload(
        "long-prefix-pressure",
        _sorted(items),
        f"{groups} prefixes of {prefix_tokens} tokens, Zipf({zipf_s})",
    )


def tenant_mix(
    text: TextSource,
    n: int = 800,
    tenants: Sequence[str] = ("acme", "globex", "initech", "umbrella"),
    shared_prompt_fraction: float = 0.3,
    prefix_tokens: int = 1536,
    suffix_tokens: int = 96,
    output_tokens: int = 48,
    rate: float = 6.0,
    seed: int = 0,
) -> Workload:
    """Several tenants with their own system prompts; ``shared_prompt_fraction`` of the
    requests use a system prompt that every tenant sends verbatim (it must NOT be shared
    across tenants: each tenant computes its own copy)."""
    rng = random.Random(seed)
    times = _poisson_times(n, rate, rng)
    items = []
    for i, t in enumerate(times):
        tenant = tenants[rng.randrange(len(tenants))]
        shared = rng.random() < shared_prompt_fraction
        key = "common" if shared else f"{tenant}-{rng.randrange(4)}"
        items.append(
            WorkItem(
                t=t,
                api="chat",
                max_tokens=output_tokens,
                messages=(
                    {"role": "system", "content": text.block(f"tm-{seed}-{key}", prefix_tokens)},
                    {"role": "user", "content": text.once(f"tm-{seed}-q-{i}", suffix_tokens)},
                ),
                tenant=tenant,
                group=f"{tenant}:{key}",
            )
        )
    return Workload(
        "tenant-mix",
        _sorted(items),
        f"{len(tenants)} tenants, {shared_prompt_fraction:.0%} identical prompts across tenants",
        tuple(tenants),
    )


def cache_flood(
    text: TextSource,
    duration_s: float = 3.0,
    victims: Sequence[str] = ("acme", "globex"),
    prefixes_per_tenant: int = 3,
    prefix_tokens: int = 512,
    question_tokens: int = 32,
    victim_rate: float = 12.0,
    flood_tenant: str = "mallory",
    flood_rate: float = 40.0,
    flood_tokens: int = 1024,
    flood: bool = True,
    output_tokens: int = 1,
    seed: int = 0,
) -> Workload:
    """Victim tenants reuse a few system prompts each (Poisson ``victim_rate``); with
    ``flood`` one tenant sends unique ``flood_tokens``-token prompts at ``flood_rate``, the
    cache-flushing attack (``kvgate attack``). Victim items have ``group`` = their prefix,
    flood items ``group="flood"``. ``meta["warmup"]`` lists one request per victim prefix
    (send them first, unmeasured, so the measured hit rate is one of retention)."""
    rng = random.Random(seed)
    prefixes = [(v, p) for v in victims for p in range(prefixes_per_tenant)]

    def system(v: str, p: int) -> str:
        return text.block(f"cf-{seed}-{v}-{p}", prefix_tokens)

    def victim_item(t: float, i: int, v: str, p: int) -> WorkItem:
        return WorkItem(
            t=t,
            api="chat",
            max_tokens=output_tokens,
            messages=(
                {"role": "system", "content": system(v, p)},
                {"role": "user", "content": text.once(f"cf-{seed}-q-{i}", question_tokens)},
            ),
            tenant=v,
            group=f"{v}:{p}",
        )

    n_victim = max(1, round(duration_s * victim_rate))
    items = [
        victim_item(t, i, *prefixes[rng.randrange(len(prefixes))])
        for i, t in enumerate(_poisson_times(n_victim, victim_rate, rng))
    ]
    if flood:
        n_flood = max(1, round(duration_s * flood_rate))
        for j, t in enumerate(_poisson_times(n_flood, flood_rate, rng)):
            items.append(
                WorkItem(
                    t=t,
                    api="completions",
                    max_tokens=output_tokens,
                    prompt=text.once(f"cf-{seed}-flood-{j}", flood_tokens),
                    tenant=flood_tenant,
                    group="flood",
                )
            )
    warmup = tuple(victim_item(0.0, -1 - k, v, p) for k, (v, p) in enumerate(prefixes))
    tenants = (*victims, flood_tenant) if flood else tuple(victims)
    return Workload(
        "cache-flood",
        _sorted(items),
        f"{len(victims)} victim tenants x {prefixes_per_tenant} prefixes at {victim_rate}/s"
        + (
            f", {flood_tenant} floods {flood_tokens}-token unique prompts at {flood_rate}/s"
            if flood
            else ", no flood"
        ),
        tenants,
        {"warmup": warmup},
    )


# ------------------------------------------------------------------------------ traces


def _open_trace(path: Path) -> TextIO:
    try:
        # undecodable bytes become U+FFFD: the row that holds them then fails its parse
        # with the file and line named (a UnicodeDecodeError named neither)
        return path.open(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise TraceError(
            f"cannot read trace {path}: {exc.strerror or exc} (KVGATE_TRACE_DIR sets the "
            "directory of the trace files)"
        ) from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mooncake_row(row: Any) -> tuple[int, int, float, list[int]]:
    """(input tokens, output tokens, arrival s, hash ids) of one Mooncake row, checked: a
    NaN or infinite timestamp hung the simulator's clock, and an empty or too short
    ``hash_ids`` (or a string, taken as a list of characters) made prompts shorter than
    ``input_length``, down to empty ones the engine refused. Raises KeyError, TypeError or
    ValueError."""
    if not isinstance(row, dict):
        raise TypeError(f"a row is a JSON object, got {type(row).__name__}")
    n_in, hash_ids = row["input_length"], row["hash_ids"]
    out, ts = row["output_length"], row["timestamp"]
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"input_length must be an integer >= 1, got {n_in!r}")
    if not _is_int(out):
        raise ValueError(f"output_length must be an integer, got {out!r}")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise ValueError(f"timestamp must be a finite number (ms), got {ts!r}")
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        raise ValueError("hash_ids must be a list of integers")
    need = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) < need:
        raise ValueError(
            f"{len(hash_ids)} hash_ids cover {len(hash_ids) * MOONCAKE_BLOCK_TOKENS} tokens, "
            f"input_length is {n_in} (one id per {MOONCAKE_BLOCK_TOKENS}-token block)"
        )
    return n_in, max(1, out), float(ts) / 1000.0, hash_ids


def mooncake(
    text: TextSource,
    path: Path | None = None,
    max_requests: int | None = None,
    max_input_tokens: int | None = None,
    output_cap: int | None = None,
) -> Workload:
    """Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``.
    Each hash id becomes a deterministic 512-token block; the prompt is the concatenation
    truncated to ``input_length`` (the last block is partial)."""
    path = path or trace_dir() / "mooncake_synthetic_trace.jsonl"
    rows: list[tuple[float, int, int, list[int]]] = []  # t, prompt tokens, output, hash ids
    cut_in = 0
    with _open_trace(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if max_requests is not None and len(rows) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                n_in, out, t, hash_ids = _mooncake_row(row)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
            except KeyError as exc:
                raise TraceError(f"{path}:{lineno}: no field {exc}") from None
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: bad value: {exc}") from None
            if max_input_tokens is not None and n_in > max_input_tokens:
                n_in, cut_in = max_input_tokens, cut_in + 1
                hash_ids = hash_ids[: -(-n_in // MOONCAKE_BLOCK_TOKENS)]
            rows.append((t, n_in, out, hash_ids))
    # a block used once (a third of the trace's ids) is made without caching it, so it does
    # not push out the blocks that recur (every block was made ~2.1 times over)
    uses = Counter(h for _, _, _, ids in rows for h in ids)
    items: list[WorkItem] = []
    cut_out = 0
    for t, n_in, out, hash_ids in rows:
        parts = []
        remaining = n_in
        for h in hash_ids:
            take = min(MOONCAKE_BLOCK_TOKENS, remaining)
            name = f"mc-{h}"
            block = (
                text.block(name, MOONCAKE_BLOCK_TOKENS)
                if uses[h] > 1
                else text.once(name, MOONCAKE_BLOCK_TOKENS)
            )
            parts.append(
                block
                if take == MOONCAKE_BLOCK_TOKENS
                else "".join(" " + w for w in block.split()[:take])
            )
            remaining -= take
            if remaining <= 0:
                break
        if output_cap is not None and out > output_cap:
            out, cut_out = output_cap, cut_out + 1
        items.append(
            WorkItem(
                t=t,
                api="completions",
                max_tokens=out,
                prompt="".join(parts),
                group=f"h{hash_ids[0]}" if hash_ids else None,
            )
        )
    if not items and max_requests != 0:
        raise TraceError(f"{path}: no rows")
    return Workload(
        "mooncake",
        _sorted(items),
        f"Mooncake trace {path.name}, {len(items)} rows"
        + _caps_note(len(items), max_input_tokens, cut_in, output_cap, cut_out),
    )


def azure(
    text: TextSource,
    kind: Literal["conv", "code"] = "conv",
    path: Path | None = None,
    max_requests: int | None = None,
    max_input_tokens: int | None = 4096,
    output_cap: int | None = 256,
    start: int = 0,
) -> Workload:
    """Azure LLM inference trace 2023: arrivals and lengths, unique content per row; rows
    ``start`` .. ``start + max_requests - 1`` (times from the first of them)."""
    path = path or azure_path(kind)
    items = []
    cut_in = cut_out = 0  # rows whose context / output the caps shortened
    t0: datetime | None = None
    with _open_trace(path) as fh:
        reader = csv.DictReader(fh)
        for i, row in enumerate(reader):
            if i < start:
                continue
            if max_requests is not None and i >= start + max_requests:
                break
            try:
                ts = datetime.fromisoformat(row["TIMESTAMP"][:26])
                n_in = max(1, int(row["ContextTokens"]))
                out = max(1, int(row["GeneratedTokens"]))
            except KeyError as exc:
                raise TraceError(f"{path}:{reader.line_num}: no column {exc}") from None
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{reader.line_num}: bad value: {exc}") from None
            t0 = t0 or ts
            if max_input_tokens is not None and n_in > max_input_tokens:
                n_in, cut_in = max_input_tokens, cut_in + 1
            if output_cap is not None and out > output_cap:
                out, cut_out = output_cap, cut_out + 1
            items.append(
                WorkItem(
                    t=(ts - t0).total_seconds(),
                    api="completions",
                    max_tokens=out,
                    prompt=text.block(f"az-{kind}-{i}", n_in),
                    group="unique",
                )
            )
    if not items and max_requests != 0:
        raise TraceError(f"{path}: no rows" + (f" from row {start}" if start else ""))
    return Workload(
        f"azure-{kind}",
        _sorted(items),
        f"Azure {kind} trace, {len(items)} rows"
        + _caps_note(len(items), max_input_tokens, cut_in, output_cap, cut_out),
    )


def _caps_note(
    rows: int, max_input: int | None, cut_in: int, max_output: int | None, cut_out: int
) -> str:
    """What a trace replay's length caps cut, for its description: a replay of "arrivals
    and lengths" that shortens some must say so where its figures are read."""
    caps = []
    if max_input is not None:
        caps.append(f"prompts capped at {max_input} tokens ({cut_in} of {rows} rows cut)")
    if max_output is not None:
        caps.append(f"outputs at {max_output} tokens ({cut_out} of {rows} cut)")
    return "; " + ", ".join(caps) if caps else ""


def azure_path(kind: str) -> Path:
    return trace_dir() / f"AzureLLMInferenceTrace_{kind}.csv"


def azure_rows(kind: Literal["conv", "code"], path: Path | None = None) -> int:
    """How many requests the Azure trace holds (its data rows)."""
    path = path or azure_path(kind)
    with _open_trace(path) as fh:
        return max(0, sum(1 for line in fh if line.strip()) - 1)  # less the header


def azure_window(
    text: TextSource, kind: Literal["conv", "code"], requests: int, rate: float, seed: int
) -> Workload:
    """Seed k replays the Azure trace's k-th window of ``requests`` consecutive rows (it
    wraps), arrivals rescaled to ``rate``: the trace's burstiness and lengths, and no
    shared content (every row is unique), the boundary case of short-lived, non-repeating
    traffic at production arrival patterns."""
    rows = azure_rows(kind)
    if requests > rows:  # the window would silently hold fewer requests than asked for
        raise TraceError(
            f"the Azure {kind} trace {azure_path(kind)} holds {rows} requests, "
            f"{requests} asked for (every row is unique content: it is not tiled)"
        )
    start = (seed * requests) % max(1, rows - requests + 1)
    return azure(text, kind, max_requests=requests, start=start).at_rate(rate)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "rag": rag,
    "short-unique": short_unique,
    "hot-prefix": hot_prefix,
    "long-prefix-pressure": long_prefix_pressure,
    "tenant-mix": tenant_mix,
    "cache-flood": cache_flood,
    "mooncake": mooncake,
    "azure-conv": lambda text, **kw: azure(text, "conv", **kw),
    "azure-code": lambda text, **kw: azure(text, "code", **kw),
}


def build(name: str, text: TextSource | None = None, **kwargs: Any) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    return WORKLOADS[name](text or TextSource(), **kwargs)
