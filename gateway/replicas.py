"""The replicas behind the gateway: specs, health, ejection, cordon/drain, served models.

Health is decided here, by this gateway, from two signals: an active ``GET /health`` on
every replica each ``health.interval_s``, and passive outlier ejection (``eject_after``
consecutive request failures eject a replica for ``eject_s``; a refused connection ejects at
once, because it is definitive and the retry has already moved the request).

A refused connection also marks the replica unhealthy: it comes back only when ``eject_s``
has passed *and* ``healthy_after`` consecutive OK health checks have come after the last
failure (any request failure restarts that count), so one lucky check during a crash loop
cannot bring it back early. ``on_change(replica, routable)`` fires on every change of
:meth:`Replica.routable` from health checks, ejections, their expiry, cordon and drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from cachecore.agent.settings import check_engine_root_url, check_zmq_endpoint
from cachecore.httpread import AnswerTooLarge, read_answer
from cachecore.index.layout import split_dp_replica_id, validate_replica_id
from cachecore.looplag import LoopLagMonitor
from cachecore.registry import InvalidURLError, normalize_url
from cachecore.tasks import cancel_and_wait
from cachecore.urls import split_user_info
from gateway.errors import NO_REPLICA_RETRY_MAX_S, GatewayError, no_replica
from policies.schema import HealthPolicy

AGENT_ENDPOINT_SCHEMES = ("tcp://", "ipc://")
"""The schemes of the agent endpoints a replica spec takes (``URL=EVENTS,REPLAY``)."""

# where a spec's parts end: the host a refusal names stops there
_SPEC_SEPARATORS = re.compile("[=,]")

log = logging.getLogger(__name__)
_WHOLE_ANSWER_READS = 4  # a health or models answer's deadline, in per-read timeouts
# the most body read of a replica's answer (more is refused as it comes: an endless body was
# read into memory for as long as the deadline let it come, every round). /health: engines
# answer it empty or with a few fields. /v1/models: a card per served model and adapter
# (~0.5 KiB with vLLM's permission list), so an engine with thousands of LoRA adapters fits
_HEALTH_CAP = 64 << 10
_MODELS_CAP = 8 << 20
# a probe's timeout says nothing of the replica when the gateway's own loop lost at least
# this fraction of the per-read timeout to starvation while the probe was out
_STARVED_FRACTION = 0.5
_STARVED_LOG_INTERVAL_S = 60.0
# inconclusive probes in a row after which the next timeout counts all the same, in a round
# where another replica answered: a gateway stalled at every probe still takes a hung
# replica out (as it did before the rule), and never the whole fleet at once
_MAX_INCONCLUSIVE = 3


class ReplicaSpecError(ValueError):
    """A malformed ``--replica`` value."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """``[ID=]URL[=EVENTS,REPLAY]``: the engine's HTTP URL and, for embedded agents, its
    KV-event PUB and replay endpoints. The id defaults to ``host-port`` (index replica ids
    may not contain ``:``)."""

    id: str
    url: str
    events: str | None = None
    replay: str | None = None


def default_replica_id(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "replica"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}-{port}"


def _refuse_credentials(spec: str) -> None:
    """Refuse user info in any URL of ``URL[=EVENTS,REPLAY]`` (the engine's, a schemeless
    one as typed, and the agent endpoints'), looked for before it is split at its "=" and ","
    (a password may hold either) and before any error quotes a URL. httpx would send them
    with the health checks, the upstream transport never; refused first, never echoed."""
    schemes = [m.start() for m in re.finditer("://", spec)]
    # text before the first "://" is a schemeless URL's whole authority, or a scheme
    parts = [spec[: schemes[0]] if schemes else spec, *(spec[i:] for i in schemes)]
    for part in parts:
        info = split_user_info(part)
        if info is not None:
            host = _SPEC_SEPARATORS.split(info.host, maxsplit=1)[0]
            raise ReplicaSpecError(
                f"replica URL for {host or 'its host'} must not carry credentials "
                "(user:password@): the engine's API key goes in KVGATE_UPSTREAM_API_KEY"
            )


def parse_replica_spec(text: str) -> ReplicaSpec:
    raw = text.strip()
    rid: str | None = None
    head, sep, rest = raw.partition("=")
    if sep and "://" not in head:
        rid, raw = head, rest
    _refuse_credentials(raw)
    url, sep, agent = raw.partition("=")
    url = url.rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ReplicaSpecError(f"replica URL must be http(s)://host:port, got {url!r}")
    try:
        parts.port  # noqa: B018 (urllib checks the port when it is read)
    except ValueError as exc:
        raise ReplicaSpecError(f"replica URL {url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise ReplicaSpecError(f"replica URL must not carry a query or fragment, got {url!r}")
    try:  # an OpenAI client's base URL: the gateway adds /v1/... (and /health) itself
        check_engine_root_url(url)
    except ValueError as exc:  # the agent's --engine-url rule, in its words
        raise ReplicaSpecError(f"replica URL {exc}") from None
    events = replay = None
    if sep:
        ev, comma, rp = agent.partition(",")
        if not comma or not ev or not rp:
            raise ReplicaSpecError(f"agent endpoints must be EVENTS,REPLAY, got {agent!r}")
        for ep in (ev, rp):
            if not ep.startswith(AGENT_ENDPOINT_SCHEMES):
                raise ReplicaSpecError(f"agent endpoint must be tcp:// or ipc://, got {ep!r}")
            try:  # the embedded agent's own check: else a traceback at the gateway's start
                check_zmq_endpoint(ep)
            except ValueError as exc:
                raise ReplicaSpecError(f"agent endpoint: {exc}") from None
        events, replay = ev, rp
    named = rid is not None
    rid = rid or default_replica_id(url)
    try:
        validate_replica_id(rid)
    except ValueError as exc:
        if not named:  # the id made from the URL (an IPv6 address holds ':')
            raise ReplicaSpecError(
                f"{exc} (made from the URL): give the replica an id: ID={url}"
            ) from None
        raise ReplicaSpecError(str(exc)) from None
    return ReplicaSpec(rid, url, events, replay)


@dataclass(slots=True)
class Replica:
    spec: ReplicaSpec
    healthy: bool = True  # optimistic until the first check says otherwise
    ejected_until: float = 0.0
    consecutive_failures: int = 0
    health_fails: int = 0
    health_oks: int = 0
    health_inconclusive: int = 0  # probes in a row that timed out in a starved loop
    cordoned: bool = False
    draining: bool = False
    in_flight: int = 0
    reported: bool = True  # routability last given to on_change (a new replica starts routable)
    models: set[str] | None = None  # None: unknown yet (treated as serving everything)
    lora_base: dict[str, str] = field(default_factory=dict)  # adapter -> base model
    cards: dict[str, dict[str, object]] = field(default_factory=dict)  # its /v1/models entries
    block_size: int | None = None
    capacity: int | None = None
    # the engine core this replica is, for engines that serve several data-parallel ranks
    # behind one URL (sent as ``X-data-parallel-rank``); None: the URL is this replica's own
    dp_rank: int | None = None

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    def routable(self, now: float) -> bool:
        return (
            self.healthy and not self.cordoned and not self.draining and now >= self.ejected_until
        )

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def state(self, now: float) -> dict[str, object]:
        return {
            "id": self.id,
            "url": self.url,
            "healthy": self.healthy,
            "ejected_for_s": max(0.0, round(self.ejected_until - now, 3)),
            "cordoned": self.cordoned,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "models": sorted(self.models) if self.models is not None else None,
            "lora": dict(self.lora_base),
            "routable": self.routable(now),
            "dp_rank": self.dp_rank,
        }


@dataclass(frozen=True, slots=True)
class BaseModels:
    """What :meth:`ReplicaPool.base_models` finds: each base model's served names (the one
    to serve first), whether a routable replica's model list is unknown, and whether any
    replica is routable."""

    names: tuple[tuple[str, ...], ...]
    unknown: bool
    routable: bool


@dataclass(frozen=True, slots=True)
class _Probe:
    """One health probe's outcome: ``answered`` when the replica sent an answer (any
    status); ``stall`` when it timed out while the gateway's own loop stalled."""

    url: str  # where it went: a replica moved meanwhile is not judged by it
    ok: bool
    reason: str
    answered: bool = False
    stall: float | None = None


