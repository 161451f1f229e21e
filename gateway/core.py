"""The gateway's per-request pipeline: authenticate, admit, tokenize, key, look up, route,
dispatch, and learn from the response.

:class:`Gateway` owns every per-process component (no module state). The HTTP layer
(:mod:`gateway.app`) calls :meth:`Gateway.prepare` for a request and gets either an error
or a :class:`Dispatch` (the routed request); :mod:`gateway.proxy` sends it upstream and
calls :meth:`Gateway.finish` with what it observed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import math
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from prometheus_client import CollectorRegistry
from pydantic import TypeAdapter, ValidationError

from cachecore.agent.embedded import embedded_agent_settings
from cachecore.agent.scrape import ScrapeError, parse_metrics
from cachecore.cacheread import body_reads_prefix_cache
from cachecore.httpread import read_answer
from cachecore.index.base import (
    IndexError_,
    PrefixIndex,
    PrefixMatch,
    ReplicaState,
    empty_match,
)
from cachecore.index.memory import MemoryIndex
from cachecore.index.redis import RedisIndex, evicts_any_key
from cachecore.keys import (
    KEY_BYTES,
    BlockKey,
    BlockKeyer,
    KeyMaterialError,
    SaltMinter,
    Scope,
    ScopeKind,
)
from cachecore.laxbool import lax_bool
from cachecore.loadstate import LoadStore
from cachecore.looplag import LoopLagMonitor
from cachecore.registry import RegistryStore, ReplicaAllowlist
from cachecore.responses import (
    ResponsesInputError,
    render_request,
)
from cachecore.scoring import (
    Coefficients,
    LoadView,
    OnlineFit,
    features,
    hit_blocks,
    hit_cap_blocks,
)
from cachecore.tasks import (
    BoundedStop,
    Step,
    cancel_and_wait,
    enclosing_limit_s,
    run_steps,
    run_to_end,
)
from cachecore.tokenizer import (
    SCORE_TOKEN_LIMITS,
    ServerChatDefaults,
    _unset_kwarg,
    chat_completion_messages,
    embedding_chat_input,
    is_conversation,
    is_conversation_batch,
    media_uuids,
    scope_media_uuids,
    strip_media,
)
from gateway.auth import KeyStore
from gateway.discovery import Discovery
from gateway.errors import GatewayError, bad_request, rate_limited, retry_after
from gateway.ids import random_hex
from gateway.indexing import GatewayIndex, LookupResult, PendingWrite
from gateway.limits import TenantLimiter
from gateway.load import IdleEngine, InFlight, LoadTracker, SharedLoadRefresher, Ticket
from gateway.metrics import GatewayMetrics
from gateway.policy_store import PolicyStore
from gateway.quarantine import (
    ClaimCheck,
    LogAnswer,
    QuarantineTracker,
    judge_floor,
    judge_removal,
)
from gateway.replicas import Replica, ReplicaPool, ReplicaSpec
from gateway.requesttrace import RequestTrace
from gateway.responses import ResponseIds
from gateway.routing import (
    Candidate,
    Decision,
    NoCandidateError,
    Router,
    RouteRequest,
    Strategy,
    rendezvous_weight,
)
from gateway.settings import GatewaySettings
from gateway.tokenization import (
    AnswerTooLarge,
    LocalPromptTokenizer,
    TokenizerPools,
    add_special_tokens,
    bounded_answer,
    card_max_model_len,
    check_alignment,
    check_score_limits_context,
    completion_batch_size,
    completion_prompt,
    pair_texts,
    pooling_padding,
    pooling_pairs,
    pooling_truncation,
    request_truncation,
    score_fields,
    score_token_limits,
    stream_requested,
    truncation_side,
    usage_requested,
)
from gateway.tracing import make_provider, make_tracer
from gateway.upstream import LeanTransport
from policies.schema import Policy, PolicyError, PriorityPolicy, TenantPolicy

log = logging.getLogger(__name__)

SENSITIVE_HEADER = "x-kvgate-sensitive"
SESSION_HEADERS = ("x-kvgate-session", "x-session-id")
DEBUG_SHARED_SCOPE = "*debug-unsafe-shared*"
"""The one scope of every non-sensitive request under ``debug_unsafe_shared_scope`` (not a
valid tenant name, so it cannot collide with a real tenant's scope)."""
# claim checks waiting for an agent to report an eviction: at most this many per replica
# (the rest are skipped: k of m bad checks need no more), polled at this interval
MAX_SETTLING_CHECKS = 8
SETTLE_POLL_S = 0.25
# stop(): how long the cancelled background tasks may take to end, and how many times a
# task that swallowed its cancellation is cancelled again within it
BACKGROUND_STOP_S = 2.0
BACKGROUND_STOP_CANCELS = 4
# stop(): how long one close step may take before it is cancelled and the next one runs
# (the embedded agents' step: as long as their own stop may take, _agents_stop_bound_s)
STOP_STEP_S = 10.0
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}\Z")
_ENGINE_ID_FIELDS = frozenset(("request_id", "rid"))
"""Body fields an engine takes its request id from (vLLM's ``request_id``, SGLang's ``rid``)."""
_OPERATOR_FIELDS = frozenset(
    (
        # vLLM
        "kv_transfer_params",
        "ec_transfer_params",
        # SGLang
        "extra_key",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "session_params",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
    )
)
"""Request fields only the serving stack may set, removed from a client's. Where a
disaggregated engine reads its KV or encoder cache from (vLLM's ``kv_transfer_params`` /
``ec_transfer_params``, SGLang's ``bootstrap_*``) and which session's context a request
continues (SGLang's ``session_params``): from a client they could point an engine at what
another tenant's request computed. SGLang's ``extra_key``, a cache namespace beside
``cache_salt``: a client's would split the engine's cache under the index's keys, so every
prediction for it over-claims and the claim check could quarantine a healthy replica for
it. The data-parallel rank an engine runs a request on (``routed_dp_rank``, its deprecated
``data_parallel_rank``, ``disagg_prefill_dp_rank``): routing is the gateway's."""
_REPORT_MODE = "kv_cache_report_mode"
"""A ``vllm_xargs`` key that makes vLLM 0.33 publish a BlockStored for each prefix-cache
hit: indistinguishable on the wire from a new store, so a client could inflate the index's
copies of blocks (one removal would no longer remove them). Removed."""
_PRIORITY = TypeAdapter(int)
"""A client's ``priority`` read as vLLM's request model reads it (pydantic, lax int)."""
_PRIORITY_SET = frozenset(("fixed", "clamp"))
"""Tenant priority modes that may write the field into a request that has none."""
ENDPOINT_PATHS = {
    "chat": "/v1/chat/completions",
    "completion": "/v1/completions",
    "embeddings": "/v1/embeddings",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
    # vLLM's other pooling endpoints (D29); each path its own name, sent to the path the
    # client named (a vLLM server serves every alias)
    "pooling": "/pooling",
    "classify": "/classify",
    "score": "/score",
    "score_v1": "/v1/score",
    "rerank": "/rerank",
    "rerank_v1": "/v1/rerank",
    "rerank_v2": "/v2/rerank",
    # the Responses API (D30): a first turn keyed and routed as a chat, a follow-up
    # (previous_response_id) sent to the replica that stored the previous response
    "responses": "/v1/responses",
}
"""Each proxied endpoint's name (metrics, traces) and the engine path it goes to."""
RESPONSE_GET = "response_get"
"""``GET /v1/responses/{id}``'s endpoint name: not a POST of :data:`ENDPOINT_PATHS` (its
path carries the id); sent to the replica the sealed id names (D30)."""
RESPONSE_CANCEL = "response_cancel"
"""``POST /v1/responses/{id}/cancel``'s endpoint name, pinned as a retrieval is (D33)."""
RESPONSE_READS = frozenset((RESPONSE_GET, RESPONSE_CANCEL))
"""Requests on a stored response named by a sealed id (no body, no prompt, no charge)."""
RESPONSE_TERMINAL = frozenset(("completed", "incomplete", "cancelled", "failed"))
"""A stored response's statuses after which its engine computes nothing more (vLLM's
``ResponseStatus`` less ``queued`` and ``in_progress``)."""
WATCH_ENDS = frozenset(("lost", "engine_idle", "too_large"))
"""How a background watch ends without a terminal status (D33): ``lost`` (the replica
gone, the engine's 404), ``engine_idle`` (a dead run: its engine held no request on
:data:`~gateway.load.IDLE_SCRAPES` scrapes in a row while it read ``queued``; cancelled
there), ``too_large`` (its stored response over ``KVGATE_MAX_UPSTREAM_BODY_BYTES``)."""
_RENDERED_TOOLS = frozenset(("function", "custom", "namespace"))
"""A Responses request's tool types the model calls and the client runs; vLLM's server
runs any other (``web_search_preview``, ``code_interpreter``, ``container``, ``mcp``)
itself, between engine requests of the run, through its tool server."""
_BACKGROUND_POLL_TIMEOUT_S = 10.0  # one poll of a background response's status
_RESPONSES_PATH = "/v1/responses"


def _response_path(engine_id: str) -> str:
    """The engine's path of one stored response."""
    return f"{_RESPONSES_PATH}/{quote(engine_id, safe='')}"


_INPUT_POOLING = frozenset(("embeddings", "pooling", "classify"))
"""Pooling endpoints over inputs: ``input`` (a completion prompt's shapes, a batch) or the
chat form's ``messages`` (D29)."""
_PAIR_POOLING = frozenset(("score", "score_v1", "rerank", "rerank_v1", "rerank_v2"))
"""Pooling endpoints over text pairs (``text_1``/``text_2``, or ``query`` with each of
``documents``): each pair one engine request of both texts (D29)."""
_RERANK = frozenset(("rerank", "rerank_v1", "rerank_v2"))
LOAD_ROUTED = frozenset(("tokenize", "detokenize", *_INPUT_POOLING, *_PAIR_POOLING))
"""Endpoints routed by load alone, with no block keys, lookup, pending entries, claim check
or fit sample (D28, D29): a pooling request's prompt is computed whole and its usage reports
no cached tokens (pooling engines often run without prefix caching); /tokenize and
/detokenize compute nothing."""
_FRONTEND_ONLY = frozenset(("tokenize", "detokenize", *RESPONSE_READS))
"""Endpoints a vLLM server answers in its API server, without its engine core: their answer
is no evidence of the engine's progress (D17), which a wedged engine's server gives at once."""
UNSENT = "unsent"
"""``Outcome.error`` of an exchange that sent its request nowhere: its replica left the pool
after routing and no other took it (nothing reached an engine, as after a connect failure)."""
_NO_ENGINE = frozenset(("connect", UNSENT))
"""``Outcome.error`` values of a request no engine received: no failure of a replica's
(a connect failure was counted at the time), and no work, so its charge is given back."""
EVENT_TOO_LARGE = "event_too_large"
"""``Outcome.error`` of a stream cut at ``KVGATE_MAX_UPSTREAM_EVENT_BYTES``: no failure of
the replica's, as a healthy vLLM's Responses stream with output logprobs reaches the bound
near 40k tokens (docs/gateway.md), so a tenant asking for such streams would eject healthy
replicas (as replayed streams would, D33)."""
BODY_TOO_LARGE = "body_too_large"
"""``Outcome.error`` of an answer refused at ``KVGATE_MAX_UPSTREAM_BODY_BYTES``: no failure
of the replica's either, as the request chose its answer's size (a huge embeddings batch, a
long prompt's prompt_logprobs): a tenant asking for such answers would eject healthy
replicas for everyone."""
_OVERSIZED = frozenset((EVENT_TOO_LARGE, BODY_TOO_LARGE))
_UNSALTED = frozenset(("detokenize",))
"""Endpoints sent with no ``cache_salt`` (a client's removed): token ids to text touch no
cache of the engine's. /tokenize keeps the scope's, as the gateway's own tokenize calls:
the simulated replica's tokenization cache is scoped by it (security.md)."""
_REWRITTEN_FIELDS = frozenset(("cache_salt", *_ENGINE_ID_FIELDS, *_OPERATOR_FIELDS))
"""Client fields upstream_body replaces or removes: a body with none of them (and no report
mode) goes upstream as its own bytes with the salt appended."""

AgentHook = Callable[
    [Sequence[ReplicaSpec], PrefixIndex, LoadStore | None, CollectorRegistry],
    Awaitable[Callable[[], Awaitable[None]]],
]
"""Starts embedded cache agents for the replicas given as ``URL=EVENTS,REPLAY``, sharing the
gateway's index (and load store) and exposing their metrics in the gateway's registry;
returns an async stop function. One that is a :class:`~cachecore.tasks.BoundedStop` (the
embedded agents') bounds the gateway's wait on it with its ``stop_limit_s``; any other gets
:data:`STOP_STEP_S`, as every other step of :meth:`Gateway.stop`."""


def request_id_from(headers: Mapping[str, str]) -> str:
    rid = headers.get("x-request-id")
    if rid and _REQUEST_ID.match(rid):
        return rid
    # unpredictable (gateway.ids: random's generator could be cloned from the ids a tenant
    # is answered) and without a syscall per id
    return random_hex(16)


_MODELS_NAMED = 10  # in the 400 of a request without a model on a multi-model fleet


