"""``kvgate simulate``: the fleet in virtual time, with the real engine and routing code.

Nothing here re-implements what it measures. Each replica is a
:class:`~cachecore.engine.core.EngineCore` (the same engine the HTTP replicas run); each
replica's KV events go through a :class:`~cachecore.lifecycle.ReplicaMirror` (the agent's
code) into a :class:`~cachecore.index.memory.MemoryIndex`; requests are tokenized by the
gateway's :class:`~gateway.tokenization.LocalPromptTokenizer`, keyed by
:class:`~cachecore.keys.BlockKeyer` under the tenant's salt, scored by
:mod:`cachecore.scoring` with the gateway's :class:`~gateway.load.LoadTracker` in-flight
accounting and routed by :class:`~gateway.routing.Router` with the policy's parameters;
coefficients are fitted online from observed TTFT as the gateway does.

Event driven: arrivals, engine steps (decode-only stretches are fast-forwarded
analytically by the engine until the next arrival), delayed index updates and periodic
load scrapes. Two delays make it honest (without them precise routing looks perfect):

* ``--event-delay-ms``: a step's KV events reach the index this long after the step ends
  (ZMQ, the agent, the Redis write);
* ``--scrape-interval-ms``: the engine load the router sees (running, waiting, KV usage)
  is refreshed only this often; between scrapes only the gateway's own in-flight
  accounting is current.

Reported per strategy: token hit rate, TTFT mean/p50/p90/p99, e2e p99, load imbalance,
preemptions, index size, decision cost (wall microseconds: keys + lookup + score), and the
simulator's own speed (simulated seconds per wall second, tokens simulated per second).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from pathlib import Path
from typing import Any

from cachecore.engine.core import EngineConfig, EngineCore, StepResult, default_output_vocab
from cachecore.engine.hashing import HashAlgo
from cachecore.engine.latency import PROFILES, get_profile
from cachecore.engine.request import EngineRequest, RequestOutput
from cachecore.index.base import NO_MATCH, PrefixMatch, ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKey, BlockKeyer, SaltMinter, Scope, ScopeKind, tokens_to_bytes
from cachecore.lifecycle import ReplicaMirror
from cachecore.process import batch_gc, freeze_startup_heap
from cachecore.scoring import LoadView, OnlineFit, features, hit_cap_blocks
from cachecore.tokenizer import builtin_tokenizer
from cachecore.traceanalysis import percentile
from gateway.cli import (
    CommandError,
    comma_list,
    nonnegative_float,
    positive_float,
    positive_int,
    writable_file,
)
from gateway.load import InFlight, LoadTracker, SharedLoad, Ticket
from gateway.routing import Candidate, Router, RouteRequest, Strategy
from gateway.tokenization import LocalPromptTokenizer
from loadtest.workloads import Api, TextSource, WorkItem, Workload, azure_window, build
from policies.schema import Policy, PolicyError, builtin_policy_path, load_policy

MODEL = "kvgate-sim-8b"
_SIM_SECRET = b"kvgate-simulator-salt-secret-0000"

STEP_DONE, FF_DONE, INDEX, SCRAPE = 1, 2, 3, 4
_MAX_WATCHED = 1 << 16  # first keys whose holders are tracked (then the map starts over)
_WORDS_AHEAD = 256  # arrivals whose chat contents' word ids are looked up at once (run)
_CONTENTS_KEPT = 8192  # chat contents whose word ids and bytes are remembered (an LRU)


@dataclass(frozen=True, slots=True)
class SimConfig:
    replicas: int = 64
    profile: str = "8b-h100"
    num_blocks: int = 4096
    block_size: int = 16
    strategy: Strategy = Strategy.EXPECTED_LATENCY
    event_delay_s: float = 0.020
    scrape_interval_s: float = 0.5
    seed: int = 0
    # deferred analytic decode (fast); False steps every decode step (the reference mode a
    # test compares it with)
    defer_decode: bool = True
    # engines as vLLM with EAGLE/MTP drafting (EngineConfig.drop_last_hit_block); the router
    # models it by the policy's pool hit_drop_blocks, as the gateway does
    drop_last_hit_block: bool = False


@dataclass(slots=True)
class _InFlightReq:
    item: WorkItem
    arrival: float
    replica: int
    ticket: Ticket
    prompt_tokens: int
    predicted_cached: int
    load_at_dispatch: LoadView
    ttft: float | None = None


@dataclass(slots=True)
class SimResult:
    strategy: str
    replicas: int
    requests: int
    sim_seconds: float
    wall_seconds: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    predicted_error_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    decision_us: list[float] = field(default_factory=list)
    per_replica_requests: list[int] = field(default_factory=list)
    preemptions: int = 0
    index_entries_peak: int = 0
    index_entries_end: int = 0
    rejected: int = 0

    def row(self) -> dict[str, float]:
        per = self.per_replica_requests
        mean_per = sum(per) / len(per) if per else 0.0
        return {
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "ttft_mean": statistics.fmean(self.ttft) if self.ttft else math.nan,
            "ttft_p50": percentile(self.ttft, 50),
            "ttft_p90": percentile(self.ttft, 90),
            "ttft_p99": percentile(self.ttft, 99),
            "e2e_p99": percentile(self.e2e, 99),
            "imbalance": max(per) / mean_per if mean_per else math.nan,
            "pred_error": self.predicted_error_tokens / self.prompt_tokens
            if self.prompt_tokens
            else 0.0,
            "decision_p50_us": percentile(self.decision_us, 50),
            "decision_p99_us": percentile(self.decision_us, 99),
            "speedup": self.sim_seconds / self.wall_seconds if self.wall_seconds else math.nan,
            # vLLM's "total token throughput": every prompt token, cached ones included
            "tokens_per_wall_s": (self.prompt_tokens + self.generated_tokens) / self.wall_seconds
            if self.wall_seconds
            else 0.0,
            # the tokens whose prefill or decode the engine model computed (hits are looked up)
            "computed_tokens_per_wall_s": (
                self.prompt_tokens - self.cached_tokens + self.generated_tokens
            )
            / self.wall_seconds
            if self.wall_seconds
            else 0.0,
        }


class FleetSimulator:
    """One run: one workload through one strategy on a fresh fleet."""

    def __init__(self, cfg: SimConfig, policy: Policy, workload: Workload) -> None:
        self.cfg = cfg
        self.policy = policy
        self.workload = workload
        self._drop = policy.models.pool(MODEL).hit_drop_blocks
        profile = get_profile(cfg.profile)
        vocab = default_output_vocab()
        self.engines = [
            EngineCore(
                EngineConfig(
                    profile=profile,
                    num_blocks=cfg.num_blocks,
                    block_size=cfg.block_size,
                    hash_seed=cfg.seed * 1000 + i,
                    hash_algo=HashAlgo.XXHASH,  # engine hashes never reach our keys: fastest
                    drop_last_hit_block=cfg.drop_last_hit_block,
                ),
                vocab,
            )
            for i in range(cfg.replicas)
        ]
        self.ids = [f"r{i}" for i in range(cfg.replicas)]
        self._pos = {rid: i for i, rid in enumerate(self.ids)}
        self.keyer = BlockKeyer(cfg.block_size)
        self.mirrors = [ReplicaMirror(self.keyer, MODEL) for _ in range(cfg.replicas)]
        self.index = MemoryIndex(
            max_entries=max(1_000_000, 4 * cfg.replicas * cfg.num_blocks),
            removal_log=0,  # no claim checks in virtual time
            keep_mirror=False,  # nor agent restarts: the mirrors' records are never read back
        )
        self.minter = SaltMinter([_SIM_SECRET])
        tok = builtin_tokenizer()
        self.tokenizer = LocalPromptTokenizer(tok)
        words = tok.word_vocabulary
        self._word_ids: dict[str, int] | None = dict(zip(words.words, words.ids, strict=True))
        self._word_checks: dict[Api, int] = {"chat": 16, "completions": 16}  # both APIs checked
        # a chat's roles -> the ids of its template text around the contents (None: the
        # template does not render those roles as text + content + text)
        self._frames: dict[tuple[Any, ...], list[list[int]] | None] = {}
        self._frame_bytes: dict[tuple[Any, ...], list[bytes]] = {}  # the same as uint32 bytes
        # LRU of contents' ids and their uint32 bytes: a prompt's bytes for the engine are
        # joined from its pieces' instead of converted again from its ids per request
        self._contents: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()
        self.inflight = InFlight()
        self._snapshot: dict[str, SharedLoad] = {}
        self.tracker = LoadTracker(self.inflight, lambda: self._snapshot)
        # The router's per-request inputs, kept current instead of rebuilt for every replica
        # on every request (that was O(replicas) per request): each replica's LoadView and
        # its no-match Candidate, rebuilt (by the same LoadTracker) only for the replicas
        # whose in-flight counts changed since, and for all of them at a scrape.
        self._views: dict[str, LoadView] = {}
        self._cands: list[Candidate] = []
        self._stale: set[str] = set(self.ids)
        # First keys looked up -> a superset of the replicas that hold that key stored or
        # pending: the index lookup asks only those (every other replica is a no-match).
        # A key's set is built by one full lookup and grows with each index write or pending
        # add that covers the key; replicas are never removed (a superset stays exact).
        self._holders: dict[BlockKey, set[str]] = {}
        self.router = Router(policy.routing.params(), random.Random(cfg.seed))
        fit_pol = policy.cost.fit
        self.fit = OnlineFit(
            policy.cost.coefficients(),
            bound=fit_pol.bound,
            forgetting=fit_pol.forgetting,
            min_samples=fit_pol.min_samples,
        )
        self.fit_enabled = fit_pol.enabled
        self.capacity = {rid: e.max_num_seqs for rid, e in zip(self.ids, self.engines, strict=True)}
        self.salts: dict[str, str] = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._busy = [False] * cfg.replicas
        self._ff: list[tuple[float, float] | None] = [None] * cfg.replicas  # (start, t_step)
        self._version = [0] * cfg.replicas
        self._reqs: dict[str, _InFlightReq] = {}
        if not cfg.scrape_interval_s > 0:  # a zero interval re-schedules itself forever
            raise ValueError(f"scrape_interval_s must be > 0, got {cfg.scrape_interval_s}")
        self.result = SimResult(cfg.strategy.value, cfg.replicas, len(workload.items), 0.0, 0.0)
        self.result.per_replica_requests = [0] * cfg.replicas
        # the simulated span: the last arrival or finish (not the scrape tick that follows)
        self._last_work = 0.0

    def _push(self, t: float, kind: int, data: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, data))

    def _salt(self, tenant: str) -> str:
        salt = self.salts.get(tenant)
        if salt is None:
            salt = self.salts[tenant] = self.minter.salt(Scope(ScopeKind.TENANT, tenant))
        return salt

    def _word_run(self, text: str) -> list[int] | None:
        """The ids of ``" w1 w2 ..."`` made of single-token words, else None."""
        assert self._word_ids is not None
        words = text[1:].split(" ")  # a double space or newline: a word that is not known
        try:
            if len(words) == 1:
                return [self._word_ids[words[0]]]
            # one C call for all the words (a map of dict.get and a scan for None cost 1/4 more)
            return list(itemgetter(*words)(self._word_ids))
        except KeyError:
            return None

    def _prefetch_words(self, items: Sequence[WorkItem]) -> None:
        """Put the word ids (and bytes) of these chats' new contents in the contents LRU
        that :meth:`_chat_words` reads, a batch of arrivals at once: the vocabulary's table
        stays in the CPU cache over the batch instead of being evicted by the fleet between
        two arrivals (a 128-word question took ~2x as long one arrival at a time). Only
        what _chat_words would put there; each prompt is still put together from them
        when it arrives (as the gateway tokenizes right before it keys)."""
        if self._word_ids is None:
            return
        for item in items:
            for m in item.messages or ():
                content = m.get("content")
                if isinstance(content, str):
                    self._content_words(content)

    def _content_words(self, content: str) -> tuple[list[int], bytes] | None:
        """One chat content's word ids and their bytes, remembered (an LRU of
        _CONTENTS_KEPT); None when it is not a run of single-token words."""
        contents = self._contents
        seen = contents.get(content)
        if seen is not None:  # a system prompt, a document: seen before
            contents.move_to_end(content)
            return seen
        found = self._word_run(content) if content.startswith(" ") else None
        if not content:
            found = []
        if found is None:
            return None
        seen = contents[content] = (found, tokens_to_bytes(found))
        if len(contents) > _CONTENTS_KEPT:
            contents.popitem(last=False)
        return seen

    def _chat_words(self, body: dict[str, Any]) -> tuple[list[int], bytes] | None:
        """A chat's ids without rendering or BPE when every message is made of single-token
        words: the template's text around the contents (its frame, rendered once per role
        sequence) and each content encode on their own (SegmentCache's invariant: the
        special tokens split the text; the role line apart from the words), so the ids are
        the frame's pieces with each content's word ids between them (checked against the
        tokenizer on the first chats and on each new frame's first). With the ids, their
        uint32 bytes (tokens_to_bytes), joined from the pieces' bytes."""
        messages = body["messages"]
        if not messages:
            return None
        roles = tuple(m.get("role") for m in messages)
        frame = self._frames.get(roles)
        if frame is None:
            if roles in self._frames or not self._frame(roles, messages):
                return None
            frame = self._frames[roles]
            assert frame is not None
            self._word_checks["chat"] = max(1, self._word_checks["chat"])  # check its first
        frame_bytes = self._frame_bytes[roles]
        out = list(frame[0])
        parts = [frame_bytes[0]]
        for m, after, after_bytes in zip(messages, frame[1:], frame_bytes[1:], strict=True):
            content = m.get("content")
            if len(m) != 2 or not isinstance(content, str):  # a name, tool calls, parts
                return None
            seen = self._content_words(content)
            if seen is None:
                return None
            ids, data = seen
            out += ids
            out += after
            parts += (data, after_bytes)
        return out, b"".join(parts)

    def _frame(self, roles: tuple[Any, ...], messages: Sequence[dict[str, Any]]) -> bool:
        """Render the template once for these roles with a marker for each content and keep
        the ids of the text between the markers; False (and None kept) when it does not
        split that way: every text before a content ends its role line with a newline."""
        segments = self.tokenizer.segments
        self._frames[roles] = None
        if not segments.enabled or segments.split_pattern is None:
            return False
        if not all(isinstance(r, str) for r in roles):
            return False
        marker = "\x00"
        probe = [{"role": m.get("role"), "content": marker} for m in messages]
        text = self.tokenizer.tok.apply_chat_template(probe, True)
        texts = text.split(marker)
        if len(texts) != len(messages) + 1 or not all(t.endswith("\n") for t in texts[:-1]):
            return False
        frame: list[list[int]] = []
        for t in texts:
            ids: list[int] = []
            for i, piece in enumerate(segments.split_pattern.split(t)):
                if i % 2:
                    ids.append(segments.special_ids[piece])
                elif piece:
                    ids += self.tokenizer.tok.encode(piece)
            frame.append(ids)
        self._frames[roles] = frame
        self._frame_bytes[roles] = [tokens_to_bytes(ids) for ids in frame]
        return True

    def _tokens(self, item: WorkItem) -> tuple[list[int], bytes | None]:
        """The prompt's ids, and their uint32 bytes when the shortcut made them (else None:
        the engine converts the ids)."""
        body = item.body(MODEL, stream=False)
        tok = self.tokenizer
        exact = tok.chat_sync if item.api == "chat" else tok.completion_sync
        ids: list[int] | None = None
        data: bytes | None = None
        if self._word_ids is not None:
            # workload text is single-token words: " w1 w2" encodes to their ids exactly
            # (WordVocabulary's invariant); checked against the tokenizer on the first ones
            if item.api == "chat":
                found = self._chat_words(body)
                if found is not None:
                    ids, data = found
            elif item.prompt and item.prompt.startswith(" "):
                ids = self._word_run(item.prompt)
        if ids is None:
            return exact(body), None
        if self._word_checks[item.api] > 0:
            self._word_checks[item.api] -= 1
            truth = exact(body)
            if ids != truth or (data is not None and data != tokens_to_bytes(truth)):
                self._word_ids = None  # never trust the shortcut again
                return truth, None
        return ids, data

    # ------------------------------------------------------------------ routing
    def _route(self, i: int, item: WorkItem, now: float) -> None:
        tokens, prompt_bytes = self._tokens(item)
        n = len(tokens)
        bs = self.cfg.block_size
        t0 = time.perf_counter()
        salt = self._salt(item.tenant)
        cap = min(hit_cap_blocks(n, bs), self.policy.index.max_prompt_blocks)
        keys: list[BlockKey] = self.keyer.keys(tokens, salt, MODEL, None, max_blocks=cap)
        now_ms = int(now * 1000)
        matches = self._lookup(keys, now_ms) if keys else {}
        loads = self._fresh_views()
        cands = self._cands.copy()
        pos = self._pos
        for mrid, m in matches.items():
            if m is not NO_MATCH:
                cands[pos[mrid]] = Candidate(mrid, loads[mrid], m)
        session = item.session or (f"{item.tenant}/{keys[0].hex()}" if keys else None)
        req = RouteRequest(
            prompt_tokens=n,
            block_size=bs,
            session_key=session,
            scope_key=item.tenant,
            hit_drop_blocks=self._drop,
        )
        decision = self.router.decide(req, cands, self.fit.coefficients(), self.cfg.strategy)
        self.result.decision_us.append((time.perf_counter() - t0) * 1e6)
        rid = decision.replica
        r = self._pos[rid]
        predicted = decision.predicted_cached_tokens
        ticket = self.inflight.dispatch(rid, max(0, n - predicted))
        self._stale.add(rid)
        match = matches.get(rid)
        start = match.stored_blocks if match is not None else 0
        if start < len(keys):
            pending = keys[start:]
            self._hold(rid, filter(self._holders.__contains__, pending))
            # the gateway's own synchronous call (no coroutine per request)
            self.index.add_pending_now(rid, pending, self.policy.index.pending_ttl_ms, now_ms)
        req_id = f"q{i}"
        engine = self.engines[r]
        deferred = self._ff[r] is not None
        clock = self._materialize(r, now) if deferred else now
        try:
            engine.add_request(
                EngineRequest(req_id, tokens, item.max_tokens, salt, prompt_bytes=prompt_bytes),
                now,
            )
        except ValueError:
            self.inflight.done(ticket)
            self._stale.add(rid)
            self.result.rejected += 1
            if deferred:
                self._kick(r, clock)
            return
        self._reqs[req_id] = _InFlightReq(item, now, r, ticket, n, predicted, loads[rid])
        self.result.per_replica_requests[r] += 1
        if deferred or not self._busy[r]:
            # a cancelled decode stretch or an idle replica: schedule its next work now
            self._kick(r, clock)

    def _lookup(self, keys: list[BlockKey], now_ms: int) -> dict[str, PrefixMatch]:
        """The index's matches for ``keys``, asked of the replicas that may hold the first
        key; a replica left out is a no-match (NO_MATCH, what the index answers for a live
        replica without the first key; every replica here is live)."""
        holders = self._holders.get(keys[0])
        if holders is None:
            matches = self.index.lookup_now(keys, self.ids, now_ms)
            if len(self._holders) >= _MAX_WATCHED:  # unique prompts: bound the memory
                self._holders.clear()
            self._holders[keys[0]] = {r for r, m in matches.items() if m is not NO_MATCH}
            return matches
        return self.index.lookup_now(keys, list(holders), now_ms) if holders else {}

    def _hold(self, rid: str, keys: Iterable[BlockKey]) -> None:
        """``rid`` now stores or has pending each of these watched first keys."""
        holders = self._holders
        for k in keys:
            holders[k].add(rid)

    def _fresh_views(self) -> dict[str, LoadView]:
        """Every replica's LoadView, recomputed for the replicas marked stale."""
        stale = self._stale
        if stale:
            views = self.tracker.views(
                list(stale) if len(stale) < len(self.ids) else self.ids, self.capacity
            )
            self._views.update(views)
            if not self._cands:
                self._cands = [Candidate(rid, self._views[rid]) for rid in self.ids]
            else:
                cands, pos = self._cands, self._pos
                for rid, view in views.items():
                    cands[pos[rid]] = Candidate(rid, view)
            stale.clear()
        return self._views

    # ------------------------------------------------------------------ engine
    def _kick(self, r: int, now: float) -> None:
        """Start replica r's next unit of work at ``now``: a normal step (executed now,
        delivered at its end), or, for a decode-only batch, a deferred fast-forward to the
        step where its first request finishes (materialised early if a request arrives)."""
        engine = self.engines[r]
        if not engine.has_work():
            self._busy[r] = False
            return
        self._busy[r] = True
        if self.cfg.defer_decode and engine.decode_only():
            t_step = engine.latency.step_time(0, len(engine.running))
            k = min(req.remaining_tokens for req in engine.running)
            if k > 1 and t_step > 0:
                self._version[r] += 1
                self._ff[r] = (now, t_step)
                self._push(now + k * t_step, FF_DONE, (r, self._version[r]))
                return
        res = engine.step(now)
        dur = res.duration_s if res.duration_s > 0 else 1e-4  # never spin at one instant
        self._push(now + dur, STEP_DONE, (r, res))

    def _materialize(self, r: int, until: float) -> float:
        """Run replica r's deferred decode stretch up to the first step boundary at or after
        ``until`` (the analytic fast-forward, in as few engine calls as possible); return
        the replica's clock."""
        ff = self._ff[r]
        assert ff is not None
        clock, t_step = ff
        self._ff[r] = None
        self._version[r] += 1
        engine = self.engines[r]
        while clock < until - 1e-12 and engine.decode_only():
            steps = max(1, math.ceil((until - clock) / t_step - 1e-9))
            res = engine.fast_forward(clock, steps)
            clock += res.duration_s
            self._delivered(r, res, clock)
        return clock

    def _delivered(self, r: int, res: StepResult, now: float) -> None:
        self._outputs(r, res.outputs, now)
        if res.events:
            write, _cleared = self.mirrors[r].apply(res.events)
            if write:
                self._push(now + self.cfg.event_delay_s, INDEX, (r, write))
        self.result.preemptions += len(res.preempted)

    def _outputs(self, r: int, outputs: Sequence[RequestOutput], now: float) -> None:
        res = self.result
        for out in outputs:
            st = self._reqs.get(out.request_id)
            if st is None:
                continue
            if out.first_token:
                st.ttft = now - st.arrival
                res.ttft.append(st.ttft)
                self.inflight.first_token(st.ticket)
                self._stale.add(st.ticket.replica)
                if self.fit_enabled:
                    x = features(
                        max(0, st.prompt_tokens - out.num_cached_tokens), 0.0, st.load_at_dispatch
                    )
                    self.fit.update(x, st.ttft * 1000.0)
            if out.finished:
                self.inflight.done(st.ticket)
                self._stale.add(st.ticket.replica)
                res.e2e.append(now - st.arrival)
                res.prompt_tokens += out.num_prompt_tokens
                res.cached_tokens += out.num_cached_tokens
                res.generated_tokens += out.num_output_tokens
                res.predicted_error_tokens += abs(st.predicted_cached - out.num_cached_tokens)
                del self._reqs[out.request_id]
                self._last_work = max(self._last_work, now)

    def _scrape(self) -> None:
        snap: dict[str, SharedLoad] = {}
        for rid, e in zip(self.ids, self.engines, strict=True):
            # the three gauges of EngineStats, read without building all of its fields
            snap[rid] = SharedLoad(len(e.running), len(e.waiting), e.pool.usage(), e.max_num_seqs)
        self._snapshot = snap
        self._stale.update(self.ids)

    # ------------------------------------------------------------------ loop
    async def run(self) -> SimResult:
        items = self.workload.items
        for rid in self.ids:
            await self.index.clear_replica(rid, ReplicaState.LIVE, 0)
        epochs = [(await self.index.meta(rid)).epoch for rid in self.ids]
        self._scrape()
        self._push(self.cfg.scrape_interval_s, SCRAPE, None)
        pos = 0
        wall0 = time.perf_counter()
        now = 0.0
        heap = self._heap
        # every request finishes well within a day of sim time after the last arrival
        horizon = (items[-1].t if items else 0.0) + 86_400.0
        words_to = 0  # arrivals before this one have their contents' word ids looked up
        while pos < len(items) or heap:
            if pos < len(items) and (not heap or items[pos].t <= heap[0][0]):
                now = items[pos].t
                item = items[pos]
                if pos >= words_to:
                    words_to = pos + _WORDS_AHEAD
                    self._prefetch_words(items[pos:words_to])
                pos += 1
                self._last_work = max(self._last_work, now)
                self._route(pos - 1, item, now)
                continue
            if not heap:
                break
            now, _, kind, data = heapq.heappop(heap)
            if now > horizon:
                raise RuntimeError(
                    f"simulation did not drain by t={horizon:.0f}s: "
                    f"{len(self._reqs)} requests stuck"
                )
            if kind == STEP_DONE:
                r, res = data
                self._delivered(r, res, now)
                self._kick(r, now)
            elif kind == FF_DONE:
                r, version = data
                if version == self._version[r]:
                    self._kick(r, self._materialize(r, now))
            elif kind == INDEX:
                r, write = data
                rid = self.ids[r]
                # a write may store a watched first key (a delete never adds a holder)
                blocks = write.blocks
                watched = blocks.keys() & self._holders.keys()
                if watched:
                    self._hold(rid, (k for k in watched if blocks[k]))
                self.index.apply_now(rid, epochs[r], write, int(now * 1000))
            elif kind == SCRAPE:
                self._scrape()
                # the index holds exactly the mirrors' keys (plus pending): O(replicas)
                entries = sum(len(m) for m in self.mirrors)
                self.result.index_entries_peak = max(self.result.index_entries_peak, entries)
                if pos < len(items) or self._reqs:
                    self._push(now + self.cfg.scrape_interval_s, SCRAPE, None)
        self.result.wall_seconds = time.perf_counter() - wall0
        self.result.sim_seconds = self._last_work
        self.result.index_entries_end = (await self.index.stats()).stored_entries
        return self.result


# ------------------------------------------------------------------------- workloads


def scaled_workload(
    name: str, requests: int, replicas: int, rate: float, seed: int, text: TextSource
) -> Workload:
    """``requests`` requests of workload ``name`` at ``rate`` req/s, with its sharing
    structure scaled to the fleet (more prefix groups for more replicas)."""
    if name == "shared-prefix":
        groups = max(8, 6 * replicas)
        per = max(1, math.ceil(requests / groups))
        w = build(
            name,
            text,
            groups=groups,
            prompts_per_group=per,
            rate=rate,
            seed=seed,
            output_tokens=128,
        )
    elif name == "hot-prefix":
        w = build(name, text, n=requests, cold_groups=max(16, 8 * replicas), rate=rate, seed=seed)
    elif name in ("short-unique", "long-prefix-pressure", "tenant-mix", "rag"):
        w = build(name, text, n=requests, rate=rate, seed=seed)
    elif name == "multi-turn":
        turns = 6
        sessions = max(1, math.ceil(requests / turns))
        w = build(name, text, sessions=sessions, turns=turns, rate=rate, seed=seed)
    elif name == "mooncake":
        w = tiled_mooncake(text, requests, rate, seed)
    elif name in ("azure-conv", "azure-code"):
        w = azure_window(text, "conv" if name == "azure-conv" else "code", requests, rate, seed)
    else:
        raise ValueError(f"workload {name!r} is not available in the simulator")
    return w.head(requests)


def tiled_mooncake(text: TextSource, requests: int, rate: float, seed: int) -> Workload:
    """The Mooncake trace tiled to ``requests`` rows: each copy gets its own hash-id space
    (no sharing across copies) and a random time offset, then arrivals are rescaled to the
    wanted mean rate. Rows keep their order and sharing within a copy."""
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    base = build("mooncake", text, max_input_tokens=16384, output_cap=256)  # never empty
    rng = random.Random(seed)
    span = base.duration_s or 1.0
    copies = math.ceil(requests / len(base.items))
    items: list[WorkItem] = []
    for c in range(copies):
        off = rng.uniform(0, span)
        tag = f" copy{c}" if c else ""
        for it in base.items:
            prompt = (it.prompt or "") if not tag else _retag(it.prompt or "", c, text)
            items.append(replace(it, t=it.t + off, prompt=prompt, group=f"{it.group}{tag}"))
    items.sort(key=lambda it: it.t)
    items = items[:requests]
    # rows all at one instant (a trace of simultaneous arrivals, one copy) have no span to
    # rescale: they stay simultaneous, as Workload.at_rate keeps them
    dur = (items[-1].t - items[0].t) or 1.0
    factor = rate / (len(items) / dur)  # > 1 compresses time: a higher rate
    t0 = items[0].t
    scaled = tuple(replace(it, t=(it.t - t0) / factor) for it in items)
    return Workload("mooncake-tiled", scaled, f"Mooncake x{copies} copies at {rate}/s")


def _retag(prompt: str, copy: int, text: TextSource) -> str:
    """A copy-specific variant with the same token count and the same prefix structure:
    every word is shifted by a per-copy offset in the single-token vocabulary."""
    vocab = text.vocab
    index = {w: i for i, w in enumerate(vocab.words)}
    shift = 7919 * copy
    return vocab.text_from_ids((index[w] + shift) for w in prompt.split())


# ------------------------------------------------------------------------- calibration


async def calibrate_capacity(
    cfg: SimConfig, policy: Policy, workload: str | Workload, text: TextSource, requests: int
) -> float:
    """Completed requests per second of least_loaded when offered far more than the fleet
    can take: the throughput knee the load factor is relative to. ``workload`` is a name
    (scaled to the fleet here) or a built workload (its first ``requests`` items)."""
    if isinstance(workload, Workload):
        probe = replace(workload.head(requests), items=tuple(
            replace(it, t=k * 1e-6) for k, it in enumerate(workload.items[:requests])
        ))  # fmt: skip
    else:
        probe = scaled_workload(
            workload, requests, cfg.replicas, rate=1e6, seed=cfg.seed + 99, text=text
        )
    sim = FleetSimulator(replace(cfg, strategy=Strategy.LEAST_LOADED), policy, probe)
    res = await sim.run()
    done = len(res.e2e)  # completed: a rejected request is no throughput
    return done / res.sim_seconds if res.sim_seconds > 0 else math.inf


# ------------------------------------------------------------------------------- CLI


def profile_name(text: str) -> str:
    """A ``type=`` for ``--profile``: a known latency profile."""
    if text not in PROFILES:
        raise argparse.ArgumentTypeError(f"unknown profile {text!r}; known: {', '.join(PROFILES)}")
    return text


def strategy_name(text: str) -> Strategy:
    try:
        return Strategy(text)
    except ValueError:
        known = ", ".join(s.value for s in Strategy)
        raise argparse.ArgumentTypeError(f"unknown strategy {text!r}; known: {known}") from None


def policy_file(text: str) -> Policy:
    """A ``type=`` for ``--policy``: the file loaded and validated at parse time."""
    try:
        return load_policy(text)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        type=comma_list(positive_int),
        default="64",
        help="fleet size, or a list: 8,16,64",
    )
    parser.add_argument("--requests", type=positive_int, default=100_000)
    parser.add_argument(
        "--workload",
        default="shared-prefix",
        choices=[
            "shared-prefix",
            "hot-prefix",
            "short-unique",
            "rag",
            "long-prefix-pressure",
            "tenant-mix",
            "multi-turn",
            "mooncake",
            "azure-conv",
            "azure-code",
        ],
    )
    parser.add_argument(
        "--load",
        type=positive_float,
        default=0.7,
        help="offered load as a fraction of least_loaded's capacity",
    )
    parser.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="offered req/s (skips the capacity calibration)",
    )
    parser.add_argument(
        "--strategies",
        type=comma_list(strategy_name),
        default="expected_latency,least_loaded,prefix_affinity",
        help="comma-separated strategies, run on the same workload: "
        + ", ".join(s.value for s in Strategy),
    )
    parser.add_argument("--profile", type=profile_name, default="8b-h100")
    parser.add_argument("--blocks", type=positive_int, default=4096, help="KV blocks per replica")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--event-delay-ms", type=nonnegative_float, default=20.0)
    parser.add_argument("--scrape-interval-ms", type=positive_float, default=500.0)
    parser.add_argument(
        "--policy", type=policy_file, default=None, help="policy YAML (default: shipped)"
    )
    parser.add_argument("--calibration-requests", type=positive_int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot",
        type=writable_file,
        default=None,
        help="write a scaling plot here (needs >= 2 fleet sizes)",
    )