class ReplicaPool:
    """The gateway's view of its replicas. Mutated only from the event loop."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        policy: HealthPolicy,
        on_change: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_probe_ok: Callable[[str], None] | None = None,
        loop_lag: LoopLagMonitor | None = None,
        on_inconclusive: Callable[[str], None] | None = None,
    ) -> None:
        """``on_probe_ok(replica)``: after every health probe it answers (its models read).
        ``loop_lag``: this process's loop lateness; a probe that timed out while the loop
        was starved is inconclusive (``on_inconclusive(replica)``): it counts neither way."""
        self._client = client
        self.policy = policy
        self._replicas: dict[str, Replica] = {}
        self._on_change = on_change
        self._on_probe_ok = on_probe_ok
        self._loop_lag = loop_lag
        self._on_inconclusive = on_inconclusive
        self._starved_logged = -math.inf  # when a starved round was last logged
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._last_models = 0.0
        self._started = int(time.time())  # a card's `created` when its engine gives none
        self._shared_warned: set[str] = set()  # URLs shared without DP ids, warned once
        self._models_too_large: set[str] = set()  # replicas warned of it, once each
        # URL -> (engine name, lowest rank seen): a data-parallel engine's ranks, remembered
        self._dp_groups: dict[str, tuple[str, int]] = {}
        # id -> (cordoned, draining) of a removed replica the operator had cordoned or
        # drained: its word outlives a gap in the registration (a Redis restart empties the
        # registry until the agents' next heartbeat); one entry per such replica
        self._held: dict[str, tuple[bool, bool]] = {}
        # bumped by every change that can change :meth:`base_models` (membership, a model
        # list read, a routability reported): its answer is kept until the next bump
        self._version = 0
        self._bases: tuple[int, BaseModels] | None = None

    # ---------------------------------------------------------------- membership
    def add(self, spec: ReplicaSpec) -> Replica:
        """The replica ``spec`` names, added if new: routable until told otherwise, or
        cordoned or drained as it was when removed (:meth:`report` tells ``on_change``)."""
        rep = self._replicas.get(spec.id)
        if rep is None:
            self._version += 1
            rep = self._replicas[spec.id] = Replica(spec)
            held = self._held.pop(spec.id, None)
            if held is not None:
                rep.cordoned, rep.draining = held
            self._assign_dp_ranks()
        return rep

    def remove(self, replica_id: str) -> None:
        rep = self._replicas.pop(replica_id, None)
        self._models_too_large.discard(replica_id)  # back under its id: warned again, once
        if rep is not None:
            self._version += 1
            if rep.cordoned or rep.draining:
                self._held[replica_id] = (rep.cordoned, rep.draining)
            self._assign_dp_ranks()

    def report(self, replica_id: str) -> None:
        """Tell ``on_change`` the replica's routability if it differs from what it last
        heard (a replica just added starts as routable)."""
        rep = self._replicas.get(replica_id)
        if rep is not None:
            self._sync(rep)

    def move(self, replica_id: str, url: str) -> Replica:
        """``replica_id``'s engine now answers at ``url`` (its agent re-registered it there):
        requests and health checks go there from now on. What this gateway knew of the old
        URL (health, ejection, models, rank) is forgotten, as for a replica just added; the
        operator's cordon and drain stay, since they name the replica. ``on_change`` hears
        the old engine leave service (False) before the new one's routability: what a
        listener checked of an engine (the gateway's block size and tokenizer checks) is
        the old one's."""
        rep = self._require(replica_id)
        rep.spec = ReplicaSpec(replica_id, url)
        rep.healthy, rep.ejected_until, rep.consecutive_failures = True, 0.0, 0
        rep.health_fails = rep.health_oks = 0
        rep.models, rep.lora_base, rep.cards = None, {}, {}
        self._version += 1
        rep.block_size = rep.capacity = rep.dp_rank = None
        self._assign_dp_ranks()
        if rep.reported:
            rep.reported = False
            self._changed(rep.id, False)
        self._sync(rep)
        return rep

    def _url_key(self, rep: Replica) -> str:
        try:
            return normalize_url(rep.url)
        except InvalidURLError:  # a spec's URL is checked when parsed; be tolerant here
            return rep.url.rstrip("/").lower()

    def _assign_dp_ranks(self) -> None:
        """Replicas sharing one URL are the data-parallel ranks of one engine (vLLM's
        internal load balancing: one API server, a KV cache per rank) when their ids are
        its agents' index ids, ``R`` (rank 0) and ``R@dpN``: each request then names its
        rank, so it runs on the cache the index matched. The rank sent is counted from the
        lowest rank seen at the URL (vLLM's hybrid balancing numbers a node's engines from
        0, its agents by the global rank), and a URL once seen with ranks keeps them while
        a rank's registration comes and goes: a lone ``R@dpN`` at any other URL is a server
        of its own (external balancing) and gets no header. Replicas sharing a URL under
        other ids get no rank, and a warning: their caches are one engine's, not several."""
        by_url: dict[str, list[Replica]] = {}
        for rep in self._replicas.values():
            by_url.setdefault(self._url_key(rep), []).append(rep)
        # what is kept per URL goes with its last replica (a data-parallel engine's ranks
        # share one URL): autoscaled pods' fresh IPs grew it for the gateway's life
        for gone in [u for u in self._dp_groups if u not in by_url]:
            del self._dp_groups[gone]
        self._shared_warned.intersection_update(by_url)
        for url, reps in by_url.items():
            ranks: list[int | None] = [None] * len(reps)
            split = [split_dp_replica_id(r.id) for r in reps]
            names = {name for name, _ in split}
            given = [0 if rank is None else rank for _, rank in split]
            seen = self._dp_groups.get(url)
            if len(names) == 1 and len(set(given)) == len(reps):
                name = next(iter(names))
                if len(reps) > 1 or (seen is not None and seen[0] == name):
                    base = min(given)
                    if seen is not None and seen[0] == name:
                        base = min(base, seen[1])
                    self._dp_groups[url] = (name, base)
                    ranks = [g - base for g in given]
            elif url not in self._shared_warned:
                self._shared_warned.add(url)
                log.warning(
                    "replicas share one URL without data-parallel ids (R, R@dp1, ...): "
                    "requests cannot be pinned to a cache, so predictions will miss",
                    extra={"url": url, "replicas": sorted(r.id for r in reps)},
                )
            if any(r.dp_rank != rank for r, rank in zip(reps, ranks, strict=True)):
                for rep, rank in zip(reps, ranks, strict=True):
                    rep.dp_rank = rank
                if any(rank is not None for rank in ranks):
                    log.info(
                        "data-parallel ranks behind one URL: each request names its rank",
                        extra={"url": url, "ranks": {r.id: r.dp_rank for r in reps}},
                    )

    def same_server(self, replica_id: str) -> list[Replica]:
        """The replicas served at ``replica_id``'s URL (itself included)."""
        rep = self._replicas.get(replica_id)
        if rep is None:
            return []
        key = self._url_key(rep)
        return [r for r in self._replicas.values() if r is rep or self._url_key(r) == key]

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def ids(self) -> list[str]:
        return list(self._replicas)

    # ---------------------------------------------------------------- selection
    def no_replica_error(self, message: str, param: str | None = None) -> GatewayError:
        """The 503 ``no_replica`` (none of these replicas can serve a request now), with
        ``Retry-After``: the health-check interval, rounded up to whole seconds (1 s at the
        default 0.5 s), at most :data:`~gateway.errors.NO_REPLICA_RETRY_MAX_S`. Until the
        next check the pool's view of its replicas' health cannot change, so an earlier
        retry spends one of the client's few (the OpenAI SDKs make 2) on the same answer;
        an uncordon or a registration may come sooner, and is met by the retry after it."""
        return no_replica(message, min(self.policy.interval_s, NO_REPLICA_RETRY_MAX_S), param)

    def candidates(self, model: str, exclude: Iterable[str] = ()) -> list[Replica]:
        """Routable replicas serving ``model`` (a base model or a LoRA adapter name)."""
        now = self._clock()
        skip = set(exclude)
        return [
            r
            for r in self._replicas.values()
            if r.id not in skip and r.routable(now) and r.serves(model)
        ]

    def base_model(self, model: str, replicas: Iterable[Replica]) -> tuple[str, str | None]:
        """(model the keys use, LoRA name) for a request naming ``model``. A name that is a
        base model on one replica and an adapter on another means the base model (see
        :meth:`same_meaning`)."""
        reps = list(replicas)
        # a replica whose models are not read yet (just discovered) says nothing either way
        if any(r.models is not None and model not in r.lora_base for r in reps):
            return model, None
        for r in reps:
            base = r.lora_base.get(model)
            if base is not None:
                return base, model
        return model, None

    @staticmethod
    def same_meaning(
        model: str, lora: str | None, base: str, replicas: Iterable[Replica]
    ) -> list[Replica]:
        """The replicas on which ``model`` means what :meth:`base_model` decided: a base
        model, or the adapter ``lora`` of ``base``. Two models answering under one name
        (an adapter named like another replica's base model) must not share a request."""
        if lora is None:
            return [r for r in replicas if model not in r.lora_base]
        return [r for r in replicas if r.models is None or r.lora_base.get(model) == base]

    # ---------------------------------------------------------------- passive signals
    def _sync(self, rep: Replica) -> None:
        """Tell on_change when ``rep``'s routability differs from what it last heard (not
        for a replica object the pool no longer holds: a probe that was out when its
        replica was removed, or replaced by a new one under the same id, reports late)."""
        if self._replicas.get(rep.id) is not rep:
            return
        now = self._clock()
        routable = rep.routable(now)
        if routable != rep.reported:
            rep.reported = routable
            self._changed(rep.id, routable)

    def _expired(self, replica_id: str) -> None:
        rep = self._replicas.get(replica_id)
        if rep is not None:
            self._sync(rep)

    def record_success(self, replica_id: str) -> None:
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.consecutive_failures = 0

    def record_failure(self, replica_id: str, definitive: bool = False) -> None:
        rep = self._replicas.get(replica_id)
        if rep is None:
            return
        if definitive and rep.dp_rank is not None:
            # a refused connection is the whole server's: its other ranks too (a retry on
            # a sibling rank would meet the same closed port)
            for other in self.same_server(replica_id):
                if other is not rep and other.dp_rank is not None:
                    self._record_failure(other, True)
        self._record_failure(rep, definitive)

    def _record_failure(self, rep: Replica, definitive: bool) -> None:
        rep.consecutive_failures += 1
        rep.health_oks = 0  # only OK checks after the last failure count towards healthy_after
        if definitive or rep.consecutive_failures >= self.policy.eject_after_failures:
            eject_s = self.policy.eject_s
            rep.ejected_until = self._clock() + eject_s
            rep.consecutive_failures = 0
            if definitive:
                rep.healthy = False  # and healthy_after OK checks to come back
            log.warning(
                "replica ejected",
                extra={"replica": rep.id, "for_s": eject_s, "definitive": definitive},
            )
            self._sync(rep)
            # report the expiry when it happens, not only at the next health round; a bit
            # late so the clock has surely passed it (a timer of an earlier, superseded
            # ejection finds the replica still out and reports nothing)
            with contextlib.suppress(RuntimeError):  # no loop: the health rounds report it
                asyncio.get_running_loop().call_later(eject_s + 0.01, self._expired, rep.id)

    def _changed(self, replica_id: str, healthy: bool) -> None:
        self._version += 1
        if self._on_change is not None:
            self._on_change(replica_id, healthy)

    # ---------------------------------------------------------------- operations
    def cordon(self, replica_id: str, on: bool = True) -> Replica:
        rep = self._require(replica_id)
        rep.cordoned = on
        if not on:
            rep.draining = False
        self._sync(rep)
        return rep

    def drain(self, replica_id: str) -> Replica:
        rep = self._require(replica_id)
        rep.draining = True
        self._sync(rep)
        return rep

    def _require(self, replica_id: str) -> Replica:
        rep = self._replicas.get(replica_id)
        if rep is None:
            raise KeyError(replica_id)
        return rep

    # ---------------------------------------------------------------- active checks
    async def check_once(self, refresh_models: bool = False) -> None:
        reps = list(self._replicas.values())
        answered = False  # some replica answered in this round: the loop could see answers
        past_streak: list[tuple[Replica, _Probe]] = []

        async def check(rep: Replica) -> None:
            nonlocal answered
            pr = await self._probe(rep)
            answered = answered or pr.answered
            if pr.stall is not None and rep.health_inconclusive >= _MAX_INCONCLUSIVE:
                past_streak.append((rep, pr))  # judged once the round is known
            else:  # applied as it comes: a dead replica is out before a slow peer answers
                await self._apply(rep, pr, False, refresh_models)

        await asyncio.gather(*(check(r) for r in reps))
        # a timeout past the streak is held against its replica only when another answered
        # in the round: all of a stalled gateway's probes time out together, and counting
        # them ejected the whole fleet at once
        await asyncio.gather(
            *(self._apply(rep, pr, answered, refresh_models) for rep, pr in past_streak)
        )

    async def _probe(self, rep: Replica) -> _Probe:
        url = rep.url
        where = f"GET {url}/health"
        t0 = self._loop_lag_clock()
        try:
            r = await self._read(rep, "/health", _HEALTH_CAP)
            return _Probe(url, r.status_code == 200, f"{where}: HTTP {r.status_code}", True)
        except httpx.TimeoutException as exc:
            return _Probe(
                url, False, f"{where}: {type(exc).__name__}: {exc}", stall=self._stall(t0)
            )
        except httpx.HTTPError as exc:
            return _Probe(url, False, f"{where}: {type(exc).__name__}: {exc}")
        except AnswerTooLarge as exc:  # not an engine's health answer
            return _Probe(url, False, f"{where}: {exc}", True)
        except TimeoutError as exc:  # no whole answer by the deadline
            return _Probe(url, False, f"{where}: {exc}", stall=self._stall(t0))

    async def _apply(self, rep: Replica, pr: _Probe, answered: bool, refresh_models: bool) -> None:
        p = self.policy
        if self._replicas.get(rep.id) is not rep or rep.url != pr.url:
            return  # removed, replaced or moved while its probe was out: not about it now
        if pr.stall is not None and (rep.health_inconclusive < _MAX_INCONCLUSIVE or not answered):
            self._inconclusive(rep, pr.stall)
            return
        rep.health_inconclusive = 0
        if pr.ok:
            rep.health_oks += 1
            rep.health_fails = 0
            recovered = False
            if not rep.healthy and rep.health_oks >= p.healthy_after:
                rep.healthy = True  # an ejection still runs its eject_s
                recovered = True
                log.info("replica healthy", extra={"replica": rep.id})
            if refresh_models or rep.models is None or recovered:
                # a replica back from a failure may be a restarted engine with other
                # adapters: its old model list would route requests to it that it 404s
                await self._models(rep)
            if self._on_probe_ok is not None:
                self._on_probe_ok(rep.id)
        else:
            rep.health_fails += 1
            rep.health_oks = 0
            if rep.healthy and rep.health_fails >= p.unhealthy_after:
                rep.healthy = False
                log.warning("replica unhealthy", extra={"replica": rep.id, "reason": pr.reason})
        self._sync(rep)  # also reports an ejection that expired since the last round

    async def _read(self, rep: Replica, path: str, cap: int) -> httpx.Response:
        """``GET path`` of ``rep``, its answer whole and at most ``cap`` bytes of body (a
        status other than 200 unread: the status says it all). A deadline for the whole
        answer too: httpx's timeout is per read, and a replica sending its answer a byte at
        a time held this round, every replica's, for as long as it dribbled. A few reads'
        worth: no stricter than the per-read timeout for an answer that comes (a loop pause
        in a busy process fell on the sum of connect, write and read)."""
        return await read_answer(
            self._client,
            "GET",
            rep.url + path,
            timeout_s=self.policy.timeout_s,
            deadline_s=_WHOLE_ANSWER_READS * self.policy.timeout_s,
            cap=cap,
            read_unless_ok=False,
        )

    def _loop_lag_clock(self) -> float:
        return self._loop_lag.now() if self._loop_lag is not None else 0.0

    def _stall(self, since: float) -> float | None:
        """The gateway's own stall while a probe that timed out was out, when it is long
        enough to have caused the timeout (one stall of at least half the per-read timeout:
        a CPU-throttled gateway fired every probe's timer late, in the same loop turn as
        the answer, and marked every replica unhealthy: the whole fleet 503 for a round, at
        start-up for the first requests); None when the timeout is the replica's."""
        if self._loop_lag is None:
            return None
        stall = self._loop_lag.longest_stall_since(since)
        return stall if stall >= _STARVED_FRACTION * self.policy.timeout_s else None

    def _inconclusive(self, rep: Replica, stall: float) -> None:
        """A probe that counts neither way (up to ``_MAX_INCONCLUSIVE`` in a row, more in
        rounds where no replica answered)."""
        rep.health_inconclusive += 1
        if self._on_inconclusive is not None:
            self._on_inconclusive(rep.id)
        now = self._loop_lag_clock()
        if now - self._starved_logged >= _STARVED_LOG_INTERVAL_S:
            self._starved_logged = now
            log.warning(
                "health probe timed out while the gateway's event loop was stalled: not "
                "held against the replica (logged at most once a minute)",
                extra={"replica": rep.id, "loop_stall_s": round(stall, 3)},
            )
        self._sync(rep)

    async def _models(self, rep: Replica) -> None:
        try:
            r = await self._read(rep, "/v1/models", _MODELS_CAP)
            data = r.json().get("data", []) if r.status_code == 200 else None
        except AnswerTooLarge as exc:
            # said once per replica (a list never read is asked for every round): silent,
            # an engine with more adapters than the cap allows would just never route
            # (not for a replica removed while its probe was out: it would stay for ever)
            if rep.id not in self._models_too_large and self._replicas.get(rep.id) is rep:
                self._models_too_large.add(rep.id)
                log.warning(
                    "replica's /v1/models too large to read: its models not refreshed",
                    extra={"replica": rep.id, "error": str(exc)},
                )
            return
        except (httpx.HTTPError, ValueError, AttributeError, TimeoutError):
            return
        if not isinstance(data, list):
            return
        models: set[str] = set()
        lora: dict[str, str] = {}
        cards: dict[str, dict[str, object]] = {}
        for m in data:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str):
                continue
            models.add(m["id"])
            cards[m["id"]] = m
            parent = m.get("parent")
            if isinstance(parent, str) and parent and parent != m["id"]:
                lora[m["id"]] = parent
        rep.models, rep.lora_base, rep.cards = models, lora, cards
        self._version += 1

    def model_cards(self) -> list[dict[str, object]]:
        """Union of every replica's /v1/models entries, one per id (a routable replica's
        card where one lists it, else the first replica's, as the engine wrote it:
        ``max_model_len``, ``root``, ``parent`` and any other field pass through), each
        with OpenAI's required ``object``, ``created`` and ``owned_by``.

        Replicas out of service (cordoned, draining, unhealthy, ejected) count too: a
        request naming their models is a retryable 503 ``no_replica``, not a 404
        ``model_not_found`` (``Gateway.prepare``), so the list says what exists, not
        what is routable this instant. Listed only by routable replicas, a fleet
        cordoned for maintenance listed nothing, and a client that checks the list
        before sending concluded its model did not exist."""
        now = self._clock()
        seen: dict[str, dict[str, object]] = {}
        # routable replicas first: their cards are the ones read from engines serving now
        order = sorted(self._replicas.values(), key=lambda r: not r.routable(now))
        for rep in order:
            if rep.models is None:
                continue
            for mid in sorted(rep.models):
                if mid in seen:
                    continue
                card: dict[str, object] = {"id": mid, **rep.cards.get(mid, {})}
                card["object"] = "model"
                if not isinstance(card.get("created"), int):
                    card["created"] = self._started
                if not isinstance(card.get("owned_by"), str):
                    card["owned_by"] = "kvgate"
                if mid in rep.lora_base:
                    card["parent"] = rep.lora_base[mid]
                    card.setdefault("root", rep.lora_base[mid])
                seen[mid] = card
        return list(seen.values())

    def base_models(self) -> BaseModels:
        """The base models (adapters aside) the routable replicas serve, each under its
        served names, and whether a routable replica's list is not known yet: what a
        request without ``model`` is served by. Kept until the pool changes (membership, a
        /v1/models read, a routability reported): rebuilt per request it cost 44-136 us at
        256 replicas (review V2)."""
        cached = self._bases
        if cached is not None and cached[0] == self._version:
            return cached[1]
        bases = self._base_models()
        self._bases = (self._version, bases)
        return bases

    def model_names(self, model: str) -> tuple[str, ...]:
        """Every name the routable replicas serve ``model``'s engine model by (vLLM's
        ``--served-model-name`` aliases, grouped as :meth:`base_models` groups them), or
        ``model`` alone: a rule naming a model (``sensitive.models``) must hold for each
        name a client may route to it by."""
        for names in self.base_models().names:
            if model in names:
                return names
        return (model,)

    def _base_models(self) -> BaseModels:
        """One engine model served under several names (vLLM's ``--served-model-name a
        b``: a card per name, one ``root``, no ``parent``) is one model: names are grouped
        by their cards' ``root`` (and by name across replicas). A group's name to serve is
        the one most replicas list first (vLLM serves its first served name; ties: the
        first seen), then the others in the order seen."""
        now = self._clock()
        up: dict[str, str] = {}  # union-find over names and ("\0" + root)

        def find(x: str) -> str:
            up.setdefault(x, x)
            while up[x] != x:
                up[x] = up[up[x]]
                x = up[x]
            return x

        order: dict[str, int] = {}
        firsts: dict[str, int] = {}
        unknown = routable = False
        for rep in self._replicas.values():
            if not rep.routable(now):
                continue
            routable = True
            if rep.models is None:
                unknown = True  # takes any named model; says nothing of which
                continue
            # its /v1/models order (the cards'), when the cards are its models'
            listed = list(rep.cards) if rep.cards.keys() == rep.models else sorted(rep.models)
            first = True
            for mid in listed:
                if mid in rep.lora_base:
                    continue
                order.setdefault(mid, len(order))
                root = rep.cards.get(mid, {}).get("root")
                if isinstance(root, str) and root:
                    up[find(mid)] = find("\0" + root)
                else:
                    find(mid)
                if first:
                    firsts[mid] = firsts.get(mid, 0) + 1
                    first = False
        groups: dict[str, list[str]] = {}
        for mid in order:
            groups.setdefault(find(mid), []).append(mid)
        named = [
            tuple(sorted(names, key=lambda n: (-firsts.get(n, 0), order[n])))
            for names in groups.values()
        ]
        return BaseModels(tuple(sorted(named)), unknown, routable)

    async def run(self) -> None:
        """Health loop: checks every interval, refreshes models every models_refresh_s."""
        while True:
            now = self._clock()
            refresh = now - self._last_models >= self.policy.models_refresh_s
            if refresh:
                self._last_models = now
            try:
                await self.check_once(refresh_models=refresh)
            except Exception:  # the loop must survive anything a replica sends
                log.exception("health check round failed")
            await asyncio.sleep(self.policy.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