@dataclass(slots=True)
class Dispatch:
    """A routed request, ready to send upstream."""

    request_id: str
    tenant: str
    endpoint: str  # a key of ENDPOINT_PATHS
    path: str
    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool
    model: str
    prompt_tokens: int
    block_size: int
    scope: Scope
    salts: list[str]
    keys: list[list[BlockKey]]  # per salt (empty for ephemeral scopes)
    matches: list[dict[str, PrefixMatch]]  # per salt
    index_source: str
    candidates: list[Candidate]
    decision: Decision
    salt_index: int = 0
    attempts: int = 0
    # attempts whose exchange the replica broke after the request was sent (it may have
    # died of this request): retried at most KVGATE_DROP_RETRIES times
    drops: int = 0
    tried: list[str] = field(default_factory=list)
    # the pool's replica the current attempt went to: a check still out when that replica
    # left, or was replaced by a new one under the same id, is not about the one there now
    target: Replica | None = None
    ticket: Ticket | None = None
    t_start: float = 0.0
    load_at_dispatch: LoadView | None = None
    raw_body: bytes | None = None  # the client's bytes, when they parsed to ``body``
    lookup_ms: int = 0  # wall clock of the index lookup (the claim check's "since")
    # media parts, or prompt logprobs (no cache read): by load, no keys, precision or claims
    unkeyed: bool = False
    media_uuids: bool = False  # a media part names its item by uuid: scoped upstream
    cold_replicas: frozenset[str] | None = None  # the tenant's confinement (kept for retries)
    # the id the engine gets: the client's id made unique, so that no client-chosen id can
    # collide with another tenant's request on an engine (vLLM refuses or confuses a
    # duplicate id; the refusal would tell one tenant that another's is running)
    upstream_id: str = ""
    charged_uncached: float = 0.0  # what the tenant's uncached-token budget was charged
    # of that, the sum of what the attempts replicas dropped may have computed (each its
    # replica's prediction): never given back
    kept_uncached: float = 0.0
    pending: PendingWrite | None = None  # this attempt's pending entries, while in flight
    # the tenant's priority rule: the value the engine gets in place of the client's, or
    # the client's removed (policies.schema.PriorityPolicy)
    priority: int | None = None
    drop_priority: bool = False
    # blocks the engine drops off every prefix hit (models.<pool>.hit_drop_blocks, read at
    # routing): the claim check and a retry's decision model the same engine
    hit_drop_blocks: int = 0
    # false when the request named no model and the gateway filled it in: the client's
    # bytes lack it, so they do not go upstream as they are (an engine may require it)
    model_given: bool = True
    # false: no cache_salt goes upstream (a client's removed): an endpoint that touches no
    # cache (_UNSALTED)
    salted: bool = True
    # the Responses API (D30): the engine's id for this response (the body's request_id,
    # vLLM's response id); the previous response's engine id and the sealed id the client
    # named it by (a follow-up, pinned to its replica); GET /v1/responses/{id}'s method
    response_id: str | None = None
    previous: tuple[str, str] | None = None
    method: bytes = b"POST"
    # the Responses API's background mode (D33): the engine answers "queued" and computes
    # on; the ticket is held until the stored response is terminal. response_status: the
    # status the answer showed (a POST's, a retrieval's, a cancel's); response_usage: a
    # retrieval's or cancel's (prompt, cached) tokens, an earlier request's
    background: bool = False
    response_status: str | None = None
    response_usage: tuple[int, int] | None = None
    # a background POST's place under the watch caps, taken before any work (its
    # tenant's share, the gateway's KVGATE_BACKGROUND_WATCH_MAX); watched: a watcher holds
    # that place, the ticket and the tenant's concurrency slot until the response ends
    watch_place: bool = False
    watched: bool = False
    # a watched run's claim check keys (_keep_claim), packed: KEY_BYTES a key, where
    # ``keys``' bytes objects and list slots cost 57 bytes a key, for up to an hour
    claim_keys: bytes = b""
    # admitted as a streamed retrieval (TenantLimiter.admit's replay): released as one
    replay: bool = False

    @property
    def replica(self) -> str:
        return self.decision.replica

    @property
    def frontend_answer(self) -> bool:
        """Its answer comes from the engine's API server without the engine core: no
        evidence of the engine's progress (D17). /tokenize, a retrieval, and a background
        POST's "queued" JSON, answered before the engine computes anything (D33)."""
        return self.endpoint in _FRONTEND_ONLY or (self.background and not self.stream)

    @property
    def ephemeral(self) -> bool:
        return self.scope.ephemeral

    @property
    def uncached_tokens(self) -> int:
        """Its prompt tokens its decision does not predict cached: what admitting it
        charges its tenant's uncached-token budget and counts as its replica's prefill."""
        return max(0, self.prompt_tokens - self.decision.predicted_cached_tokens)

    def load_only_why(self) -> tuple[str, str] | None:
        """Why its decision is by load alone, with no block keys or lookup (a code and a
        sentence, for ``/admin/route/explain``); None for a keyed one. In the router's
        order: an unkeyed request in a sensitive scope is ``unkeyed_*`` there too."""
        if self.previous is not None or self.endpoint in RESPONSE_READS:
            return "pinned", (
                "sent to the replica that stored the response its sealed id names, and "
                "nowhere else (D30): scored by that replica's load alone"
            )
        if self.endpoint in LOAD_ROUTED:
            return "endpoint", (
                "an endpoint routed by load alone (D28, D29): a pooling request's prompts "
                "are computed whole, with no prefix-cache hit to predict, and charged whole; "
                "/tokenize and /detokenize compute nothing (sized 0)"
            )
        if self.unkeyed:
            return "unkeyed", (
                "the engine reads no prefix cache the gateway can key for this request "
                "(media parts, prompt logprobs, a prompt batch, a truncation to a context "
                "no replica's card gives, built-in tools): charged whole"
            )
        if self.scope.ephemeral:
            return "sensitive", (
                "a sensitive scope (a session's or a request's): never looked up nor "
                "indexed; sticky per session among the replicas of about the lowest cost"
            )
        return None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the proxy saw: status, timings, and the engine's usage report."""

    status: int
    ttft_s: float | None
    e2e_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    error: str | None = None


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        policy: Policy | None = None,
        *,
        index: PrefixIndex | None = None,
        load_store: LoadStore | None = None,
        key_store: KeyStore | None = None,
        agent_hook: AgentHook | None = None,
        replica_specs: Sequence[ReplicaSpec] = (),
        span_exporter: Any = None,
        registry: RegistryStore | None = None,
    ) -> None:
        self.settings = settings
        self.policies = PolicyStore(settings.policy if policy is None else None, policy)
        self.policies.on_change = self._apply_policy
        self.policies.check = self._engine_mismatches
        self.policies.prepare = self._load_tokenizers
        pol = self.policies.policy
        self.metrics = GatewayMetrics()
        self.stages = self.metrics.stages
        self.rng = random.Random(settings.seed)
        self._tokenize_rng = random.Random(settings.seed)
        self._ambiguous_models: set[str] = set()  # names already logged as ambiguous
        self.router = Router(pol.routing.params(), self.rng)
        self.fit = self._new_fit(pol)
        secrets = [s.get_secret_value().encode() for s in settings.salt_secrets]
        if not secrets:
            secrets = [uuid.uuid4().hex.encode() + uuid.uuid4().hex.encode()]
            log.warning(
                "no KVGATE_SALT_SECRETS: using a random per-process secret; caches will not "
                "survive a gateway restart and several gateways will not share them"
            )
        try:
            self.minter = SaltMinter(secrets)
        except KeyMaterialError as exc:  # the library's words, with the setting they are about
            raise KeyMaterialError(f"KVGATE_SALT_SECRETS: {exc}") from None
        # sealed response ids (D30): the same secrets, so every gateway sharing them opens
        # them, and a rotation keeps old ids valid while the old secret is listed
        self.response_ids = ResponseIds(secrets)
        if settings.debug_unsafe_shared_scope:
            log.warning(
                "KVGATE_DEBUG_UNSAFE_SHARED_SCOPE is on: ALL TENANTS SHARE ONE CACHE SCOPE "
                "(no isolation); for the attack suite's positive controls only"
            )
        self._keyers: dict[int, BlockKeyer] = {}
        self.limiter = TenantLimiter()
        self.quarantine = QuarantineTracker(pol.quarantine)
        self.inflight = InFlight()
        self.load = LoadTracker(self.inflight)
        self.key_store = key_store or KeyStore(open_access=settings.open_access)
        self.agent_hook = agent_hook
        self._agents_stop: Callable[[], Awaitable[None]] | None = None
        self._index_arg = index
        self._load_store = load_store
        self.client: httpx.AsyncClient | None = None
        # Proxied completions go straight to our own HTTP/1.1 transport (gateway/upstream.py,
        # decision D8): general clients cost more CPU per request than the routing work, and
        # a proxy must not keep one tenant's upstream cookies for the next anyway.
        self.upstream: LeanTransport | None = None
        self.pool: ReplicaPool | None = None
        self.loop_lag: LoopLagMonitor | None = None
        self.index: GatewayIndex | None = None
        self.tokenizers: TokenizerPools | None = None
        self.refresher: SharedLoadRefresher | None = None
        self.specs = list(replica_specs)
        self.registry = registry
        self.discovery: Discovery | None = None
        self.draining = False
        # over the policy's routing.strategy: KVGATE_STRATEGY or kvgate serve --strategy
        self.strategy_override: Strategy | None = settings.strategy
        self.in_flight = 0
        # set while no request is in flight, and for good once the drain is cut (cut_drain):
        # what the stop's drain waits for
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_cut = False
        # the event loop's time by which stop's drain ends at the latest, set by a server
        # that began the drain itself (drain_until): one drain budget, not two
        self._drain_deadline: float | None = None
        self.gateway_id = settings.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self._tracer_provider = make_provider(
            settings.otel_endpoint, settings.otel_service_name, span_exporter
        )
        self.tracer = make_tracer(self._tracer_provider)
        self._warn_at = 0.0
        # (replica, kind) -> its last relay WARNING
        self._relay_warned: dict[tuple[str, str], float] = {}
        self._bg: set[asyncio.Task[None]] = set()
        self._bg_closed = False  # set by stop(): later spawns are cancelled at once
        self._quarantine_watchers: dict[str, asyncio.Task[None]] = {}  # replica -> its watcher
        # background responses whose ticket is held until terminal (D33): (replica, engine
        # response id) -> the POST's dispatch and its watcher
        self._background: dict[tuple[str, str], tuple[Dispatch, asyncio.Task[None]]] = {}
        # places under the watch cap, per tenant: the watched and the background POSTs on
        # their way (taken up front, so a response is never served unwatched)
        self._watch_places: Counter[str] = Counter()
        # their polls and cancels share the client (its pool of KVGATE_MAX_CONNECTIONS)
        # with the health probes and remote tokenization: a replica that hangs its answers
        # holds each for its timeout, and 1024 watched on it took every connection, so
        # every replica's probe failed for want of one. A quarter of the pool at most
        self._poll_slots = asyncio.Semaphore(max(1, settings.max_connections // 4))
        self._settling: Counter[str] = Counter()  # claim checks waiting for their agent
        self.alignment_problems: list[str] = []
        self._started = False  # replicas coming into service are checked from then on
        self._tokenizers_checked = False
        # replicas whose engine answered the block-size check since they last came into
        # service, and those with a check running; any other is checked at its next OK
        # probe (one down at start-up, a discovered one, a restarted engine)
        self._verified: set[str] = set()
        self._verifying: set[str] = set()
        # models.pools entries told to apply to nothing, under the policy in force
        self._unserved_told: set[str] = set()
        self.trace: RequestTrace | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def policy(self) -> Policy:
        return self.policies.policy

    def _new_fit(self, pol: Policy) -> OnlineFit:
        f = pol.cost.fit
        return OnlineFit(
            pol.cost.coefficients(),
            bound=f.bound,
            forgetting=f.forgetting,
            min_samples=f.min_samples,
        )

    def _apply_policy(self, pol: Policy) -> None:
        params = pol.routing.params()
        if params != self.router.params:
            # a new router only when routing changed: its state (round-robin cursor, tie
            # rounds, per-scope trees) survives a reload of limits or quarantine
            self.router = Router(params, self.rng)
        f = pol.cost.fit
        fit = self.fit
        if (
            fit.prior != pol.cost.coefficients()
            or (fit.bound, fit.forgetting, fit.min_samples)
            != (f.bound, f.forgetting, f.min_samples)
            or not f.enabled
        ):
            # the fit starts again from the prior: new settings, or disabled (routing then
            # uses the prior, not what an earlier fit had learned)
            self.fit = self._new_fit(pol)
        was = set(self.quarantine.quarantined())
        self.quarantine.configure(pol.quarantine)
        for rid in was - set(self.quarantine.quarantined()):
            self.metrics.quarantined.labels(rid).set(0)  # disabled: released
        if self.pool is not None:
            self.pool.policy = pol.health
        if self.tokenizers is not None:
            self.tokenizers.retain(pol.models)
        self.metrics.policy_reloads.labels("ok").inc()
        self._unserved_told.clear()  # a new policy: its pools are told again
        self._warn_unserved_pools(pol)

    def _warn_unserved_pools(self, pol: Policy) -> None:
        """A WARNING for each ``models.pools`` entry no replica serves as a base model (a
        typo of the model's name: its block size, tokenizer or hit_drop_blocks would never
        apply, the block-size check skipping it too), once per policy, when every replica's
        model list is known (one not read yet may serve it). An adapter's name says so: its
        requests use its base model's pool."""
        reps = self.pool.all() if self.pool is not None else []
        if not reps or any(r.models is None for r in reps):
            return
        bases = {m for r in reps for m in _base_models(r)}
        adapters = {m for r in reps for m in r.models or [] if m in r.lora_base}
        for name in sorted(set(pol.models.pools) - bases - self._unserved_told):
            self._unserved_told.add(name)
            log.warning(
                "a policy model pool applies to no model the replicas serve",
                extra={
                    "field": f"models.pools.{name}",
                    "reason": "an adapter: its requests use its base model's pool"
                    if name in adapters
                    else "no replica serves this model",
                    "served": ", ".join(sorted(bases)),
                },
            )

    async def _load_tokenizers(self, pol: Policy) -> list[tuple[str, str]]:
        # a reload's last check (PolicyStore.prepare); before start, start loads them
        return [] if self.tokenizers is None else await self.tokenizers.load_hf(pol.models)

    def _engine_mismatches(self, pol: Policy) -> list[tuple[str, str]]:
        """A reloaded policy's block sizes against those the engines are known to use (read
        at start-up, or registered by their agents): a mismatch makes every key miss, so
        such a reload is refused as the start-up check would have reported it."""
        problems: list[tuple[str, str]] = []
        for rep in self.pool.all() if self.pool is not None else []:
            if rep.block_size is None or rep.models is None:
                continue  # what it serves is not known yet: nothing to hold it to
            for model in sorted(m for m in rep.models if m not in rep.lora_base) or ["default"]:
                field = f"models.pools.{model}" if model in pol.models.pools else "models.default"
                bs = pol.models.pool(model).block_size
                if bs != rep.block_size:
                    msg = f"{bs}, but replica {rep.id} serves {model} with block size "
                    problems.append((f"{field}.block_size", msg + str(rep.block_size)))
        return sorted(set(problems))

    def _departed(self, replica: str) -> bool:
        """``replica`` is no longer in the pool: a probe or check that was out when it was
        removed reports late, and must not make again what its removal dropped."""
        return self.pool is not None and self.pool.get(replica) is None

    def _on_health(self, replica: str, routable: bool) -> None:
        if self._departed(replica):
            return
        self.metrics.healthy.labels(replica).set(1 if routable else 0)
        if not routable:
            # back in service it may be another engine (a restart with another config): it
            # is checked again at its next OK probe
            self._verified.discard(replica)

    def _on_inconclusive(self, replica: str) -> None:
        if not self._departed(replica):
            self.metrics.health_inconclusive.labels(replica).inc()

    def _replica_removed(self, replica: str) -> None:
        """Discovery removed ``replica`` for good (past its grace): what the gateway keeps
        per replica id goes with it, or autoscaled fleets (fresh ids at each scale-up) grow
        its memory and /metrics for its whole life. Back under the same id it is a new
        replica. A request still in flight there ends without it, except its latency
        histograms and upstream error counts, which its end makes again (bounded by the
        requests outliving their replica's removal, past the registration's grace)."""
        if self.index is not None:
            self.index.forget(replica)
        self.inflight.forget(replica)
        self.router.forget(replica)
        self.quarantine.forget(replica)
        watcher = self._quarantine_watchers.pop(replica, None)
        if watcher is not None:
            watcher.cancel()
        self._verified.discard(replica)
        self.metrics.forget_replica(replica)

    def _on_probe_ok(self, replica: str) -> None:
        if (
            self._started
            and not self.draining
            and replica not in self._verified
            and replica not in self._verifying
        ):
            self.spawn(self._check_replica(replica))

    async def start(self) -> None:
        """Start serving: the clients, the index, the background tasks and the checks, in
        that order. A start that raises part way (a refused policy, a failing agent, a
        cancellation) stops and closes what it had made (:meth:`stop`) before it raises, the
        original exception as it was: nobody else stops a gateway whose start failed
        (uvicorn does not run the lifespan's shutdown then), and its client, tasks, trace
        file and Redis connections stayed open for the rest of the process. A failure of
        that clean-up is logged, not raised in its place; so is a cancellation that arrives
        during it, which :meth:`stop` does not let cut it short."""
        try:
            await self._start()
        except GeneratorExit:  # the coroutine closed unawaited (its loop gone): no awaiting
            raise
        except BaseException:
            try:
                await self.stop()
            except asyncio.CancelledError:
                # cancelled again: stop ran every step all the same. The start's own
                # exception is raised (as a TaskGroup raises its errors over a cancellation)
                log.warning("the gateway's failed start was cancelled again while it stopped")
            except Exception:
                log.exception("stopping the gateway after its failed start failed too")
            raise

    async def _start(self) -> None:
        s = self.settings
        limits = httpx.Limits(
            max_connections=s.max_connections,
            max_keepalive_connections=s.max_connections,
            keepalive_expiry=60.0,
        )
        if s.trace_out is not None:
            self.trace = RequestTrace(s.trace_out)
            self.trace.start()
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(s.connect_timeout_s))
        self.upstream = LeanTransport(max_connections=s.max_connections)
        # started before the first health round: a gateway starved from its start (a
        # throttled container) would otherwise mark every replica unhealthy at once
        self.loop_lag = LoopLagMonitor(on_lag=self.metrics.loop_lag.observe)
        self.loop_lag.start()
        self.pool = ReplicaPool(
            self.client,
            self.policy.health,
            on_change=self._on_health,
            on_probe_ok=self._on_probe_ok,
            loop_lag=self.loop_lag,
            on_inconclusive=self._on_inconclusive,
        )
        self.tokenizers = TokenizerPools(
            self.client, self._any_replica_url, s.tokenizer_cache_tokens
        )
        problems = await self.tokenizers.load_hf(self.policy.models)
        if problems:  # refused as a reload would be: before serving any of its requests
            raise PolicyError(str(self.policies.path or "<policy>"), problems)
        for spec in self.specs:
            self.pool.add(spec)
            self.metrics.healthy.labels(spec.id).set(1)
        embedded = self._index_arg is None
        primary: PrefixIndex = (
            self._index_arg if self._index_arg is not None else self._embedded_index()
        )
        local = None if isinstance(primary, MemoryIndex) else MemoryIndex()
        if isinstance(primary, RedisIndex):
            unreadable = self.metrics.index_unreadable
            primary.on_unreadable = lambda rid: unreadable.labels(rid).inc()
        self.index = GatewayIndex(primary, self.metrics, local)
        if isinstance(primary, RedisIndex):
            await self._check_eviction_policy(primary)
        if local is not None and self.specs:
            await self._warm_index(primary)
        if embedded or isinstance(primary, MemoryIndex):
            # no agent reports these replicas' state to an in-process index; pending
            # entries (the gateway's own decisions) must still count
            now = _now_ms()
            for spec in self.specs:
                if (await primary.meta(spec.id)).state is ReplicaState.UNKNOWN:
                    await primary.set_state(spec.id, ReplicaState.LIVE, now)
        if self._load_store is not None:
            self.refresher = SharedLoadRefresher(
                self._load_store,
                self.gateway_id,
                self.inflight,
                self.pool.ids,
                grace_ms=lambda: self.policy.routing.overdue_grace_ms,
                coeffs=lambda: self.fit.coefficients(),
            )
            self.load.set_shared(self.refresher.snapshot)
            self.refresher.start()
        agent_specs = [sp for sp in self.specs if sp.events]
        if agent_specs:
            if self.agent_hook is None:
                log.warning("replica agent endpoints given but no embedded agent is wired")
            else:
                self._agents_stop = await self.agent_hook(
                    agent_specs, primary, self._load_store, self.metrics.registry
                )
        if self.registry is not None:
            allow = ReplicaAllowlist(
                [f"{sp.id}={sp.url}" for sp in self.specs] + list(s.replica_allowlist)
            )
            self.discovery = Discovery(
                self.registry, allow, self.pool, {sp.id for sp in self.specs},
                on_added=lambda sp: self.metrics.healthy.labels(sp.id).set(1),
                on_count=lambda outcome, n: self.metrics.discovery.labels(outcome).inc(n),
                on_removed=self._replica_removed,
            )  # fmt: skip
            await self.discovery.refresh_once()
            self.discovery.start()
        await self.pool.check_once(refresh_models=True)
        self.pool.start()
        self.policies.start(s.policy_poll_s, self._on_reload_result)
        await self._check_alignment()

    def _embedded_index(self) -> MemoryIndex:
        """The in-process index. Its removal log (the gateways' claim checks read it) is
        the agents' setting, ``KVGATE_AGENT_REMOVAL_LOG``, read as the embedded agents
        read theirs; a standalone agent applies it to the Redis index itself."""
        spec = next((sp for sp in self.specs if sp.events), None)
        if spec is None:
            return MemoryIndex()
        return MemoryIndex(removal_log=embedded_agent_settings(spec).removal_log)

    async def _warm_index(self, primary: PrefixIndex) -> None:
        """One throw-away lookup before serving: it loads the lookup script and, on Redis
        Cluster, the slot map and command table (~10 ms on loopback), which would otherwise
        land on the first requests and overrun their lookup budget. A failure only logs:
        requests fall back to local decisions until the index answers."""
        ids = [sp.id for sp in self.specs]
        try:
            # not wait_for, here and below: on 3.11 it swallows a cancellation that arrives
            # as the awaited call completes (a shutdown during start-up went on starting)
            async with asyncio.timeout(5.0):
                await primary.lookup([bytes(16)], ids, _now_ms())
        except Exception as exc:
            log.warning("index warm-up lookup failed", extra={"error": repr(exc)})

    def _on_reload_result(self, ok: bool, error: str) -> None:
        if not ok:
            self.metrics.policy_reloads.labels("invalid").inc()

    async def _check_alignment(self) -> None:
        """At start-up: every healthy replica's block size, and the tokenizers against the
        first one. Any other replica is checked at its OK health probes until its engine
        answers (:meth:`_on_probe_ok`); the tokenizers then, if no replica was healthy here."""
        assert self.pool is not None
        self._started = True
        reps = [r for r in self.pool.all() if r.healthy]
        if not reps:
            log.warning(
                "no replica is healthy at start-up: the block size and tokenizer checks "
                "run when one comes into service"
            )
            return
        await asyncio.gather(*(self._check_replica(r.id) for r in reps))

    async def _check_replica(self, replica_id: str) -> None:
        """One replica's block size against the policy's (it is verified once its engine
        answered), and the tokenizers on the first replica checked."""
        rep = self.pool.get(replica_id) if self.pool is not None else None
        if rep is None or replica_id in self._verifying:
            return
        self._verifying.add(replica_id)
        try:
            ok = await self._check_block_size(rep, _base_models(rep))
            if ok and self.pool is not None and self.pool.get(replica_id) is rep:
                self._verified.add(replica_id)  # not a replica removed meanwhile
            self._warn_unserved_pools(self.policy)  # its models are known now
            if not self._tokenizers_checked:
                self._tokenizers_checked = True
                await self._check_tokenizers(rep, _base_models(rep))
        finally:
            self._verifying.discard(replica_id)

    def _alignment_problem(self, problem: str) -> None:
        self.metrics.alignment.inc()
        if problem not in self.alignment_problems:  # a replica back in service, again
            self.alignment_problems.append(problem)

    async def _check_tokenizers(self, rep: Replica, models: Sequence[str]) -> None:
        """The gateway's tokens against ``rep``'s engine for up to four of its models."""
        assert self.tokenizers is not None and self.client is not None
        pools: dict[str, Any] = {}
        engine_pools: dict[str, Any] = {}
        for m in models[:4] or ["default"]:
            pool = self.policy.models.pool(m)
            if pool.alignment_check and pool.tokenizer in ("builtin", "hf"):
                pools[m] = pool
            elif pool.tokenizer in ("engine_render", "engine_tokenize"):
                engine_pools[m] = pool
        for model, pool in engine_pools.items():
            # the engine tokenizes this pool: it must answer (vLLM 0.33 serves the render
            # endpoint only with --enable-scale-out; without it every request is a 502)
            tokenizer = self.tokenizers.for_pool(model, pool)
            probe = {"model": model, "messages": [{"role": "user", "content": "hello"}]}
            try:
                await tokenizer.chat(probe, self.minter.salt(Scope(ScopeKind.TENANT, "probe")))
            except GatewayError as exc:
                self._alignment_problem(f"{model}: {pool.tokenizer}: {exc.message}")
                log.error(
                    "the engine does not tokenize for this pool: its requests will fail",
                    extra={"model": model, "tokenizer": pool.tokenizer, "problem": exc.message},
                )
        for model, pool in pools.items():
            tok = self.tokenizers.local(pool)
            problems = await check_alignment(
                self.client, rep.url, model, tok, server=pool.chat_defaults
            )
            for p in problems:
                self._alignment_problem(f"{model}: {p}")
                log.error(
                    "TOKENIZER MISALIGNED with the engine: prefix routing will not hit",
                    extra={"model": model, "replica": rep.id, "problem": p},
                )

    async def _check_block_size(self, rep: Replica, models: Sequence[str]) -> bool:
        """The policy's block size per pool against the engine's (vLLM's
        ``vllm:cache_config_info{block_size}``): a mismatch makes every key miss. False
        when the engine did not answer with its metrics (checked again later)."""
        assert self.client is not None
        try:
            # the whole answer within 2 s and a few MiB: start-up awaits this check
            status, body = await bounded_answer(self.client, "GET", rep.url + "/metrics", 2.0)
        except (httpx.HTTPError, TimeoutError):
            return False  # not reachable yet, or no whole answer in time: checked again
        except AnswerTooLarge:
            log.warning(
                "the engine's /metrics is too large to read: block size unchecked",
                extra={"replica": rep.id},
            )
            return True
        if status != 200:
            return status == 404  # no metrics at all: nothing to compare, ever
        try:
            engine_bs = parse_metrics(body.decode("utf-8", "replace")).block_size
        except ScrapeError:
            return True  # not a metrics page (a proxy's catch-all): nothing to compare
        if engine_bs is None:
            return True  # the engine does not say: nothing to compare
        rep.block_size = engine_bs  # a reload is checked against it
        for model in models[:4] or ["default"]:
            bs = self.policy.models.pool(model).block_size
            if bs != engine_bs:
                problem = f"{model}: policy block_size {bs} but the engine's is {engine_bs}"
                self._alignment_problem(problem)
                log.error(
                    "BLOCK SIZE MISMATCH with the engine: no prefix key will match",
                    extra={"model": model, "replica": rep.id, "problem": problem},
                )
        return True

    async def stop(self) -> None:
        """Drain, then stop and close what the gateway started and the stores it owns.
        Safe on a gateway whose start failed part way (what it never made is skipped; the
        index it was given is closed even when start never wrapped it) and called again.
        Each step runs even when an earlier one failed (a failing agent stop left the
        index, the stores, the client and the trace file open): a failure is logged and the
        first one raised once all ran. The background tasks are cancelled and waited for
        (at most :data:`BACKGROUND_STOP_S`) before the index and the stores close.

        A stop that is cancelled (a second shutdown signal, a start-up cancelled again while
        it cleaned up) ends its drain at once but runs every step to its end, in a task of
        its own the cancellation does not reach, then ends cancelled: cancelled in one step,
        it left those after it (the agents, the index, the stores, the client, the trace
        file) open. A step that blocks is cancelled after its bound (:data:`STOP_STEP_S`;
        the embedded agents' step, their own stop's limit) and counts as failed; the next
        one runs. After :meth:`cut_drain` (a force-quit, a cancellation the caller held) it
        does not drain at all; after :meth:`drain_until` it drains no later than that."""
        self.draining = True
        cancelled: asyncio.CancelledError | None = None
        drain_s = self.settings.drain_timeout_s
        if self._drain_deadline is not None:  # what is left of the server's drain budget
            left_s = self._drain_deadline - asyncio.get_running_loop().time()
            drain_s = min(drain_s, max(0.0, left_s))
        try:
            async with asyncio.timeout(drain_s):
                await self._idle.wait()  # set unless a request is in flight or drain cut
        except TimeoutError:
            log.warning(
                "drain timeout: closing with requests in flight", extra={"n": self.in_flight}
            )
        except asyncio.CancelledError as exc:
            cancelled = exc  # no more draining; the steps still run
        else:
            if self.in_flight > 0:  # the drain was cut
                log.warning(
                    "drain cut: closing with requests in flight", extra={"n": self.in_flight}
                )
        steps = self._stop_steps(asyncio.current_task())
        # the per-step bounds are the real ones; this one stops a step that ignores its
        # cancellation from holding the caller for ever
        limit_s = sum(bound_s or 0.0 for _, _, bound_s in steps) + STOP_STEP_S
        try:
            await run_to_end(run_steps(steps, "gateway stop"), limit_s, "gateway stop")
        except Exception:
            if cancelled is None:
                raise
            # logged by its step: the caller's cancellation is what this stop ends with
        if cancelled is not None:
            raise cancelled

    def cut_drain(self) -> None:
        """End :meth:`stop`'s wait for the requests in flight now, or skip it in a stop to
        come: the stop goes on to its steps at once, and closes what requests still running
        use, as at the drain timeout. For a stop that must not wait (a force-quit that has
        cut the requests, a cancellation its caller held until the stop); new requests are
        refused (``draining``). Call it in the event loop's thread."""
        self.draining = True
        self._drain_cut = True
        self._idle.set()

    def drain_until(self, deadline: float) -> None:
        """End the wait for the requests in flight of a :meth:`stop` that begins after this
        call by ``deadline`` (the event loop's ``time()``) at the latest, besides its own
        ``drain_timeout_s``: for a server that began the drain itself and has spent part of
        the budget waiting for them (``kvgate serve``: uvicorn's wait, then the lifespan's
        stop; a full drain in each made a stop last the drain timeout twice). Without it
        (an embedded gateway) the stop drains for its full timeout.

        The contract, exactly: :meth:`stop` reads the deadline once, as its drain begins,
        and drains for ``min(drain_timeout_s, deadline - now)`` (none once it has passed).
        A call while a stop is already draining does not change that drain, even to an
        earlier deadline: end a drain under way with :meth:`cut_drain`. Each call replaces
        the deadline of the one before (the last call wins, later or earlier). ``kvgate
        serve`` (and ``GatewayServer``, ``serve_in_loop``) call it once, as uvicorn's wait
        begins, before the lifespan's stop: no stop is draining then, and a second SIGTERM
        or a force-quit never calls it again (the force-quit calls :meth:`cut_drain`). Call
        it in the event loop's thread."""
        self._drain_deadline = deadline

    def _stop_steps(self, caller: asyncio.Task[Any] | None) -> list[Step]:
        """:meth:`stop`'s steps in order, those of what exists (each idempotent), each with
        its bound. ``caller``: the task that called stop (not waited for if a background
        task)."""
        s = STOP_STEP_S
        steps: list[Step] = []
        steps.append(("policy poller", self.policies.stop, s))  # no-op if never started
        if self.discovery is not None:
            steps.append(("discovery", self.discovery.stop, s))
        if self.pool is not None:
            steps.append(("health checks", self.pool.stop, s))
        if self.loop_lag is not None:
            steps.append(("loop lag monitor", self.loop_lag.stop, s))
        if self._agents_stop is not None:
            steps.append(("embedded agents", self._stop_agents, self._agents_stop_bound_s()))
        if self.refresher is not None:
            steps.append(("load refresher", self.refresher.stop, s))
        steps.append(("background tasks", lambda: self._cancel_background(caller), s))
        if self.index is not None:
            steps.append(("index", self.index.close, s))
        elif self._index_arg is not None:  # start failed before wrapping it: still ours
            steps.append(("index", self._index_arg.close, s))
        # the gateway owns the stores it was given, as it owns its index: closed last, once
        # the refresher has dropped this gateway's counts and discovery and the agents
        # stopped (each close swallows a Redis that is gone)
        if self._load_store is not None:
            steps.append(("load store", self._load_store.close, s))
        if self.registry is not None:
            steps.append(("registry", self.registry.close, s))
        steps.append(("key store", self.key_store.close, s))
        if self.client is not None:
            steps.append(("http client", self.client.aclose, s))
        if self.upstream is not None:
            steps.append(("upstream transport", self.upstream.aclose, s))
        if self._tracer_provider is not None:
            steps.append(("tracer", self._shutdown_tracer, s))
        if self.trace is not None:
            steps.append(("request trace", self.trace.close, s))
        return steps

    def _agents_stop_bound_s(self) -> float:
        """The embedded agents' step's bound, derived from their stop's own limit (with
        run_to_end's grace past it), never shorter: at :data:`STOP_STEP_S` an agent's stop
        still within its own limit (~52 s) was given up on and ran on past the close of the
        index and the stores."""
        stop = self._agents_stop
        if isinstance(stop, BoundedStop):
            return enclosing_limit_s(stop.stop_limit_s)
        return STOP_STEP_S  # a hook that does not say how long its stop takes

    async def _stop_agents(self) -> None:
        stop, self._agents_stop = self._agents_stop, None  # once: a second stop skips them
        if stop is not None:
            await stop()

    async def _cancel_background(self, caller: asyncio.Task[Any] | None) -> None:
        """Cancel the one-shot background tasks (replica and claim checks, quarantine
        watchers) and wait until they have ended, before the index and the stores close
        under them: a cancelled task runs on to its next ``await`` and through its clean-up,
        and one still reading or writing the index or a store after stop returned touched
        closed clients. Bounded: a task that swallows its cancellation is cancelled again,
        and one that outlives :data:`BACKGROUND_STOP_S` is logged and left (shutdown goes
        on). ``caller``, the task that called :meth:`stop`, is not waited for: it waits for
        this."""
        self._bg_closed = True  # from here on spawn() cancels what it is given
        tasks = [t for t in self._bg if t is not caller]
        if tasks:
            grace_s = BACKGROUND_STOP_S / BACKGROUND_STOP_CANCELS
            await cancel_and_wait(*tasks, grace_s=grace_s, attempts=BACKGROUND_STOP_CANCELS)

    async def _shutdown_tracer(self) -> None:
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()

    def _any_replica_url(self, model: str, tried: Collection[str] = ()) -> str | None:
        if self.pool is None:
            return None
        reps = [r for r in self.pool.candidates(model) if r.url not in tried]
        # its own RNG: the routing RNG must not move for a tokenization (an explain then
        # changed the next real routing decision; D9's rounds and `random` draw from it)
        return self._tokenize_rng.choice(reps).url if reps else None

    def keyer(self, block_size: int) -> BlockKeyer:
        k = self._keyers.get(block_size)
        if k is None:
            k = self._keyers[block_size] = BlockKeyer(block_size)
        return k

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        if self._bg_closed:
            # stop() has cancelled and awaited the background tasks: one spawned now (a
            # claim check of a request still in flight after the drain timeout) would read
            # the index and the stores while they close. Cancelled before its first step,
            # its coroutine never runs.
            task.cancel()
            return task
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def background_settled(self) -> bool:
        """No one-shot background task (a claim check, a replica check) is running; the
        quarantine watchers, which live as long as their quarantine, and the background
        responses' (D33), which live as long as their response, do not count."""
        watchers = {*self._quarantine_watchers.values(), *(t for _, t in self._background.values())}
        return all(t in watchers for t in self._bg)

    def begin(self) -> None:
        self.in_flight += 1
        if not self._drain_cut:
            self._idle.clear()
        self.metrics.in_flight.set(self.in_flight)

    def end(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.set(self.in_flight)
        if self.in_flight <= 0:
            self._idle.set()

    # ------------------------------------------------------------------ scope
    def resolve_scope(
        self,
        tenant: str,
        tpol: TenantPolicy,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        model: str,
        base_model: str | None = None,
    ) -> tuple[Scope, str | None]:
        """The request's isolation scope and its session key (for stickiness).
        ``sensitive.models`` covers a listed model's adapters: ``base_model`` is the model
        an adapter request runs on (its prompts are the listed model's as much); and every
        name the replicas serve a listed model by (an alias named in the request was keyed
        in the tenant's scope: tests/test_h29_redteam_aliases.py)."""
        kind: str = tpol.sensitive.default
        if self._sensitive_model(tpol.sensitive.models, model, base_model):
            kind = _stricter(kind, tpol.sensitive.models_kind)
        asked = headers.get(SENSITIVE_HEADER)
        if asked is not None:
            asked = asked.strip().lower()
            if asked not in ("session", "request"):
                raise bad_request(f"{SENSITIVE_HEADER} must be 'session' or 'request'")
            if not tpol.sensitive.allow_header:
                raise GatewayError(
                    403, f"this key may not set {SENSITIVE_HEADER}", code="sensitive_not_allowed"
                )
            kind = _stricter(kind, asked)
        session = None
        for h in SESSION_HEADERS:
            if headers.get(h):
                session = _session_id(headers[h])
                break
        if session is None and isinstance(body.get("user"), str) and body["user"]:
            session = _session_id(body["user"])
        if kind == "session" and session:
            return Scope(ScopeKind.SESSION, f"{tenant}/{session}"), f"{tenant}/{session}"
        if kind in ("session", "request"):
            # a session-scoped request without a session id cannot be reused: per request
            return Scope(ScopeKind.REQUEST, f"{tenant}/{random_hex(16)}"), None
        if self.settings.debug_unsafe_shared_scope:
            return Scope(ScopeKind.TENANT, DEBUG_SHARED_SCOPE), session and f"{tenant}/{session}"
        if tpol.trust_group is not None:
            return Scope(ScopeKind.GROUP, tpol.trust_group), session and f"{tenant}/{session}"
        return Scope(ScopeKind.TENANT, tenant), session and f"{tenant}/{session}"

    def _sensitive_model(self, listed: Collection[str], model: str, base: str | None) -> bool:
        """Whether ``model`` (or ``base``, the model an adapter runs on) is listed under any
        name the replicas serve it by."""
        if not listed:
            return False
        if model in listed or base in listed:
            return True
        if self.pool is None:
            return False
        names = self.pool.model_names
        return any(n in listed for m in {model, base or model} for n in names(m))

    # ------------------------------------------------------------------ prepare
    async def prepare(
        self,
        endpoint: str,
        tenant: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        request_id: str,
        explain_only: bool = False,
        strategy: Strategy | None = None,
    ) -> Dispatch:
        """Everything before the upstream call. Raises :class:`GatewayError`. A background
        POST first takes its place under the watch caps (D33), before any charge or
        routing; the caller ends it with :meth:`release_admission`."""
        place = endpoint == "responses" and body.get("background") is True and not explain_only
        if place:
            try:
                self._take_watch_place(tenant)
            except GatewayError:
                # admitted just before (app: TenantLimiter.admit took a rate token): a
                # refusal for the watch caps, sent back before any work, gives it back
                self.limiter.refund_request(tenant, time.monotonic())
                raise
        try:
            d = await self._prepare(
                endpoint, tenant, body, headers, request_id, explain_only, strategy
            )
        except BaseException:
            if place:
                self._give_watch_place(tenant)
            raise
        d.watch_place = place
        return d

    async def _prepare(
        self,
        endpoint: str,
        tenant: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        request_id: str,
        explain_only: bool,
        strategy: Strategy | None,
    ) -> Dispatch:
        if endpoint in LOAD_ROUTED:
            return await self._prepare_by_load(
                endpoint, tenant, body, headers, request_id, explain_only, strategy
            )
        responses = endpoint == "responses"
        if responses and not isinstance(body.get("background"), bool | None):
            # the gateway holds a background response's ticket until it is terminal (D33):
            # it must read the field as the engine does
            raise bad_request("'background' must be a boolean", "background")
        if endpoint in RESPONSE_READS or (
            responses and body.get("previous_response_id") is not None
        ):
            return await self._prepare_pinned(
                endpoint, tenant, body, headers, request_id, explain_only
            )
        assert self.pool is not None and self.tokenizers is not None and self.index is not None
        st = self.stages
        pol = self.policy
        t0 = time.perf_counter_ns()
        model, model_given = self._request_model(body)
        stream = stream_requested(body)
        # a Responses stream carries its usage in response.completed, which goes to the
        # client whatever: it is read there, never asked for
        wants_usage = responses or usage_requested(body)  # a 400 before any work
        if endpoint == "chat" and not isinstance(body.get("messages"), list):
            raise bad_request("'messages' is required and must be an array", "messages")
        # a Responses request's prompt is a chat's (its instructions and input as the
        # engine renders them, function tools included): keyed, sized and routed as that
        # chat; tools the gateway cannot render (built-ins) route it by load, unkeyed
        src, tools_exact = _responses_chat(body, model) if responses else (body, True)
        if endpoint == "chat":  # its messages as vLLM's chat completion model reads them
            msgs = chat_completion_messages(body["messages"])
            src = body if msgs is body["messages"] else {**body, "messages": msgs}
        if endpoint == "completion" and "prompt" not in body:
            raise bad_request("'prompt' is required", "prompt")
        reps = self._routable(model)
        tpol = pol.tenant(tenant)
        priority: tuple[int | None, bool] = (None, False)
        if "priority" in body or tpol.priority.mode in _PRIORITY_SET:
            priority = _priority_rewrite(tpol.priority, body)  # a 400 before any work
        base_model, lora = self.pool.base_model(model, reps)
        scope, session = self.resolve_scope(tenant, tpol, headers, body, model, base_model)
        if responses and body.get("background") and scope.kind is ScopeKind.REQUEST:
            # that scope stores nothing (its promise), and vLLM refuses background without
            # store (D33)
            raise bad_request(
                "a request-scoped (sensitive) request cannot run in the background: its "
                "response is not stored; send it without 'background'",
                "background",
            )
        reps = self._one_meaning(model, lora, base_model, reps)
        mpool = pol.models.pool(base_model)
        if responses and mpool.chat_defaults.excludes_tools(body.get("tool_choice")):
            # the pool's engines leave its tools out of the prompt (read, so validated, above)
            src, tools_exact = _responses_chat(body, model, mpool.chat_defaults)
        bs = mpool.block_size
        # an engine that tokenizes must serve the requested model (an adapter too)
        tokenizer = self.tokenizers.for_pool(model, mpool)
        st.add("parse", time.perf_counter_ns() - t0)

        t0 = time.perf_counter_ns()
        # a request the engine serves without reading its prefix cache (prompt logprobs,
        # cachecore.cacheread) is routed by load and judged by nothing, as a media request:
        # a hit buys it nothing, its cached_tokens of 0 is no verdict on the replica's
        # claims, and the budget charges its whole prompt, which the engine computes
        chat = endpoint == "chat" or responses
        unkeyed = not body_reads_prefix_cache(src, chat) or not tools_exact
        # truncate_prompt_tokens: the engine runs only the prompt's last (or first) k
        # tokens, so those are keyed, sized and charged; -1 (the model's context) when no
        # replica's card gives its max_model_len: routed by load, charged whole
        trunc, trunc_known = request_truncation(
            src, chat, lambda: _context_len(reps, model, base_model)
        )
        unkeyed = unkeyed or not trunc_known
        # a batch of prompts (/v1/completions): vLLM runs one engine request per prompt.
        # Sized and charged as the sum of its prompts and routed by load (no one prefix
        # to key or check claims by; a confined tenant's batch is cold)
        n_batch = 1 if chat else completion_batch_size(body)
        if n_batch > self.settings.max_prompt_batch:
            # each prompt is an engine request, sized before the budget can refuse any
            raise bad_request(
                f"'prompt' holds {n_batch} prompts, more than this gateway takes in one "
                f"request ({self.settings.max_prompt_batch}): send them in smaller batches",
                "prompt",
            )
        batch = n_batch > 1
        unkeyed = unkeyed or batch
        media_tokens = 0
        lengths: list[int] | None = None
        if isinstance(tokenizer, LocalPromptTokenizer):
            # the segment cache is per scope (a shared one is a cross-tenant timing channel)
            cs = None if scope.kind is ScopeKind.REQUEST else scope.canonical()
            off = self.settings.tokenize_offload_chars  # long text: BPE off the event loop
            if chat:
                # images, audio: vLLM keys their blocks with the items' hashes, which we
                # cannot; such a request is sized by its text and routed by load alone
                text_only, media_parts = strip_media(src.get("messages"))
                unkeyed = unkeyed or media_parts > 0
                media_tokens = media_parts * mpool.media_part_tokens
                chat_body = {**src, "messages": text_only} if media_parts else src
                # a Responses request's template kwargs render as vLLM's Responses path's,
                # over the pool's engines' default kwargs, its effort mapped as theirs
                tokens = await tokenizer.chat(
                    chat_body,
                    cs,
                    off,
                    trunc,
                    form="responses" if responses else "chat",
                    server=mpool.chat_defaults,
                )
                packed: Sequence[int] = tokens
            elif batch:
                lengths = await tokenizer.prompt_lengths(body, cs, off, trunc)
                tokens = []
                packed = tokens
            else:
                # a token-id prompt comes packed by its check: the keys need no second pass
                tokens, packed = await tokenizer.completion_packed(body, cs, off, trunc)
        else:
            # the engine tokenizes: under the scope's salt, so no cache of the engine's
            # is shared between scopes (the same timing channel as the segment cache's)
            salt = self.minter.salt(scope)
            if batch:
                off = self.settings.tokenize_offload_chars  # sized locally: see its doc
                lengths = await tokenizer.prompt_lengths(body, salt, off)
                if trunc is not None:
                    lengths = [min(n, trunc.keep) for n in lengths]
                tokens = []
            else:
                tokens = await (
                    tokenizer.chat(src, salt) if chat else tokenizer.completion(body, salt)
                )
            if trunc is not None and len(tokens) > trunc.keep:
                # exact for token ids and text without special tokens; the engine's
                # tokenizer keeps a BOS it added, which the gateway cannot place: sized
                if add_special_tokens(src, not chat) and (
                    chat or isinstance(completion_prompt(body), str)
                ):
                    unkeyed = True
                tokens = tokens[trunc.kept(len(tokens))]
            packed = tokens
        st.add("tokenize", time.perf_counter_ns() - t0)
        # media parts count at the pool's estimate: for the cost and the flooding budget
        n_prompt = len(tokens) + media_tokens if lengths is None else sum(lengths)
        if trunc is not None and lengths is None:  # media parts are in the truncated part
            n_prompt = min(n_prompt, trunc.keep)

        t0 = time.perf_counter_ns()
        salts = [self.minter.salt(scope)] if scope.ephemeral else self.minter.salts(scope)
        keys: list[list[BlockKey]] = []
        if not scope.ephemeral and not unkeyed:
            keyer = self.keyer(bs)
            cap = min(hit_cap_blocks(n_prompt, bs), pol.index.max_prompt_blocks)
            # under the name the agents key by: an engine's first served name (vLLM's
            # --served-model-name a b serves one model as a and b; its agent keys as a), so
            # a request naming b predicts the hits a's requests left, and the other way round
            key_model = self.pool.model_names(base_model)[0]
            keys = [keyer.keys(packed, s, key_model, lora, max_blocks=cap) for s in salts]
        st.add("keys", time.perf_counter_ns() - t0)

        t0 = time.perf_counter_ns()
        ids = [r.id for r in reps]
        matches: list[dict[str, PrefixMatch]] = []
        source = "none"
        now = 0
        if keys and keys[0]:
            now = _now_ms()
            timeout = pol.index.lookup_timeout_ms / 1000.0
            results: list[LookupResult]
            if len(keys) == 1:
                results = [await self.index.lookup(keys[0], ids, now, timeout)]
            else:
                results = list(
                    await asyncio.gather(*(self.index.lookup(k, ids, now, timeout) for k in keys))
                )
            matches = [r.matches for r in results]
            source = results[0].source
        st.add("lookup", time.perf_counter_ns() - t0)

        t0 = time.perf_counter_ns()
        coeffs = self.fit.coefficients()
        cands, best_salt = self._candidates(reps, mpool.max_num_seqs, coeffs, matches)
        cold = _cold_replicas(tenant, tpol, ids)
        if session is None and keys and keys[0]:
            session_for_hash: str | None = f"{tenant}/{keys[0][0].hex()}"
        else:
            session_for_hash = session
        req = RouteRequest(
            prompt_tokens=n_prompt,
            block_size=bs,
            session_key=session_for_hash,
            load_only=scope.ephemeral or unkeyed,
            unkeyed=unkeyed,
            cold_replicas=cold,
            scope_key=scope.routing_key(),  # its tie rounds and draws (D26)
            hit_drop_blocks=mpool.hit_drop_blocks,
        )
        decision, cands = self._decide(
            req, cands, coeffs, strategy or self.strategy_override, model, explain_only
        )
        st.add("score", time.perf_counter_ns() - t0)
        d = Dispatch(
            request_id=request_id,
            upstream_id=f"{request_id}-{random_hex(8)}",
            tenant=tenant,
            endpoint=endpoint,
            path=ENDPOINT_PATHS[endpoint],
            body=body,
            stream=stream,
            client_wants_usage=wants_usage,
            model=model,
            model_given=model_given,
            prompt_tokens=n_prompt,
            block_size=bs,
            scope=scope,
            salts=salts,
            keys=keys,
            matches=matches,
            index_source=source,
            candidates=cands,
            decision=decision,
            salt_index=best_salt.get(decision.replica, 0),
            lookup_ms=now,
            unkeyed=unkeyed,
            media_uuids=endpoint == "chat" and media_uuids(body.get("messages")),
            cold_replicas=cold,
            priority=priority[0],
            drop_priority=priority[1],
            hit_drop_blocks=mpool.hit_drop_blocks,
            response_id=f"resp_{random_hex(16)}" if responses else None,
            background=responses and body.get("background") is True,
        )
        if explain_only:
            return d
        self._admit(d, tpol)
        # the exchange counts it and writes its pending entries (on_dispatch) right after
        # the upstream write, in the same loop tick: before any other request's lookup
        return d

    async def _prepare_by_load(
        self,
        endpoint: str,
        tenant: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        request_id: str,
        explain_only: bool = False,
        strategy: Strategy | None = None,
    ) -> Dispatch:
        """:meth:`prepare` for the endpoints routed by load alone (:data:`LOAD_ROUTED`,
        D28): the same model resolution, scope, candidates, cold confinement, routing
        (the router's load-only path, the scope's own tie rounds), budget and dispatch,
        with no keys, lookup or prediction. A pooling request is charged whole to the
        uncached-token budget, sized by its prompts (at most ``KVGATE_MAX_PROMPT_BATCH``):
        an ``input`` as a completion batch is (a completion prompt's shapes), the chat
        form's ``messages`` rendered as a chat is (D29; an embeddings batch of conversations
        each so, one prompt each), each pair of /score or /rerank both
        texts' tokens (D29); /tokenize and /detokenize are sized 0 (they count as requests
        in the load view, with no prefill)."""
        assert self.pool is not None and self.tokenizers is not None
        st = self.stages
        pol = self.policy
        t0 = time.perf_counter_ns()
        model, model_given = self._request_model(body)
        pooled = endpoint in _INPUT_POOLING or endpoint in _PAIR_POOLING
        cap = self.settings.max_prompt_batch
        chat = has_input = False
        pairs: list[tuple[str, str]] | None = None
        score_limits = (0, 0)
        # the body as vLLM reads it: an embeddings conversation (or a batch of them) in
        # `input` is its chat form
        form = embedding_chat_input(body) if endpoint == "embeddings" else body
        # embeddings' batched chat form (vLLM's EmbeddingBatchChatRequest): one engine
        # request per conversation. It runs beside any input: each message's keys count
        # for it in pydantic's smart union, none for the completion form
        batch = endpoint == "embeddings" and is_conversation_batch(form.get("messages"))
        if endpoint in _INPUT_POOLING:
            # vLLM's two forms, a union: with both, pydantic's smart union runs the form
            # with more of its own fields set (a chat-only field such as
            # add_generation_prompt makes it the messages), so both are sized and the
            # larger charged; messages that are no array beside an input fail the chat
            # form, so the input runs
            has_input = "input" in form and not batch
            chat = "messages" in form and (not has_input or isinstance(form["messages"], list))
            if chat and not isinstance(form["messages"], list):
                raise bad_request("'messages' must be an array", "messages")
            if not chat and not has_input:
                raise bad_request("'input' is required (or the chat form's 'messages')", "input")
            n_batch = completion_batch_size(form, "input") if has_input else 1
            field = "input"
            if batch:  # the cap counts engine requests: conversations, as inputs
                n_batch = len(form["messages"])
                field = "messages" if "messages" in body else "input"
            if n_batch > cap:
                raise bad_request(
                    f"'{field}' holds {n_batch} inputs, more than this gateway takes in one "
                    f"request ({cap}): send them in smaller batches",
                    field,
                )
        elif endpoint in _PAIR_POOLING:
            rerank = endpoint in _RERANK
            pairs = pooling_pairs(body, rerank)  # a 400 naming the field
            score_limits = score_token_limits(body)  # vLLM's scorer reads them next
            if len(pairs) > cap:  # each pair an engine request, as a batch's prompt
                field = "documents" if rerank else "text_2"
                raise bad_request(
                    f"'{field}' makes {len(pairs)} pairs, more than this gateway takes in one "
                    f"request ({cap}): send them in smaller batches",
                    field,
                )
        # vLLM pads each engine request to the context: sized so below (a 400 before routing
        # for a value it refuses)
        padded = pooled and pooling_padding(body)
        if pooled:
            truncation_side(body)  # a side vLLM refuses: a 400 here, not charged then refunded
        reps = self._routable(model)
        tpol = pol.tenant(tenant)
        priority: tuple[int | None, bool] = (None, False)
        if pooled and ("priority" in body or tpol.priority.mode in _PRIORITY_SET):
            # vLLM's pooling requests take a scheduling priority; tokenize calls do not
            priority = _priority_rewrite(tpol.priority, body)
        base_model, lora = self.pool.base_model(model, reps)
        scope, _ = self.resolve_scope(tenant, tpol, headers, body, model, base_model)
        reps = self._one_meaning(model, lora, base_model, reps)
        mpool = pol.models.pool(base_model)
        st.add("parse", time.perf_counter_ns() - t0)
        n_prompt = 0
        if pooled:
            t0 = time.perf_counter_ns()
            # the replicas' context, read once if at all (truncation to it, padding, pairs)
            context_len = functools.cache(lambda: _context_len(reps, model, base_model))
            trunc = pooling_truncation(body, context_len)
            pad = context_len() if padded else None
            if padded and pad is None:
                raise bad_request(
                    "'padding': 'max_length' makes the engine compute each prompt padded to "
                    "the model's context, which the replicas' /v1/models cards do not give "
                    "(or disagree on): this gateway cannot size it",
                    "padding",
                )

            def size(ns: list[int]) -> int:
                # padded, each engine request runs the whole context (a longer one is refused)
                return sum(ns) if pad is None else sum(max(n, pad) for n in ns)

            off = self.settings.tokenize_offload_chars
            tokenizer = self.tokenizers.for_pool(model, mpool)
            local = isinstance(tokenizer, LocalPromptTokenizer)
            cs = None if scope.kind is ScopeKind.REQUEST or not local else scope.canonical()
            # an engine-tokenized pool's chat form and pairs are sized by the built-in
            # tokenizer, not asked of the engine: an estimate, as its batches are
            sizer = tokenizer if isinstance(tokenizer, LocalPromptTokenizer) else None
            if sizer is None and (chat or pairs is not None):
                sizer = self.tokenizers.sizer()
            lengths: list[int] = []
            # a batch's conversations each rendered, truncated and padded as the one
            # conversation of the chat form is (vLLM's EncodeChatRenderParams per one)
            conversations = (form["messages"] if batch else [form["messages"]]) if chat else []
            for conversation in conversations:
                assert sizer is not None
                # rendered as a chat is for sizing, with the chat form's defaults (no
                # generation prompt; no special tokens, chat's); media parts as a chat's
                text_only, media_parts = strip_media(conversation)
                chat_body = {
                    **form, "messages": text_only,
                    "add_generation_prompt": body.get("add_generation_prompt", False),
                }  # fmt: skip
                # vLLM's pooling requests have no tools, documents or reasoning_effort
                # (extra fields, not read): rendered without them, by the replica's rule
                ids = await sizer.chat(chat_body, cs, off, trunc, form="pooling")
                lengths.append(len(ids) + media_parts * mpool.media_part_tokens)
            n_prompt = size(lengths)
            if pairs is not None:
                assert sizer is not None
                for name, n in zip(SCORE_TOKEN_LIMITS, score_limits, strict=True):
                    if n:
                        check_score_limits_context(name, n, context_len())
                # each query and document cut first, as the engine cuts them before
                # pairing, templating or embedding each text (the replica's rule)
                pairs = await sizer.truncated_pairs(pairs, *score_limits, off)
            if pairs is not None and mpool.score_template is not None:
                assert sizer is not None
                # a score template is a cross-encoder's (an embedding model's scoring
                # renders none): each pair the template's text, as the engine runs it
                per_pair = await sizer.score_lengths(
                    body, pairs, mpool.score_template, cs, off, trunc
                )
                n_prompt = size(per_pair)
            elif pairs is not None:
                assert sizer is not None
                # no template renders them, but the request model types them: its 400
                score_fields(body)
                texts = pair_texts(body, endpoint in _RERANK, pairs)  # cut above
                per_pair, per_text = await sizer.pair_lengths(pairs, texts, cs, off, trunc)
                # a cross-encoder runs one prompt per pair, an embedding model one per text
                # (each with its special tokens, truncated and padded alone): which this
                # model is the gateway cannot tell, so the larger is charged
                n_prompt = max(size(per_pair), size(per_text))
            elif has_input:
                if isinstance(tokenizer, LocalPromptTokenizer):
                    inputs = await tokenizer.prompt_lengths(form, cs, off, trunc, "input")
                else:  # the built-in tokenizer's size, not asked of the engine (a batch's)
                    salt = self.minter.salt(scope)
                    inputs = await tokenizer.prompt_lengths(form, salt, off, field="input")
                    if trunc is not None:
                        inputs = [min(n, trunc.keep) for n in inputs]
                n_prompt = max(n_prompt, size(inputs))  # beside messages: the larger form
            st.add("tokenize", time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        salts = [self.minter.salt(scope)] if scope.ephemeral else self.minter.salts(scope)
        coeffs = self.fit.coefficients()
        cands, _ = self._candidates(reps, mpool.max_num_seqs, coeffs, [])
        cold = _cold_replicas(tenant, tpol, [r.id for r in reps])
        req = RouteRequest(
            prompt_tokens=n_prompt,
            block_size=mpool.block_size,
            load_only=True,
            unkeyed=True,
            cold_replicas=cold,
            scope_key=scope.routing_key(),
        )
        decision, cands = self._decide(
            req, cands, coeffs, strategy or self.strategy_override, model, explain_only
        )
        st.add("score", time.perf_counter_ns() - t0)
        d = Dispatch(
            request_id=request_id,
            upstream_id=f"{request_id}-{random_hex(8)}",
            tenant=tenant,
            endpoint=endpoint,
            path=ENDPOINT_PATHS[endpoint],
            body=body,
            stream=False,
            client_wants_usage=False,
            model=model,
            model_given=model_given,
            prompt_tokens=n_prompt,
            block_size=mpool.block_size,
            scope=scope,
            salts=salts,
            keys=[],
            matches=[],
            index_source="none",
            candidates=cands,
            decision=decision,
            unkeyed=True,
            cold_replicas=cold,
            priority=priority[0],
            drop_priority=priority[1],
            salted=endpoint not in _UNSALTED,
            # the chat form's media uuids name items in vLLM's unsalted multimodal caches:
            # scoped as a chat's, whichever form the engine runs (both may be given)
            media_uuids=endpoint in _INPUT_POOLING and media_uuids(form.get("messages")),
        )
        if explain_only:  # decided, not committed or charged (as prepare's)
            return d
        self._admit(d, tpol)
        return d

    async def _prepare_pinned(
        self,
        endpoint: str,
        tenant: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        request_id: str,
        explain_only: bool = False,
    ) -> Dispatch:
        """:meth:`prepare` for a request bound to one replica by a sealed response id (D30):
        a Responses follow-up (``previous_response_id``), ``GET /v1/responses/{id}`` or
        ``POST /v1/responses/{id}/cancel`` (D33; the id in ``body["response_id"]``, a
        retrieval's query in ``body["query"]``, put there by
        :class:`~gateway.app.Completions`).
        The engine that stored the response holds its conversation and its KV, so it goes
        there and nowhere else: no other candidate, no retry elsewhere. An id that does not
        open under the tenant and scope (another tenant's, another session's, tampered,
        unknown) and one whose replica has left the pool (also while this request waited:
        :meth:`replica_gone`) are the engine's 404; a replica out of service (cordoned,
        draining, ejected, unhealthy) a 503 ``no_replica`` with ``Retry-After``: its store
        may still hold the response when it is back. A follow-up is routed by load alone
        (its prompt's history is the engine's, unseen here), sized and charged as its own
        instructions and input."""
        assert self.pool is not None and self.tokenizers is not None
        pol = self.policy
        t0 = time.perf_counter_ns()
        tpol = pol.tenant(tenant)
        follow_up = endpoint == "responses"
        sealed = body.get("previous_response_id") if follow_up else body.get("response_id")
        query, streamed = "", False
        if follow_up:
            model, model_given = self._request_model(body)
            stream_requested(body)  # a 400 before any work
            base_model, _ = self.pool.base_model(model, self._routable(model))
        else:
            if endpoint == RESPONSE_GET:  # a 400 before any work
                query, streamed = _retrieval_query(body.get("query"))
            # a retrieval names no model: its replica's serves it (opened below)
            model_given, model = True, ""
            base_model = ""
        scope, session = self.resolve_scope(tenant, tpol, headers, body, model, base_model or None)
        if follow_up and scope.kind is ScopeKind.REQUEST:
            # a per-request scope promises the engine keeps nothing of the request for a
            # later one: its responses are not stored (upstream_body), nor continued;
            # refused whatever the id, so the refusal says nothing about it
            raise bad_request(
                "a request-scoped (sensitive) request cannot continue a stored response: "
                "send the conversation in 'input' instead",
                "previous_response_id",
            )
        opened = self.response_ids.open(tenant, scope, sealed)
        if opened is None and not follow_up and session and scope.kind is not ScopeKind.SESSION:
            # a retrieval names no model, so a scope that a model's sensitivity (or the POST's
            # header) made the session's resolves as shared here: the session it names is
            # tried too (its id admits a request to that session's cache anyway). A
            # follow-up is opened in its own scope alone: a chain does not leave its scope.
            scope = Scope(ScopeKind.SESSION, session)
            opened = self.response_ids.open(tenant, scope, sealed)
        if opened is None:
            # not this tenant's or this scope's, tampered, forged, unknown
            raise _response_not_found(sealed)
        rep = self._pinned_replica(opened[0], sealed, follow_up)
        if not follow_up:
            base_model = model = next(iter(_base_models(rep)), "")
        mpool = pol.models.pool(base_model)
        n_prompt = 0
        priority: tuple[int | None, bool] = (None, False)
        if follow_up:
            if "priority" in body or tpol.priority.mode in _PRIORITY_SET:
                priority = _priority_rewrite(tpol.priority, body)
            tokenizer = self.tokenizers.for_pool(model, mpool)
            sizer = tokenizer if isinstance(tokenizer, LocalPromptTokenizer) else None
            sizer = sizer or self.tokenizers.sizer()
            cs = None if scope.kind is ScopeKind.REQUEST else scope.canonical()
            view, _ = _responses_chat(body, model, mpool.chat_defaults)
            text_only, media_parts = strip_media(view["messages"])
            ids = await sizer.chat(
                {**view, "messages": text_only},
                cs,
                self.settings.tokenize_offload_chars,
                form="responses",
                server=mpool.chat_defaults,
            )
            n_prompt = len(ids) + media_parts * mpool.media_part_tokens
            # removed or taken out of service while it was tokenized: the answers above
            # (no await from here to the decision)
            rep = self._pinned_replica(opened[0], sealed, follow_up)
        self.stages.add("parse", time.perf_counter_ns() - t0)
        salts = [self.minter.salt(scope)] if scope.ephemeral else self.minter.salts(scope)
        coeffs = self.fit.coefficients()
        cands, _ = self._candidates([rep], mpool.max_num_seqs, coeffs, [])
        req = RouteRequest(
            prompt_tokens=n_prompt,
            block_size=mpool.block_size,
            load_only=True,
            unkeyed=True,
            scope_key=scope.routing_key(),
        )
        decision, cands = self._decide(req, cands, coeffs, None, model, explain_only)
        engine_id = opened[1]
        if follow_up:
            path = _RESPONSES_PATH
        else:
            path = _response_path(engine_id)
            path += "/cancel" if endpoint == RESPONSE_CANCEL else query
        d = Dispatch(
            request_id=request_id,
            upstream_id=f"{request_id}-{random_hex(8)}",
            tenant=tenant,
            endpoint=endpoint,
            path=path,
            body=body,
            stream=stream_requested(body) if follow_up else streamed,
            # a stream's usage event is response.completed: never dropped (filter_events)
            client_wants_usage=True,
            model=model,
            model_given=model_given,
            prompt_tokens=n_prompt,
            block_size=mpool.block_size,
            scope=scope,
            salts=salts,
            keys=[],
            matches=[],
            index_source="none",
            candidates=cands,
            decision=decision,
            unkeyed=True,
            priority=priority[0],
            drop_priority=priority[1],
            salted=follow_up,
            response_id=f"resp_{random_hex(16)}" if follow_up else engine_id,
            previous=(engine_id, str(sealed)) if follow_up else None,
            method=b"GET" if endpoint == RESPONSE_GET else b"POST",
            background=follow_up and body.get("background") is True,
        )
        if explain_only:
            return d
        self._admit(d, tpol)
        return d

    def _pinned_replica(self, replica_id: str, sealed: object, follow_up: bool) -> Replica:
        """The replica a sealed id names, for a request pinned to it (D30): gone from the
        pool, the engine's 404 (its store went with it); out of service, a 503."""
        assert self.pool is not None
        rep = self.pool.get(replica_id)
        if rep is None:
            raise _response_not_found(sealed)
        if not rep.routable(time.monotonic()):
            raise self.pool.no_replica_error(
                "the replica holding this response is out of service; it is served by that "
                "replica alone",
                "previous_response_id" if follow_up else None,
            )
        return rep

    def replica_gone(self, d: Dispatch) -> GatewayError:
        """The answer to a request whose replica left the pool after it was routed, no
        other taking it: for one pinned by a sealed id (D30) the 404 :meth:`prepare` gives
        (the engine's store went with the replica), else the 503 ``no_replica``."""
        assert self.pool is not None
        if d.endpoint in RESPONSE_READS:
            return _response_not_found(d.body.get("response_id"))
        if d.previous is not None:
            return _response_not_found(d.previous[1])
        return self.pool.no_replica_error("no replica available")

    def answer_rewrites(
        self, d: Dispatch, answer: Mapping[str, Any] | None = None
    ) -> list[tuple[bytes, bytes]]:
        """The engine's response ids in an answer, each with what the client sees in its
        place (D30): this response's engine id -> its sealed id (sealed for the replica
        that answered: a first turn may have been retried elsewhere); a follow-up's
        previous engine id -> the sealed id the client sent; a retrieved follow-up's previous
        engine id (read in ``answer``) -> its sealed id. Plain byte replacements:
        the gateway made each engine id up (random), so none occurs by chance."""
        if d.response_id is None:
            return []
        if d.endpoint in RESPONSE_READS:
            sealed = str(d.body.get("response_id"))
        else:
            sealed = self.response_ids.seal(d.tenant, d.scope, d.replica, d.response_id)
        out = [(d.response_id.encode(), sealed.encode())]
        if d.previous is not None:
            out.append((d.previous[0].encode(), d.previous[1].encode()))
        prev = answer.get("previous_response_id") if answer is not None else None
        if (
            d.endpoint in RESPONSE_READS
            and isinstance(prev, str)
            and prev[:5] == "resp_"
            and len(prev) > 5
        ):
            # a retrieved follow-up names its previous response by the engine's id, which
            # the same replica stored: sealed as the client was given it (the seal is
            # deterministic; under today's primary secret)
            resealed = self.response_ids.seal(d.tenant, d.scope, d.replica, prev)
            out.append((prev.encode(), resealed.encode()))
        return out

    def _request_model(self, body: dict[str, Any]) -> tuple[str, bool]:
        """The model a request names, and whether it named one. Absent, null or "": vLLM
        serves it with its first served model (its request models' ``model`` is
        optional), so the fleet's one base model serves it here (:meth:`_default_model`),
        written into the body before anything reads it: the pool, scope and
        sensitive.models go by it."""
        model = body.get("model")
        if model is None or model == "":
            model = body["model"] = self._default_model()
            return model, False
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", "model")
        return model, True

    def _routable(self, model: str) -> list[Replica]:
        """The routable replicas serving ``model``: a 404 ``model_not_found`` when none of
        the gateway's replicas serves it, a 503 ``no_replica`` when none of those is
        routable (saying when every one is cordoned or draining)."""
        assert self.pool is not None
        reps = self.pool.candidates(model)
        if reps:
            return reps
        serving = [r for r in self.pool.all() if r.serves(model)]
        if not serving:
            raise GatewayError(
                404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
            )
        if all(r.cordoned or r.draining for r in serving):
            # healthy perhaps, but taken out of service by an operator: say so
            raise self.pool.no_replica_error(
                "every replica serving this model is cordoned or draining"
            )
        raise self.pool.no_replica_error("no healthy replica serves this model")

    def _one_meaning(
        self, model: str, lora: str | None, base_model: str, reps: list[Replica]
    ) -> list[Replica]:
        """``reps`` less those where ``model`` names something else (a base model on some
        replicas, an adapter on others: routed to the base model's, logged once)."""
        assert self.pool is not None
        same = self.pool.same_meaning(model, lora, base_model, reps)
        if len(same) < len(reps):
            if model not in self._ambiguous_models:
                self._ambiguous_models.add(model)
                log.error(
                    "one model name, two models: a base model on some replicas, an adapter "
                    "on others; routing to the base model's replicas only",
                    extra={"model": model, "excluded": [r.id for r in reps if r not in same]},
                )
            return same
        return reps

    def _candidates(
        self,
        reps: Sequence[Replica],
        max_num_seqs: int,
        coeffs: Coefficients,
        matches: Sequence[Mapping[str, PrefixMatch]],
    ) -> tuple[list[Candidate], dict[str, int]]:
        """Each replica with its load view, its best match over the live salts (none
        without ``matches``) and whether it is quarantined; and the salt index of each
        replica's best match."""
        caps = {r.id: r.capacity or max_num_seqs for r in reps}
        grace_ms = self.policy.routing.overdue_grace_ms
        grace_s = None if grace_ms is None else grace_ms / 1000.0
        loads = self.load.views(list(caps), caps, time.monotonic(), grace_s, coeffs)
        best_salt: dict[str, int] = {}
        cands: list[Candidate] = []
        for r in reps:
            m, si = _best_match(r.id, matches)
            best_salt[r.id] = si
            cands.append(Candidate(r.id, loads[r.id], m, self.quarantine.is_quarantined(r.id)))
        return cands, best_salt

    def _decide(
        self,
        req: RouteRequest,
        cands: list[Candidate],
        coeffs: Coefficients,
        strategy: Strategy | None,
        model: str,
        explain_only: bool = False,
    ) -> tuple[Decision, list[Candidate]]:
        """The routing decision (and the candidates it was made over), decided without
        moving the router (cursor, tie rounds, trees): :meth:`_admit` commits it once the
        request will be sent; one decided again below or refused by the tenant's budget
        charged a replica, the tenant's scope tree and everyone's rounds for nothing."""
        assert self.pool is not None
        router = self.router
        try:
            with router.preview() if explain_only else contextlib.nullcontext():
                decision = router.decide(req, cands, coeffs, strategy, commit=False)
                chosen = self.pool.get(decision.replica)
                if chosen is None or not chosen.routable(time.monotonic()):
                    # cordoned, drained, ejected or removed during the awaits before
                    # (tokenizing, the lookup): it takes no new request (it used to get this
                    # one, routed over the replicas read before them); the chosen one alone
                    # is checked: O(1)
                    routable = {r.id for r in self.pool.candidates(model)}
                    cands = [c for c in cands if c.replica in routable]
                    if not cands:
                        raise self.pool.no_replica_error("no healthy replica serves this model")
                    decision = router.decide(req, cands, coeffs, decision.strategy, commit=False)
        except NoCandidateError as exc:  # a confined tenant's cold request: none offered
            raise self.pool.no_replica_error(str(exc)) from None
        return decision, cands

    def _admit(self, d: Dispatch, tpol: TenantPolicy) -> None:
        """Charge the request's predicted uncached tokens to its tenant's budget (a 429
        when it is spent) and commit its decision. No await since the decision: no other
        decision in between."""
        decision = d.decision
        uncached = d.uncached_tokens
        rej = self.limiter.charge_uncached(d.tenant, tpol.limits, uncached, time.monotonic())
        if rej is not None:
            self.metrics.rate_limited.labels(d.tenant, rej.limit).inc()
            raise rate_limited(rej.message, rej.retry_after_s, rej.limit)
        d.charged_uncached = uncached
        self.router.commit(decision)
        self.metrics.decisions.labels(decision.strategy.value, decision.reason).inc()

    # ------------------------------------------------------------------ dispatch
    def _default_model(self) -> str:
        """The model a request that names none is served by: the one base model the
        routable fleet serves (its /v1/models, adapters aside), under the name vLLM serves
        it by (its first served name: a model served under several names is one model,
        ``ReplicaPool.base_models``). With several, a 400 naming them. With none known, a
        503: routable replicas whose lists are not read yet (just added, a failed read, a
        fleet registering again after a Redis restart: a 400 there was final to clients
        that retry only 5xx, review 5 W4), saying a named model is served at once; or no
        replica routable. (An engine without /v1/models at all stays unknown: its message
        says to name the model.)"""
        assert self.pool is not None
        bases = self.pool.base_models()  # kept until the pool changes: not rebuilt here
        if len(bases.names) == 1:
            return bases.names[0][0]
        if not bases.names:
            if bases.unknown:
                raise self.pool.no_replica_error(
                    "the replicas' model lists (/v1/models) are not known yet, so this "
                    "gateway cannot tell which model serves a request without 'model'; "
                    "name the model to be served now",
                    param="model",
                )
            members = self.pool.all()
            if members and all(r.cordoned or r.draining for r in members):
                # healthy perhaps, but taken out of service by an operator: say so
                raise self.pool.no_replica_error(
                    "every replica is cordoned or draining: none can serve a request "
                    "without 'model'"
                )
            raise self.pool.no_replica_error(
                "no healthy replica to serve a request without 'model'"
            )
        firsts = sorted(names[0] for names in bases.names)
        shown = ", ".join(firsts[:_MODELS_NAMED])
        more = f" and {len(firsts) - _MODELS_NAMED} more" if len(firsts) > _MODELS_NAMED else ""
        raise bad_request(
            f"'model' is required: this gateway serves several models ({shown}{more}); "
            "name one (GET /v1/models lists them)",
            "model",
        )

    def upstream_body(self, d: Dispatch) -> bytes:
        """The body sent upstream: the client's fields, our cache_salt (none for an
        unsalted endpoint), usage requested."""
        if d.method != b"POST" or d.endpoint == RESPONSE_CANCEL:
            return b""
        if d.endpoint == "responses":
            return self._responses_body(d)
        salt = d.salts[d.salt_index] if d.salted else None
        raw = d.raw_body
        xargs = d.body.get("vllm_xargs")
        report_mode = isinstance(xargs, dict) and _REPORT_MODE in xargs
        untouched = (
            _REWRITTEN_FIELDS.isdisjoint(d.body)
            and not report_mode
            and not d.drop_priority
            and (d.priority is None or "priority" not in d.body)
            and not d.media_uuids
        )
        if raw is not None and not d.stream and d.body and untouched and d.model_given:
            # nothing to replace: append the salt (and a tenant's priority) to the client's
            # own bytes instead of re-serializing the body (its prompt can be thousands of
            # token ids)
            end = raw.rstrip()
            if end.endswith(b"}"):
                tail = b"}" if d.priority is None else b',"priority":%d}' % d.priority
                if salt is None:
                    return end[:-1] + tail
                return b"".join((end[:-1], b',"cache_salt":', orjson.dumps(salt), tail))
        body = dict(d.body)
        if salt is not None:
            body["cache_salt"] = salt  # replaces any client-supplied salt
        else:
            body.pop("cache_salt", None)  # no client salt reaches an engine
        if d.priority is not None:
            body["priority"] = d.priority
        elif d.drop_priority:
            del body["priority"]
        for name in _ENGINE_ID_FIELDS.intersection(body):  # vLLM's, SGLang's: ours
            body[name] = d.upstream_id
        for name in _OPERATOR_FIELDS.intersection(body):
            del body[name]
        if d.media_uuids:
            # vLLM's multimodal caches take a client's uuid as the item's hash, unsalted,
            # and serve a part with no data from them: scoped, so a uuid names an item of
            # the request's own scope only (reuse within it still works). Keyed by the
            # primary's salt, not the one served under: one name per scope in a rotation,
            # the same the engine's render call got (EnginePromptTokenizer.chat)
            if "messages" in body:
                body["messages"] = scope_media_uuids(body["messages"], d.salts[0])
            conversations = body.get("input")
            if d.endpoint == "embeddings" and (
                is_conversation(conversations) or is_conversation_batch(conversations)
            ):
                body["input"] = scope_media_uuids(conversations, d.salts[0])  # its chat form
        if report_mode:
            assert isinstance(xargs, dict)
            body["vllm_xargs"] = {k: v for k, v in xargs.items() if k != _REPORT_MODE}
        if d.stream:
            opts = body.get("stream_options")
            opts = dict(opts) if isinstance(opts, dict) else {}
            if not d.client_wants_usage:
                # we want the final usage chunk only: continuous_usage_stats means nothing
                # without include_usage, so the client did not ask for per-chunk usage
                opts.pop("continuous_usage_stats", None)
            opts["include_usage"] = True
            body["stream_options"] = opts
        return orjson.dumps(body)

    def _responses_body(self, d: Dispatch) -> bytes:
        """A Responses request as sent (D30): the scope's salt, the engine's ids (its own
        response id, made up here; the previous response's, opened from the sealed id),
        the tenant's priority rule, operator fields removed; not stored under a
        per-request scope (its promise: nothing of it kept for a later request)."""
        body = dict(d.body)
        body["cache_salt"] = d.salts[d.salt_index]
        body["request_id"] = d.response_id
        body.pop("rid", None)
        if d.previous is not None:
            body["previous_response_id"] = d.previous[0]
        if d.scope.kind is ScopeKind.REQUEST:
            body["store"] = False
        if d.priority is not None:
            body["priority"] = d.priority
        elif d.drop_priority:
            del body["priority"]
        for name in _OPERATOR_FIELDS.intersection(body):
            del body[name]
        return orjson.dumps(body)

    def on_dispatch(self, d: Dispatch) -> None:
        """Count the request against its replica and record the pending entries. No await:
        the caller runs it in the loop tick that sends the request, so no other request's
        lookup can come between the dispatch and its record."""
        assert self.index is not None
        cand = next(c for c in d.candidates if c.replica == d.replica)
        d.load_at_dispatch = cand.load
        uncached = d.uncached_tokens
        ttft_s = max(0.001, d.decision.chosen.ttft_ms / 1000.0)
        # a stream's first token is watched (D16): later than predicted by more than the
        # policy's grace, it makes its replica overdue (the grace is read at each decision).
        # Not a replayed one's (a frontend answer): vLLM's replay past a run's last event
        # waits for ever, and its replica read as stalled to every tenant (D33)
        expected = time.monotonic() + ttft_s if d.stream and not d.frontend_answer else math.inf
        ticket = d.ticket = self.inflight.dispatch(d.replica, uncached, expected)
        if not d.stream:
            # a JSON answer arrives whole, long after its first token: assume the prefill
            # is done when its predicted TTFT has passed, so a long generation does not
            # count as queued prefill work all along (and it is never overdue: only its
            # timeout sees a non-streamed request stuck)
            asyncio.get_running_loop().call_later(ttft_s, self.inflight.first_token, ticket)
        if len(d.salts) > 1:  # a rotation is under way: which secret still carries traffic
            self.metrics.salt_secret.labels("primary" if d.salt_index == 0 else "previous").inc()
        rep = self.pool.get(d.replica) if self.pool else None
        if rep is not None:
            rep.in_flight += 1
        if not d.ephemeral and d.keys:
            # only the part not already stored there: stored keys need no guess, and
            # re-marking a whole long prefix per request would cost the index dearly
            match = d.matches[d.salt_index].get(d.replica) if d.matches else None
            start = match.stored_blocks if match is not None else 0
            keys = d.keys[d.salt_index]
            if start < len(keys):
                ttl = self.policy.index.pending_ttl_ms
                d.pending = self.index.add_pending(d.replica, keys[start:], ttl, _now_ms(), start)

    def on_first_token(self, d: Dispatch, progressed: bool = True) -> None:
        """The request's prefill is over: its prefill tokens leave the replica's queue.
        For a stream that is its first body chunk (a Responses run's: its first output
        event, D30), never its response headers: engines (vLLM, the simulated replica)
        send a stream's headers when they accept it, before the prefill, and a queue
        emptied at the headers hides every prefill still waiting from expected_latency
        (it then sees only running requests). ``progressed``: the
        engine computed it (not an error answer), so no stall of the replica's engine
        began before now (D17); never for /tokenize and /detokenize, which the server
        answers without its engine (:data:`_FRONTEND_ONLY`)."""
        if d.ticket is not None and not (d.background and not d.stream):
            # a background answer's "queued" comes before its prefill: that leaves the
            # queue at its predicted first token (on_dispatch's timer), as a JSON answer's
            self.inflight.first_token(d.ticket)
        if progressed and not d.frontend_answer:
            self.inflight.progressed(d.replica, time.monotonic())

    def reroute(self, d: Dispatch, failed: str, dropped: bool = False) -> bool:
        """After a connection failure before the first byte: pick another replica.
        ``dropped``: the failed replica took the request and closed unanswered, so it may
        have computed it (its attempt's charge is kept whatever follows, beside any earlier
        dropped attempt's)."""
        if dropped:
            d.kept_uncached = d.charged_uncached
            self._cancel_orphan(d)
        self.on_release(d)
        self._settle_pending(d, refused=True)  # the failed replica never got the request
        self._retract_growth(d, failed)
        d.tried.append(failed)
        rest = [c for c in d.candidates if c.replica not in d.tried]
        if not rest or d.attempts >= self.settings.retries:
            return False
        if d.drops > self.settings.drop_retries:
            log.warning(
                "request not retried: replicas broke its exchange after it was sent (a "
                "request that crashes its engine would take the fleet down one by one)",
                extra={"request_id": d.request_id, "replicas": d.tried, "drops": d.drops},
            )
            return False
        assert self.pool is not None
        # only replicas that may take new requests now: one cordoned, drained, ejected or
        # removed since the request was routed is not a retry's either (any candidate used
        # to do when none was routable; a data-parallel engine's sibling ranks, ejected
        # with the refusing one, then got the retry at the same closed port)
        routable = {r.id for r in self.pool.candidates(d.model)}
        rest = [c for c in rest if c.replica in routable]
        if not rest:
            return False
        req = RouteRequest(
            prompt_tokens=d.prompt_tokens,
            block_size=d.block_size,
            session_key=None,
            load_only=d.ephemeral or d.unkeyed,
            unkeyed=d.unkeyed,
            cold_replicas=d.cold_replicas,  # a retry must not escape the confinement
            scope_key=d.scope.routing_key(),
            hit_drop_blocks=d.hit_drop_blocks,
        )
        try:
            decision = self.router.decide(
                req, rest, self.fit.coefficients(), d.decision.strategy, commit=False
            )
        except NoCandidateError:  # a cold request whose tenant's cold replicas all failed
            return False
        # committed at once: the retry is sent (the failed decision's step was taken back)
        self.router.commit(decision)
        d.decision = decision
        _, d.salt_index = _best_match(d.replica, d.matches)
        self._recharge(d)
        d.attempts += 1
        self.metrics.retries.inc()
        return True

    def _recharge(self, d: Dispatch) -> None:
        """A rerouted request's charge becomes what its dropped attempts keep plus its new
        replica's predicted uncached tokens: the budget bounds the prefill the fleet runs
        for the tenant, and a replica that dropped the request may have run its share
        before the new one runs its own (a poison request that drops its first replica is
        not half price). The failed attempt's share is replaced, not added, when its
        replica never got the request (a connect failure, a full pool): its prediction
        counted the prefix it held, which the new one may lack and compute whole. A rise
        is debited into debt, never refused (the request was admitted; a retry refused for
        budget would fail it after the replica's fault); a fall given back.
        ``charged_uncached`` stays what was taken, so a refund gives back exactly that."""
        self._charge_to(d, d.kept_uncached + float(d.uncached_tokens))

    def _charge_to(self, d: Dispatch, target: float) -> None:
        """Move ``d``'s charge to ``target``: a rise debited (into debt, never refused: it
        was admitted), a fall given back; absolute, so settling twice changes nothing."""
        diff, now = target - d.charged_uncached, time.monotonic()
        if diff > 0:
            self.limiter.debit_uncached(d.tenant, diff, now)
        elif diff < 0:
            self.limiter.refund_uncached(d.tenant, -diff, now)
        d.charged_uncached = target

    def _retract_growth(self, d: Dispatch, failed: str) -> None:
        """The failed attempt's replica never got the prompt: take back what its committed
        decision changed in the router (``Router.retract``: the round-robin step, its place
        in the tie round, what it added to prefix_affinity's tree and D14's scope tree), or
        the replica reads as holding a prefix it never saw and the scope's next misses go
        elsewhere. The trees stay for a replica removed (and forgotten by the router) or
        back under its id as a new one since: they are not that decision's any more."""
        if d.decision.replica != failed:
            return
        rep = self.pool.get(failed) if self.pool is not None else None
        ours = rep is not None and (d.target is None or rep is d.target)
        self.router.retract(d.decision, trees=ours)

    def _settle_pending(self, d: Dispatch, refused: bool) -> None:
        """The attempt is over: a refused one's pending entries are undone (they would
        steer the scope's next requests to a replica without the prefix for
        ``index.pending_ttl_ms``); an accepted one's stay until they expire."""
        w, d.pending = d.pending, None
        if w is None or self.index is None:
            return
        if refused:
            self.index.withdraw(w, _now_ms())
        else:
            self.index.done(w)

    def on_release(self, d: Dispatch) -> None:
        if d.ticket is not None:
            self.inflight.done(d.ticket)
            d.ticket = None
            rep = self.pool.get(d.replica) if self.pool else None
            if rep is not None:
                rep.in_flight = max(0, rep.in_flight - 1)

    def finish(self, d: Dispatch, out: Outcome) -> None:
        """Account, measure precision, check claims, fit the cost model."""
        if _may_hold_orphan(d, out):
            self._cancel_orphan(d)
        if not self._watch_background(d, out):
            self.on_release(d)
        elif d.ticket is not None and d.ticket.phase == 0 and d.ticket.expected != math.inf:
            # a background stream that ended before its first output event: its run goes on
            # unseen, so it leaves the queue at its predicted first token, as a JSON
            # answer's (on_dispatch), not overdue for want of a reader (D16)
            wait = max(0.0, d.ticket.expected - time.monotonic())
            asyncio.get_running_loop().call_later(wait, self.inflight.first_token, d.ticket)
        if d.endpoint in RESPONSE_READS and d.response_status in RESPONSE_TERMINAL:
            # a client's retrieval or cancel saw a watched response end: no poll needed
            usage = (out.prompt_tokens, out.cached_tokens)  # a replayed stream's completed
            if d.response_usage is None and usage[0] is not None and usage[1] is not None:
                d.response_usage = (usage[0], usage[1])
            self._background_ended(d)
        m = self.metrics
        rid = d.replica
        if out.ttft_s is not None:
            m.ttft.labels(rid).observe(out.ttft_s)
        m.e2e.labels(rid).observe(out.e2e_s)
        if self.pool is not None:
            if (
                out.status < 500
                and out.status != 499
                and out.error is None
                and not d.frontend_answer
            ):
                # a client that left says nothing of the replica, nor does an answer its
                # API server gives without the engine (/tokenize): neither may clear the
                # first-byte timeouts counted towards a wedged engine's ejection
                self.pool.record_success(rid)
            elif (
                out.error is not None
                and out.error not in _NO_ENGINE
                and out.error not in _OVERSIZED
                and not (d.endpoint == RESPONSE_GET and d.stream)
            ):
                # a replayed stream fails or hangs by vLLM's design, at the client's
                # choice (an id without a streamed run: an error inside the stream; a
                # cancelled run: it waits for ever): held against the replica, any tenant
                # ejected healthy replicas with a few GETs of its own responses (D33)
                self.pool.record_failure(rid)
        # no engine computed it: an engine's 4xx is a refusal before any prefill
        # (validation, length, unknown model, 429), and a connect failure or a replica gone
        # before the send reached none
        refused = (400 <= out.status < 500 and out.status != 499) or out.error in _NO_ENGINE
        if d.pending is not None:
            self._settle_pending(d, refused)
        # ...but what an earlier attempt's replica took and broke the exchange of (a drop)
        # keeps: it may have computed the request, and died of it
        if refused and d.charged_uncached > d.kept_uncached:
            back = d.charged_uncached - d.kept_uncached
            self.limiter.refund_uncached(d.tenant, back, time.monotonic())
            d.charged_uncached = d.kept_uncached
        if (
            out.status in (200, 499)  # a 499's usage: a whole answer its client left
            and out.prompt_tokens is not None
            and out.cached_tokens is not None
            and not d.watched  # settled at its watch's end, with the run's usage
        ):
            self._settle_uncached(d, out.prompt_tokens, out.cached_tokens)
        if self.trace is not None:
            self._trace(d, out)
        if out.cached_tokens is None or out.status != 200 or d.unkeyed or d.watched:
            # media (the engine counts its items) or no cache read: nothing to judge; a
            # watched run's usage comes at its watch's end, judged there once
            return
        prompt = self._judge(d, out.prompt_tokens, out.cached_tokens)
        self._fit(d, out, prompt)

    def _judge(self, d: Dispatch, engine_prompt: int | None, cached: int) -> int:
        """Precision and the claim check of ``d``'s prefill, as its engine reported it
        (``cached`` tokens of its ``engine_prompt``) against the decision's prediction:
        at its answer (:meth:`finish`) or, for a background run, at its watch's end
        (:meth:`_release_background`). The prompt's token count: the engine's if given."""
        prompt = engine_prompt if engine_prompt is not None else d.prompt_tokens
        if prompt != d.prompt_tokens:
            self._warn_precision(
                "prompt token count differs from the engine's: tokenizers are misaligned",
                d, engine_prompt, cached,
            )  # fmt: skip
        if not d.ephemeral:
            predicted = d.decision.predicted_cached_tokens
            frac = self.metrics.observe_precision(d.replica, predicted, cached, prompt)
            if frac > self.policy.precision.warn_error_fraction:
                self.metrics.precision_warnings.inc()
                self._warn_precision(
                    "predicted and actual cached tokens disagree", d, engine_prompt, cached
                )
            self._check_claims(d, cached)
        return prompt

    def _settle_uncached(self, d: Dispatch, prompt: int, cached: int) -> None:
        """Its engine reported the run's usage: ``d``'s charge becomes what that engine
        computed (``prompt - cached``, its own count for this request), beside the shares
        dropped attempts keep (D32). Up front it was a prediction: a follow-up's its own
        instructions, tools and input, blind to the stored chain (which the engine
        prefills again after other instructions or an eviction: debited) and to its cache
        (repeated instructions it already holds: given back); any other request's its
        replica's predicted hit (exact but for a stale index or media's estimate), or its
        whole prompt where nothing is predicted (a sensitive scope, media, prompt
        logprobs). A retrieval's or cancel's usage is the stored run's, not its own. A
        Responses run with built-in tools may loop in its engine, and vLLM 0.33's
        experimental parser context (``VLLM_USE_EXPERIMENTAL_PARSER_CONTEXT``) reports
        its last turn's prompt and cached tokens alone (vLLM's responses ``context.py``,
        ``ParsableContext.append_output``): an earlier turn's prefill unreported, so such
        a run's charge is never lowered."""
        if d.endpoint in RESPONSE_READS:
            return
        target = d.kept_uncached + float(max(0, prompt - max(0, cached)))
        if d.endpoint == "responses" and _engine_tools(d.body):
            target = max(target, d.charged_uncached)
        self._charge_to(d, target)

    # ------------------------------------------------------------------ background (D33)
    def _watch_background(self, d: Dispatch, out: Outcome) -> bool:
        """Whether ``d``, a background response its engine accepted and has not finished
        (its answer "queued", or a stream that ended before its terminal event), keeps its
        ticket: the engine computes on, so the replica's in-flight count and queued
        prefill stay until a watcher sees the stored response terminal, and so does its
        tenant's concurrency slot (the engine's work, whether the client waits or not).
        Its place under the watch caps was taken before any work (:meth:`prepare`);
        while stopping it ends now, counted ``shutdown``. A stream that failed on the
        replica's side after its first output ends now too, its run cancelled there
        (``stream_failed``); one that failed before it is watched (D33)."""
        if (
            not d.background
            or d.ticket is None
            or d.response_id is None
            or d.response_status is None
            or d.response_status in RESPONSE_TERMINAL
        ):
            return False
        if (
            d.stream
            and out.error is not None
            and out.error != EVENT_TOO_LARGE
            and d.ticket.phase > 0
        ):
            # vLLM 0.33's streamed run that fails (a GenerationError: its error event fails
            # validation as a StreamingResponsesResponse, so the run's task raises) records
            # no further event and leaves the stored response "queued" for ever: the
            # stream ends without a terminal event (the upstream read timeout; a broken
            # connection). Once its output began, a running request's tokens come every
            # engine step: its read timeout (300 s of none) or a break is the run's end,
            # so it is cancelled there (its stored status "cancelled", not "queued" for
            # ever); its client got the stream's error event. Before its first output a
            # healthy run may queue past the read timeout (D33: it is watched, and the
            # watcher ends a dead one when its engine holds no request). Not a client
            # that left (no error) nor the gateway's own cut of an oversized event: their
            # runs go on, watched.
            self.metrics.background_responses.labels("stream_failed").inc()
            self._cancel_orphan(d, orphan=False)
            return False
        if self._bg_closed:  # stopping: its watch would end now, as every other's
            self.metrics.background_responses.labels("shutdown").inc()
            return False
        key = (d.replica, d.response_id)
        d.watched = True  # the ticket, tenant slot and watch place: the watch's now
        task = self.spawn(self._watch_response(d))
        self._background[key] = (d, task)
        task.add_done_callback(lambda t: self._watch_ended(key, d, t))
        self.metrics.background_watched.set(len(self._background))
        return True

    async def _watch_response(self, d: Dispatch) -> None:
        """Poll ``d``'s replica for its stored response every ``KVGATE_BACKGROUND_POLL_S``
        until it is terminal, gone (the replica removed, the engine's 404: restarted),
        too large to read (``too_large``), dead (``engine_idle``: :meth:`_engine_idle`)
        or ``KVGATE_BACKGROUND_WATCH_MAX_S`` passed (``expired``): that outcome and its
        usage left in ``d.response_status`` and ``d.response_usage`` for
        :meth:`_watch_ended`, which releases it."""
        s = self.settings
        deadline = time.monotonic() + s.background_watch_max_s
        tools = d.body.get("tools")
        builtin = isinstance(tools, list) and any(
            not isinstance(t, dict) or t.get("type") not in _RENDERED_TOOLS for t in tools
        )
        # a run whose server may call a tool leaves its engine idle while the tool runs
        idle = (
            None
            if builtin
            else IdleEngine(int(time.time() * 1000), int(s.background_idle_s * 1000))
        )
        # held for up to an hour, up to KVGATE_BACKGROUND_WATCH_MAX of them: not the
        # prompt (its exchange is over: the trace and span have read it), only what the
        # claim check at its end reads
        d.raw_body, d.body = None, {}
        self._keep_claim(d)
        while time.monotonic() + s.background_poll_s < deadline:
            await asyncio.sleep(s.background_poll_s)
            # read before the poll: a run that just left its engine idle is stored
            # terminal by the time the poll reads it
            dead = idle is not None and self._engine_idle(d, idle)
            got = await self._poll_response(d)
            if got is not None and (got[0] in RESPONSE_TERMINAL or got[0] in WATCH_ENDS):
                d.response_status, d.response_usage = got
                return
            if dead and got is not None:  # read, and not terminal: no engine runs it
                log.warning(
                    "background response ended as dead: its engine held no running and no "
                    "waiting request on consecutive scrapes while it read non-terminal; "
                    "cancelled there",
                    extra={"replica": d.replica, "request_id": d.request_id},
                )
                d.response_status, d.response_usage = "engine_idle", None
                self._cancel_orphan(d, orphan=False)
                return
        d.response_status, d.response_usage = "expired", None

    def _engine_idle(self, d: Dispatch, idle: IdleEngine) -> bool:
        """Whether ``d``'s engine has reported, on fresh scrapes since its watch began
        (its agent's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, as
        the load view reads them), no running and no waiting request long enough
        (:class:`~gateway.load.IdleEngine`): then it is not computing the run, which is
        dead (vLLM 0.33's failed streamed run stays ``queued`` for ever, D33). No
        scrapes (no agent): never, and the watch's hour bounds it as before."""
        snap = self.refresher.snapshot() if self.refresher is not None else {}
        return idle.dead(snap.get(d.replica))

    def _watch_ended(self, key: tuple[str, str], d: Dispatch, task: asyncio.Task[None]) -> None:
        """``d``'s watcher ended, however: with its outcome, or cancelled (``shutdown``:
        the gateway stopping; a client's retrieval or cancel that saw the response end
        took it out first). A done callback, not the watcher's own ``finally``: a watcher
        cancelled before its first step (spawned in the tick in which stop cancels the
        background tasks) never runs its coroutine, and its ticket, slot and place leaked."""
        if self._background.get(key, (None,))[0] is not d:
            return
        del self._background[key]
        outcome, usage = "shutdown", None
        if not task.cancelled():
            if (exc := task.exception()) is not None:  # a bug: ends as one that ran out
                log.error("background response watcher failed", exc_info=exc)
            outcome, usage = d.response_status or "expired", d.response_usage
            if outcome not in RESPONSE_TERMINAL and outcome not in WATCH_ENDS:
                outcome, usage = "expired", None
        self._release_background(d, outcome, usage)

    async def _poll_response(self, d: Dispatch) -> tuple[str, tuple[int, int] | None] | None:
        """The stored response's status and usage (prompt, cached) as its engine answers
        ``GET /v1/responses/{id}``; ``lost`` for a replica gone or the engine's 404;
        ``too_large`` for an answer over ``KVGATE_MAX_UPSTREAM_BODY_BYTES``: a stored
        response grows with its output only once its run has ended (vLLM stores the
        ``queued`` one, input-sized, then the final one), so that run is over, and every
        poll would read up to the cap again to the watch's hour; a client's GET of it
        gets the 502 anyway. None when it could not be read (tried again at the next
        poll)."""
        assert d.response_id is not None
        rep = self.pool.get(d.replica) if self.pool is not None else None
        if rep is None:
            return "lost", None
        if self.client is None:
            return None
        try:
            resp = await self._replica_read(rep, False, _response_path(d.response_id))
        except AnswerTooLarge:
            return "too_large", None
        except (httpx.HTTPError, TimeoutError):
            return None
        if resp.status_code == 404:
            return "lost", None
        if resp.status_code != 200:
            return None
        try:
            got = resp.json()
        except ValueError:
            return None
        if not isinstance(got, dict) or not isinstance(got.get("status"), str):
            return None
        from gateway.proxy import usage_pair  # the proxy's reader (it imports this module)

        return got["status"], usage_pair(got.get("usage"))

    async def _replica_call(self, rep: Replica, post: bool, path: str) -> httpx.Response | None:
        """:meth:`_replica_read`'s answer; None when it could not be made or read."""
        try:
            return await self._replica_read(rep, post, path)
        except (AnswerTooLarge, httpx.HTTPError, TimeoutError):
            return None

    async def _replica_read(self, rep: Replica, post: bool, path: str) -> httpx.Response:
        """The gateway's own GET (or POST) to ``rep``'s engine (a watcher's poll, an
        orphan's cancel), under the poll slots and timeout, its answer read to at most
        ``KVGATE_MAX_UPSTREAM_BODY_BYTES`` (a stored response holds the whole output):
        past it AnswerTooLarge, counted and logged here. An answer other than a 200 comes
        with no body (its callers read its status alone): an error's was read to that
        bound too, and one over it ended a watch as ``too_large``."""
        assert self.client is not None
        s = self.settings
        try:
            async with self._poll_slots:
                return await read_answer(
                    self.client, "POST" if post else "GET", f"{rep.url.rstrip('/')}{path}",
                    timeout_s=s.connect_timeout_s, deadline_s=_BACKGROUND_POLL_TIMEOUT_S,
                    cap=s.max_upstream_body_bytes, read_unless_ok=False,
                    extra_headers=self._replica_headers(rep),
                )  # fmt: skip
        except AnswerTooLarge as exc:
            self.body_too_large(rep.id, exc, "not read", path=path)
            raise

    def _replica_headers(self, rep: Replica) -> dict[str, str]:
        """The headers of the gateway's own request to ``rep``'s engine (a poll, a cancel)."""
        headers = {}
        if self.settings.upstream_api_key is not None:
            headers["authorization"] = "Bearer " + self.settings.upstream_api_key.get_secret_value()
        if rep.dp_rank is not None:
            headers["x-data-parallel-rank"] = str(rep.dp_rank)
        return headers

    def _cancel_orphan(self, d: Dispatch, orphan: bool = True) -> None:
        """``d``, a background POST, reached its replica's engine, which may have stored and
        started its run (vLLM's goes on without the connection), but its answer, the only
        place the client learns the response's id, never came back (a drop, rerouted or
        not; a timeout, a broken body; a client gone before it): nobody could retrieve,
        cancel or watch that run, and a retry elsewhere runs it again. Cancel it there
        (best effort, one request; vLLM's 404 when it holds none). Its charge stays.
        ``orphan`` false: a streamed run whose stream failed (:meth:`_watch_background`),
        counted there, not as an orphan."""
        rep = d.target if d.target is not None and d.target.id == d.replica else None
        if not d.background or d.response_id is None or rep is None or self.client is None:
            return
        self.spawn(self._post_cancel(rep, d.response_id, d.request_id, orphan))

    async def _post_cancel(
        self, rep: Replica, engine_id: str, request_id: str, orphan: bool
    ) -> None:
        resp = await self._replica_call(rep, True, _response_path(engine_id) + "/cancel")
        if resp is None:
            return  # a replica that died of it took its run along
        if resp.status_code == 200 and orphan:
            self.metrics.background_responses.labels("orphan_cancelled").inc()
            log.warning(
                "background response cancelled on a replica whose answer was lost: its id "
                "never reached the client",
                extra={"replica": rep.id, "request_id": request_id},
            )

    def _background_ended(self, seen: Dispatch) -> None:
        """A client's retrieval or cancel of a watched response answered it terminal:
        release it now (its watcher, cancelled, finds it gone)."""
        got = self._background.pop((seen.replica, seen.response_id or ""), None)
        if got is None:
            return
        d, task = got
        assert seen.response_status is not None
        self._release_background(d, seen.response_status, seen.response_usage)
        task.cancel()

    def _release_background(self, d: Dispatch, outcome: str, usage: tuple[int, int] | None) -> None:
        """The watch of ``d`` ended (once: its entry was taken out of ``_background``):
        its ticket, watch place and tenant's concurrency slot end with it."""
        self.metrics.background_watched.set(len(self._background))
        self.metrics.background_responses.labels(outcome).inc()
        self.on_release(d)
        self._end_admission(d)
        if outcome in RESPONSE_TERMINAL and usage is not None:
            self._settle_uncached(d, *usage)
            if not d.unkeyed:
                # its precision and claim check, as a synchronous answer's, once: finish
                # left them to the watch (no usage yet). No cost-model fit: its engine's
                # first token was never seen (no TTFT; the POST's latency is the queued
                # answer's)
                self._judge(d, *usage)

    def release_admission(self, d: Dispatch) -> None:
        """``d``'s exchange is over: its tenant's concurrency slot and its watch place
        end, unless a watcher holds them until the response is terminal (D33), which then
        ends them (:meth:`_release_background`): exactly once either way."""
        if not d.watched:
            self._end_admission(d)

    def _end_admission(self, d: Dispatch) -> None:
        if d.watch_place:
            d.watch_place = False
            self._give_watch_place(d.tenant)
        self.limiter.release(d.tenant, d.replay)

    def _take_watch_place(self, tenant: str) -> None:
        """A place under the watch caps for one of ``tenant``'s background POSTs, or the
        refusal: 429 past the tenant's share (``KVGATE_BACKGROUND_WATCH_TENANT_SHARE`` of
        the cap: no tenant can fill it for the others), 503 past the gateway's cap. Taken
        up front: a response served unwatched is load its replica's routing never sees."""
        s = self.settings
        retry_s = max(1.0, s.background_poll_s)  # a watch ends at a poll at the soonest
        share = max(1, math.floor(s.background_watch_max * s.background_watch_tenant_share))
        if self._watch_places[tenant] >= share:
            self.metrics.background_responses.labels("refused_share").inc()
            self.metrics.rate_limited.labels(tenant, "background_watch").inc()
            raise rate_limited(
                f"too many background responses running for this key ({share}); retry when "
                "one has ended",
                retry_s,
                "background_watch",
            )
        if self._watch_places.total() >= s.background_watch_max:
            self.metrics.background_responses.labels("refused_capacity").inc()
            raise GatewayError(
                503,
                "the gateway is watching as many background responses as it can; retry "
                "later, or send the request without 'background'",
                code="background_capacity",
                headers={"Retry-After": retry_after(retry_s)},
            )
        self._watch_places[tenant] += 1

    def slot_retry_s(self, tenant: str, max_concurrency: int | None) -> float:
        """``Retry-After`` of ``tenant``'s 429 ``concurrency``: while its background
        responses hold its every slot, none frees before a watcher's poll (or a client's
        retrieval or cancel) sees one end, so the poll interval, at least 1 s, as the watch
        caps' 429 (:meth:`_take_watch_place`); else 1 s (a sync request's slot)."""
        held = self._watch_places.get(tenant, 0)
        if max_concurrency is not None and held >= max_concurrency:
            return max(1.0, self.settings.background_poll_s)
        return 1.0

    def _give_watch_place(self, tenant: str) -> None:
        self._watch_places[tenant] -= 1
        if self._watch_places[tenant] <= 0:
            del self._watch_places[tenant]

    def _trace(self, d: Dispatch, out: Outcome) -> None:
        assert self.trace is not None
        load = d.load_at_dispatch
        predicted = None if d.ephemeral or d.unkeyed else d.decision.predicted_cached_tokens
        self.trace.write(
            {
                "ts": time.time(),
                "request_id": d.request_id,
                "endpoint": d.endpoint,
                "replica": d.replica,
                "tenant": d.tenant,
                "status": out.status,
                "prompt_tokens": out.prompt_tokens
                if out.prompt_tokens is not None
                else d.prompt_tokens,
                "cached_tokens": out.cached_tokens,
                "predicted_cached_tokens": predicted,
                "ttft_s": out.ttft_s,
                "e2e_s": out.e2e_s,
                "strategy": d.decision.strategy.value,
                "reason": d.decision.reason,
                "kv_usage": load.kv_usage if load is not None else None,
                "queued_tokens": load.queued_prefill_tokens if load is not None else None,
            }
        )

    def relay_warning_due(self, replica: str, kind: str, interval_s: float = 60.0) -> bool:
        """Whether a WARNING about ``replica``'s answers of ``kind`` (an oversized upstream
        event, an oversized body) is due: one a minute per replica and kind, so a replica
        that breaks every answer does not log each one (the metric counts each), and one
        kind's WARNING does not hide the other's."""
        now, last = time.monotonic(), self._relay_warned.get((replica, kind))
        if last is not None and now - last < interval_s:
            return False
        self._relay_warned[(replica, kind)] = now
        return True

    def body_too_large(self, replica: str, exc: Exception, fate: str, **extra: Any) -> None:
        """An upstream body of ``replica``'s refused at ``KVGATE_MAX_UPSTREAM_BODY_BYTES``
        (a relayed answer: ``fate`` "not relayed"; a poll's or a cancel's: "not read"):
        counted, and logged once a minute per replica as an oversized event is."""
        self.metrics.upstream_errors.labels(replica, BODY_TOO_LARGE).inc()
        if self.relay_warning_due(replica, BODY_TOO_LARGE):
            log.warning(
                f"upstream answer over KVGATE_MAX_UPSTREAM_BODY_BYTES: {fate}",
                extra={"replica": replica, **extra, "error": str(exc)},
            )

    def _warn_precision(
        self, msg: str, d: Dispatch, engine_prompt: int | None, cached: int
    ) -> None:
        now = time.monotonic()
        if now - self._warn_at < self.policy.precision.warn_interval_s:
            return
        self._warn_at = now
        log.warning(
            msg,
            extra={
                "replica": d.replica,
                "request_id": d.request_id,
                "predicted_cached": d.decision.predicted_cached_tokens,
                "actual_cached": cached,
                "gateway_prompt_tokens": d.prompt_tokens,
                "engine_prompt_tokens": engine_prompt,
            },
        )

    def _claimed(self, d: Dispatch) -> int:
        """Blocks the index claimed stored on ``d``'s replica at its lookup, in the
        engine's blocks (an EAGLE/MTP engine drops the last block of a hit; the index
        rightly holds it); 0 when no claim check is due."""
        if not self.policy.quarantine.enabled or not d.matches:
            return 0
        match = d.matches[d.salt_index].get(d.replica)
        if match is None:
            return 0
        claimed = hit_blocks(match.stored_blocks, d.prompt_tokens, d.block_size, d.hit_drop_blocks)
        return claimed if claimed >= self.policy.quarantine.min_claimed_blocks else 0

    def _keep_claim(self, d: Dispatch) -> None:
        """Of ``d``'s keys and matches, only what its claim check reads (the chosen salt's
        keys up to the claim and the engine's dropped blocks, packed in ``claim_keys``; its
        replica's match): a watched run holds them until it ends (D33)."""
        claimed, si = self._claimed(d), d.salt_index
        if not claimed:
            d.keys, d.matches = [], []
            return
        d.claim_keys = b"".join(d.keys[si][: claimed + d.hit_drop_blocks])
        d.keys = []
        d.matches = [{d.replica: m[d.replica]} if i == si else {} for i, m in enumerate(d.matches)]

    @staticmethod
    def _claim_chain(d: Dispatch, end: int) -> list[BlockKey]:
        """The first ``end`` keys of ``d``'s chosen salt, kept packed by a watch."""
        if not d.claim_keys:
            return d.keys[d.salt_index][:end]
        packed = d.claim_keys[: end * KEY_BYTES]
        return [packed[i : i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]

    def _check_claims(self, d: Dispatch, cached_tokens: int) -> None:
        claimed = self._claimed(d)
        if claimed:
            self.spawn(self._recheck(d, claimed, cached_tokens // d.block_size))

    async def _recheck(self, d: Dispatch, claimed: int, actual: int) -> None:
        assert self.index is not None
        still, late = claimed, False
        if actual < claimed:  # only a disagreement needs the "no removal in between" check
            if self._settling[d.replica] >= MAX_SETTLING_CHECKS:
                self.metrics.claim_checks.labels(d.replica, "skipped").inc()
                return  # enough evidence in flight for this replica; stay bounded
            self._settling[d.replica] += 1
            try:
                got = await self._settled_claim(d, claimed)
            finally:
                self._settling[d.replica] -= 1
                if not self._settling[d.replica]:
                    del self._settling[d.replica]  # an entry per replica ever checked, else
            if got is None:
                self.metrics.claim_checks.labels(d.replica, "skipped").inc()
                return  # cannot tell an eviction from a lie without the shared index
            still, late = got
        answer: LogAnswer | None = None
        if actual < claimed <= still:
            # the claim stands, but its first missing block may have been evicted after the
            # lookup and stored again by this very request before the check looked
            # the engine's chain ended hit_drop_blocks past what it served
            answer = await self._restored_since_lookup(d, actual + d.hit_drop_blocks)
            if answer is None or (answer is LogAnswer.UNVERIFIABLE and d.watched):
                # the index did not answer (the gateway's failure); or a background run's
                # check, judged at its watch's end up to an hour after its lookup: an
                # honest log trims past that (16,384 removals an hour, a reset, a
                # rewrite), which max_unverifiable, sized for the seconds a synchronous
                # answer takes (D22), would hold against a healthy replica. No verdict
                self.metrics.claim_checks.labels(d.replica, "skipped").inc()
                return
        if actual >= claimed:
            outcome = "agree"
        elif still < claimed:  # "evicted_late": the report came after the response
            outcome = "evicted_late" if late else "evicted"
        elif answer is LogAnswer.REMOVED:
            outcome = "evicted_restored"
        elif answer is LogAnswer.NOT_REMOVED:
            outcome = "false"
        else:  # "unverifiable", or "tampered" (counted as false): an impossible floor or time
            outcome = str(answer)
        if self._departed(d.replica) or (
            d.target is not None
            and self.pool is not None
            and self.pool.get(d.replica) is not d.target
        ):
            # removed, or replaced under its id, while its check was out: no verdict, no
            # quarantine to watch (the new engine's index says nothing of the old claims)
            return
        self.metrics.claim_checks.labels(d.replica, outcome).inc()
        unverifiable = answer is LogAnswer.UNVERIFIABLE
        changed = self.quarantine.observe(
            ClaimCheck(
                d.replica,
                claimed,
                actual,
                still,
                removed_since_lookup=answer is LogAnswer.REMOVED,
                unverifiable=unverifiable,
            )
        )
        if changed is not None:
            self.metrics.quarantined.labels(d.replica).set(1 if changed else 0)
            self.metrics.quarantine_changes.labels(d.replica, "in" if changed else "out").inc()
            if not changed:
                msg = "replica left quarantine"
            elif unverifiable:
                msg = (
                    "replica quarantined: quarantine.max_unverifiable disagreements its "
                    "removal log could not judge among its last "
                    "quarantine.unverifiable_window checked requests (a raised rm_floor, "
                    "or a removal log too short for its churn)"
                )
            else:
                msg = (
                    "replica quarantined: its index claims are wrong (no eviction reported "
                    "within quarantine.settle_s)"
                )
            log.warning(
                msg,
                extra={
                    "replica": d.replica,
                    "claimed": claimed,
                    "actual": actual,
                    "outcome": outcome,
                    **self.quarantine.standing(d.replica),
                },
            )
            if changed:
                # one watcher per quarantine: an earlier one's epoch baseline is stale
                old = self._quarantine_watchers.pop(d.replica, None)
                if old is not None:
                    old.cancel()
                self._quarantine_watchers[d.replica] = self.spawn(self._watch_quarantine(d.replica))

    async def _check_eviction_policy(self, index: RedisIndex) -> None:
        """An ERROR (and kvgate_index_evicting 1) at start-up when the index's Redis may
        evict any key (``allkeys-*``): it silently empties replicas' entries (R6). Its
        agents warn too and rewrite what they lose; a read that fails is no reason not to
        serve (the index may be down: lookups fall back)."""
        try:
            async with asyncio.timeout(2.0):
                policies = await index.eviction_policies()
        except (IndexError_, TimeoutError):
            return
        evicting = sorted({p for p in policies.values() if p is not None and evicts_any_key(p)})
        self.metrics.index_evicting.set(1 if evicting else 0)
        if evicting:
            log.error(
                "the index's Redis evicts any key (maxmemory-policy %s): replicas' index "
                "entries go under memory pressure and cache-aware routing with them until "
                "their agents rewrite them; set maxmemory-policy noeviction (or volatile-*)",
                ", ".join(evicting),
                extra={"policies": policies},
            )

    async def _watch_quarantine(self, replica: str, interval_s: float = 1.0) -> None:
        """While ``replica`` is quarantined, watch its index epoch: a new one means its
        agent cleared the entries and wrote them again from the engine, so the claims that
        earned the quarantine are gone, and it is lifted. Otherwise release needs
        ``recover_after`` agreeing checks, which come slowly to a replica routed by load
        only (a reviewer saw a rebuilt replica's cache ignored for about a minute)."""
        assert self.index is not None
        primary = self.index.primary
        try:
            epoch = (await primary.meta(replica)).epoch
        except IndexError_:  # the index is down: release by checks only
            return
        while self.quarantine.is_quarantined(replica):
            await asyncio.sleep(interval_s)
            if self.pool is not None and self.pool.get(replica) is None:
                return  # removed from the pool: nothing left to watch
            try:
                now = (await primary.meta(replica)).epoch
            except IndexError_:  # meta reads what an agent wrote as absent: no ValueError
                continue
            if now == epoch:
                continue
            if self.quarantine.release(replica):
                self.metrics.quarantined.labels(replica).set(0)
                self.metrics.quarantine_changes.labels(replica, "out").inc()
                log.warning(
                    "replica left quarantine: its index was rebuilt from the engine",
                    extra={"replica": replica, "epoch": now, "was": epoch},
                )
            elif self.quarantine.is_quarantined(replica):
                # its agent can rebuild at will: a rebuild lifts one quarantine, and the
                # next only once agreeing checks proved the replica since; never a repeat
                # offender's (W3)
                log.warning(
                    "replica stays quarantined although its index was rebuilt: a rebuild "
                    "already lifted a quarantine of it since it last proved its claims, or "
                    "it is a repeat offender; quarantine_recover_after agreeing checks "
                    "release it",
                    extra={
                        "replica": replica,
                        "epoch": now,
                        "was": epoch,
                        **self.quarantine.standing(replica),
                    },
                )
                epoch = now  # said once per rebuild

    async def _restored_since_lookup(self, d: Dispatch, first_missing: int) -> LogAnswer | None:
        """Whether the index removed block ``first_missing`` of the claim from ``d.replica``
        since the lookup (less ``quarantine.clock_skew_ms``: agents stamp removals with
        their own clocks). The agent wrote the removal's time and, when the log cannot
        tell, the floor it rests on: both are judged (:func:`~gateway.quarantine.judge_removal`,
        :func:`~gateway.quarantine.judge_floor`, beyond ``quarantine.tamper_margin_ms``).
        None only when the index fails or times out: the gateway's own failure, which
        judges nothing."""
        assert self.index is not None
        primary = self.index.primary
        key = self._claim_chain(d, first_missing + 1)[first_missing]
        pol = self.policy.quarantine
        timeout_s = self.policy.index.lookup_timeout_ms / 1000.0
        try:
            async with asyncio.timeout(timeout_s):
                got = await primary.removal_times(d.replica, [key], d.lookup_ms - pol.clock_skew_ms)
            if got is not None:
                return judge_removal(got[0], _now_ms(), pol.tamper_margin_ms)
            async with asyncio.timeout(timeout_s):
                floor = await primary.removal_floor(d.replica)
        except (IndexError_, TimeoutError):
            return None
        return judge_floor(floor, _now_ms(), pol.tamper_margin_ms)

    async def _settled_claim(self, d: Dispatch, claimed: int) -> tuple[int, bool] | None:
        """Blocks the index still claims on ``d.replica`` once the agent had time to report
        an eviction: looked up until the claim drops below ``claimed`` or
        ``quarantine.settle_s`` passes; and whether it took more than the first look (the
        cases the settle rule exists for). None when the shared index does not answer.
        ``claimed`` and the answer are in the engine's blocks: the index's, less the blocks
        the engine drops off a hit (``Dispatch.hit_drop_blocks``)."""
        assert self.index is not None
        drop = d.hit_drop_blocks
        keys = self._claim_chain(d, claimed + drop)
        deadline = time.monotonic() + self.policy.quarantine.settle_s
        looks = 0
        while True:
            looks += 1
            res = await self.index.lookup(
                keys, [d.replica], _now_ms(), self.policy.index.lookup_timeout_ms / 1000.0
            )
            if res.source != "primary":
                return None
            still = max(0, res.matches.get(d.replica, empty_match()).stored_blocks - drop)
            left = deadline - time.monotonic()
            if still < claimed or left <= 0:
                return still, looks > 1
            await asyncio.sleep(min(SETTLE_POLL_S, left))

    def _fit(self, d: Dispatch, out: Outcome, prompt: int) -> None:
        pol = self.policy.cost.fit
        if not pol.enabled or d.load_at_dispatch is None or out.cached_tokens is None:
            return
        if out.ttft_s is not None and d.stream:
            ttft = out.ttft_s
        elif not d.stream and (out.completion_tokens or 0) <= 1:
            ttft = out.e2e_s  # a one-token answer: its latency is its TTFT
        else:
            return
        x = features(max(0, prompt - out.cached_tokens), 0.0, d.load_at_dispatch)
        self.fit.update(x, ttft * 1000.0)

    # ------------------------------------------------------------------ admin views
    def replicas_state(self) -> list[dict[str, object]]:
        assert self.pool is not None
        now = time.monotonic()
        out = []
        for r in self.pool.all():
            st = r.state(now)
            st.update(self.quarantine.standing(r.id))
            qt, qr, run = self.inflight.own(r.id)
            st["own_queued_tokens"], st["own_queued_requests"], st["own_running"] = qt, qr, run
            out.append(st)
        return out

    def replica(self, replica_id: str) -> Replica:
        assert self.pool is not None
        rep = self.pool.get(replica_id)
        if rep is None:
            raise GatewayError(404, f"unknown replica {replica_id!r}", code="unknown_replica")
        return rep


def _priority_rewrite(rule: PriorityPolicy, body: Mapping[str, Any]) -> tuple[int | None, bool]:
    """What the tenant's priority rule makes of the request's: (the value to send in place
    of the client's, or None to leave it; whether to remove the client's). A client's
    priority that is no integer (vLLM's type) is a 400."""
    present = "priority" in body
    sent = None
    if present:
        try:
            sent = _PRIORITY.validate_python(body["priority"])
        except ValidationError:
            raise bad_request("'priority' must be an integer", "priority") from None
    if rule.mode == "passthrough":
        return None, False
    want = rule.upstream(sent)
    if want is None:
        return None, present
    if present and type(body["priority"]) is int and body["priority"] == want:
        return None, False  # already what the rule gives: the client's bytes stay
    return want, False


def _engine_tools(body: Mapping[str, Any]) -> bool:
    """Whether a Responses request offers tools its engine runs itself (vLLM's built-ins:
    not a function, custom or namespace tool, which return to the client)."""
    tools = body.get("tools")
    return isinstance(tools, list) and any(
        not isinstance(t, dict) or t.get("type") not in ("function", "custom", "namespace")
        for t in tools
    )


def _responses_chat(
    body: Mapping[str, Any], model: str, server: ServerChatDefaults | None = None
) -> tuple[dict[str, Any], bool]:
    """A Responses request's instructions, input and function tools as the chat the
    engine renders on a server started with ``server``'s flags (its tools left out under
    ``--exclude-tools-when-tool-choice-none``: ``ServerChatDefaults.excludes_tools``)
    (no previous response's conversation: a follow-up's is the engine's),
    with its rendering fields as a chat completion's (a partial final message continued,
    its reasoning effort and template kwargs), read as the replica reads it
    (``render_request``), a 400 naming the field it refuses; and whether that chat is the
    engine's prompt exactly (False: tools the gateway cannot render, so no keys; see
    ``chat_tools``)."""
    try:
        req = render_request(body, [], None, server)
    except ResponsesInputError as exc:
        raise bad_request(str(exc), exc.param) from None
    chat: dict[str, Any] = {"model": model, "messages": req.messages, **req.fields}
    if req.tools:
        chat["tools"] = req.tools
    elif req.tools is not None:
        # tools vLLM renders as [] (built-in types alone), laid over the engine's default
        # tools by its preprocess_chat: a chat's tools: [] is its 400, so the kwargs' []
        # (the same merge, unless the request's own kwargs set tools, which win)
        kwargs = chat.get("chat_template_kwargs") or {}
        if _unset_kwarg(kwargs.get("tools")):
            chat["chat_template_kwargs"] = {**kwargs, "tools": []}
    return chat, req.exact


# the retrieval route's query fields as vLLM's FastAPI route reads them: pydantic, lax
# (" 3 ", "3.0" and "1_000" are integers, " true" and "３" are refused: lax_bool)
_QUERY_INT = TypeAdapter(int | None)


def _retrieval_query(query: object) -> tuple[str, bool]:
    """``GET /v1/responses/{id}``'s query as sent upstream, and whether it streams (D33):
    vLLM's ``stream`` (a boolean) and ``starting_after`` (an integer: the sequence number
    the replay starts after), checked here, as the engine would, so that the gateway knows
    the answer is a stream; nothing else of the client's goes on."""
    q = query if isinstance(query, Mapping) else {}
    parts: list[str] = []
    stream = False
    if "stream" in q:
        try:
            flag = lax_bool(str(q["stream"]))
        except ValidationError:
            raise bad_request("'stream' must be a boolean", "stream") from None
        stream = bool(flag)
        parts.append(f"stream={'true' if stream else 'false'}")
    if "starting_after" in q:
        try:
            after = _QUERY_INT.validate_python(str(q["starting_after"]))
        except ValidationError:
            raise bad_request("'starting_after' must be an integer", "starting_after") from None
        parts.append(f"starting_after={after}")
    return ("?" + "&".join(parts) if parts else ""), stream


def streamed_retrieval(query: Mapping[str, str] | None) -> bool:
    """Whether ``GET /v1/responses/{id}``'s query asks for a replayed stream, read as
    :meth:`Gateway.prepare` reads it; a query it refuses (its 400) is not one."""
    try:
        return _retrieval_query(query)[1]
    except GatewayError:
        return False


def _may_hold_orphan(d: Dispatch, out: Outcome) -> bool:
    """Whether ``d``, a background POST still dispatched, may have a run on its engine whose
    answer (its id) the client never got: no status was read from it, and the engine did
    not answer otherwise (a 4xx refusal, an error answer: no run) nor never got it."""
    return (
        d.background
        and d.ticket is not None
        and d.response_status is None
        and not 400 <= out.status < 499
        and out.error not in _NO_ENGINE
        and not (out.error or "").startswith("http_")
    )


def _response_not_found(sealed: object) -> GatewayError:
    """The engine's own 404 for a response it does not hold (vLLM's words), so an id of
    another tenant, a forged one and a lost one read alike."""
    shown = sealed if isinstance(sealed, str) else ""
    return GatewayError(
        404,
        f"Response with id '{shown[:200]}' not found.",
        code="response_not_found",
        param="response_id",
        type_="invalid_request_error",
    )


def _cold_replicas(tenant: str, tpol: TenantPolicy, ids: Sequence[str]) -> frozenset[str] | None:
    """The replicas a tenant under ``limits.cold_replica_count: k`` has its cold requests
    confined to: a stable per-tenant subset, the k ranked highest by rendezvous hashing;
    None when it is not confined (or k covers every replica)."""
    k_cold = tpol.limits.cold_replica_count
    if k_cold is None or k_cold >= len(ids):
        return None
    ranked = sorted(ids, key=lambda rid: rendezvous_weight(tenant, rid))
    return frozenset(ranked[-k_cold:])


def _base_models(rep: Replica) -> list[str]:
    """The base models ``rep`` serves: an adapter's requests use its base model's pool
    (checking it against the default pool gave false alarms, and four adapters hid the
    base)."""
    return sorted(m for m in rep.models or [] if m not in rep.lora_base)


def _context_len(reps: Sequence[Replica], model: str, base_model: str) -> int | None:
    """The model's context (max_model_len) as every candidate's /v1/models card gives it
    (an adapter's card, else its base model's); None when one gives none or they differ."""
    return card_max_model_len([r.cards.get(model) or r.cards.get(base_model) for r in reps])


def _now_ms() -> int:
    return int(time.time() * 1000)


def _session_id(value: str) -> str:
    """A client's session id, bounded in length without merging sessions: a long one is
    replaced by its digest (cut to a prefix, two sessions sharing it shared a scope)."""
    if len(value) <= 256:
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()


def _stricter(a: str, b: str) -> str:
    order = {"none": 0, "session": 1, "request": 2}
    return a if order[a] >= order[b] else b


def _best_match(rid: str, matches: Sequence[Mapping[str, PrefixMatch]]) -> tuple[PrefixMatch, int]:
    """The longest match of ``rid`` over the live salts (primary first on ties)."""
    best, idx = empty_match(), 0
    for i, per in enumerate(matches):
        m = per.get(rid)
        if m is None:
            continue
        if i == 0 or (m.pending_blocks, m.stored_blocks) > (
            best.pending_blocks,
            best.stored_blocks,
        ):
            best, idx = m, i
    return best, idx