def format_rows(rows: Sequence[tuple[SimResult, dict[str, float]]]) -> str:
    out = [
        "| replicas | strategy | requests | rejected | hit rate | TTFT mean s | p50 | p90 | p99 | "
        "e2e p99 | imbalance | preempt | pred. err | index peak | decision p50/p99 us | sim s | "
        "wall s | speedup | prompt+output tokens/wall s | computed tokens/wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res, row in rows:
        out.append(
            f"| {res.replicas} | {res.strategy} | {res.requests} | {res.rejected} | "
            f"{row['hit_rate']:.1%} | "
            f"{row['ttft_mean']:.3f} | {row['ttft_p50']:.3f} | {row['ttft_p90']:.3f} | "
            f"{row['ttft_p99']:.3f} | {row['e2e_p99']:.2f} | {row['imbalance']:.2f} | "
            f"{res.preemptions} | {row['pred_error']:.2%} | {res.index_entries_peak:,} | "
            f"{row['decision_p50_us']:.0f}/{row['decision_p99_us']:.0f} | "
            f"{res.sim_seconds:.0f} | {res.wall_seconds:.1f} | {row['speedup']:.1f}x | "
            f"{row['tokens_per_wall_s']:,.0f} | {row['computed_tokens_per_wall_s']:,.0f} |"
        )
    return "\n".join(out)


async def _main(args: argparse.Namespace) -> int:
    batch_gc()
    policy = args.policy or load_policy(builtin_policy_path("default"))
    text = TextSource()
    strategies: list[Strategy] = args.strategies
    sizes: list[int] = args.replicas
    rows: list[tuple[SimResult, dict[str, float]]] = []
    for n in sizes:
        cfg = SimConfig(
            replicas=n, profile=args.profile, num_blocks=args.blocks,
            block_size=args.block_size, event_delay_s=args.event_delay_ms / 1000.0,
            scrape_interval_s=args.scrape_interval_ms / 1000.0, seed=args.seed,
        )  # fmt: skip
        rate = args.rate
        if rate is None:
            n_cal = args.calibration_requests or max(2000, min(args.requests // 5, 20 * n * 16))
            t0 = time.perf_counter()
            capacity = await calibrate_capacity(cfg, policy, args.workload, text, n_cal)
            if not capacity > 0:
                raise CommandError(
                    f"calibration on {n} replicas completed no request (every one rejected: "
                    "prompts larger than a replica's KV cache?); pass --rate or more --blocks"
                )
            rate = args.load * capacity
            print(
                f"# {n} replicas: least_loaded capacity {capacity:.1f} req/s "
                f"({n_cal} requests, {time.perf_counter() - t0:.0f} s wall); "
                f"offering {args.load:.0%} = {rate:.1f} req/s",
                flush=True,
            )
        workload = scaled_workload(args.workload, args.requests, n, rate, args.seed, text)
        # the workload (every request's text) lives for the whole run: out of the GC's
        # full collections, which otherwise traverse it again and again
        freeze_startup_heap()
        for strategy in strategies:
            sim = FleetSimulator(replace(cfg, strategy=strategy), policy, workload)
            res = await sim.run()
            rows.append((res, res.row()))
            print(format_rows(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(
        f"workload {args.workload}, profile {args.profile}, {args.blocks} blocks x "
        f"{args.block_size} tokens per replica, event delay {args.event_delay_ms} ms, "
        f"scrape {args.scrape_interval_ms} ms, seed {args.seed}"
    )
    print(format_rows(rows))
    rejected = [res for res, _ in rows if res.rejected]
    if rejected:
        worst = max(rejected, key=lambda r: r.rejected)
        print(
            f"\nWARNING: requests rejected by the engine in {len(rejected)} of {len(rows)} runs "
            f"(up to {worst.rejected} of {worst.requests}): a prompt that does not fit a "
            "replica's KV cache is refused; the figures cover only the admitted requests"
        )
    if args.plot is not None:
        plot_scaling(rows, args.plot)
        print(f"\nplot: {args.plot}")
    return 1 if any(res.rejected == res.requests for res, _ in rows) else 0  # nothing measured


def plot_scaling(rows: Sequence[tuple[SimResult, dict[str, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    by: dict[str, list[tuple[SimResult, dict[str, float]]]] = {}
    for res, row in rows:
        by.setdefault(res.strategy, []).append((res, row))
    for strategy, pts in by.items():
        xs = [r.replicas for r, _ in pts]
        axes[0].plot(xs, [row["hit_rate"] for _, row in pts], "o-", label=strategy)
        axes[1].plot(xs, [row["ttft_p99"] for _, row in pts], "o-", label=strategy)
        axes[2].plot(xs, [r.index_entries_peak for r, _ in pts], "o-", label=strategy)
        axes[3].plot(xs, [row["decision_p99_us"] for _, row in pts], "o-", label=strategy)
    for ax, title in zip(
        axes,
        ("token hit rate", "TTFT p99 (s)", "index entries (peak)", "decision p99 (us)"),
        strict=True,
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None and len(args.replicas) < 2:
        raise CommandError("--plot draws scaling over fleet sizes: give --replicas >= 2 sizes")
    return asyncio.run(_main(args))
