"""A replica that discovery removes for good leaves nothing behind in the gateway.

Before, only the local index forgot it (7f04de9); everything else the gateway keeps per
replica id stayed for its whole life, one entry per id ever seen, so autoscaled fleets
(fresh ids at each scale-up) grew its memory and its /metrics without bound: the
per-replica Prometheus series (healthy, TTFT and e2e histograms, precision counters,
upstream errors, claim checks, quarantine, ...), the quarantine tracker and its watcher,
the in-flight accounting (``InFlight._own``, the refresher's ``_pushed``), the router's
trees and tie rounds, the pool's once-per-replica warning and the in-memory load store.
``Gateway._replica_removed`` (Discovery's ``on_removed``) drops them; a replica added
again under its id is a new one.

Real pieces: a started gateway serving on loopback, its discovery over the in-process
MemoryRegistry, fake engines as raw asyncio servers on loopback
(tests/test_upstream_faults.py's FakeReplica), the embedded index and in-memory load
store. Discovery is refreshed by hand at the test's times."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from pydantic import SecretStr

from cachecore.index.base import ReplicaState
from cachecore.index.memory import MemoryIndex
from cachecore.keys import BlockKeyer, Scope, ScopeKind
from cachecore.lifecycle import IndexWrite
from cachecore.loadstate import (
    GARBAGE_GRACE_MS,
    PRUNE_AFTER_MS,
    EngineLoad,
    MemoryLoadStore,
)
from cachecore.registry import MemoryRegistry, Registration
from cachecore.scoring import Coefficients, LoadView
from cachecore.testing import free_port
from gateway.core import Dispatch, Gateway
from gateway.load import InFlight
from gateway.quarantine import ClaimCheck
from gateway.replicas import ReplicaPool, ReplicaSpec
from gateway.routing import (
    Candidate,
    Decision,
    Router,
    RouteRequest,
    RoutingParams,
    Strategy,
)
from gateway.serve import serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import HealthPolicy, parse_policy_text
from tests.test_upstream_faults import MODEL, FakeReplica, answer, completion, read_request

pytestmark = pytest.mark.timeout(120)

GRACE_MS = 5_000  # Discovery's default removal grace
CHURN = 50


def _usage_answer(cached: int) -> bytes:
    """A completion whose usage reports cached prompt tokens (the precision series)."""
    body = {
        "choices": [{"index": 0, "text": "ok"}],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    return answer(200, json.dumps(body).encode())


async def _cached_answer(w: asyncio.StreamWriter) -> None:
    w.write(_usage_answer(0))


@dataclass
class Fleet:
    gw: Gateway
    http: httpx.AsyncClient
    registry: MemoryRegistry
    keep: FakeReplica  # "keep": a replica that stays
    churn: FakeReplica  # every churned replica's engine
    now: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def block_size(self) -> int:
        return self.gw.policy.models.pool(MODEL).block_size

    async def join(self, rid: str, url: str, ttl_ms: int = 1_000) -> None:
        reg = Registration(
            replica_id=rid, url=url, model=MODEL, block_size=self.block_size,
            capacity_blocks=100, agent_id=f"agent-{rid}", registered_ms=self.now,
        )  # fmt: skip
        await self.registry.register(reg, ttl_ms, now_ms=self.now)
        self.now += 1
        assert self.gw.discovery is not None and self.gw.pool is not None
        await self.gw.discovery.refresh_once(now_ms=self.now)
        assert self.gw.pool.get(rid) is not None

    async def leave(self, rid: str) -> None:
        """``rid``'s registration lapses; a refresh past the grace removes it."""
        assert self.gw.discovery is not None and self.gw.pool is not None
        self.now += GRACE_MS + 1_001
        await self.gw.discovery.refresh_once(now_ms=self.now)
        assert self.gw.pool.get(rid) is None

    @contextlib.contextmanager
    def keep_cordoned(self) -> Iterator[None]:
        """Requests sent meanwhile go to the churned replica, the only routable one."""
        assert self.gw.pool is not None
        self.gw.pool.cordon("keep")
        try:
            yield
        finally:
            self.gw.pool.cordon("keep", False)

    async def route_to_churn(self, tag: str) -> None:
        """One request, answered 200 by the churned engine."""
        before = self.churn.posts
        with self.keep_cordoned():
            r = await self.http.post("/v1/completions", json=completion(f"{tag} some words"))
        assert r.status_code == 200, r.text
        assert self.churn.posts == before + 1

    async def metrics_text(self) -> str:
        r = await self.http.get("/metrics")
        assert r.status_code == 200
        return r.text


@contextlib.asynccontextmanager
async def fleet(policy: str = "", *more_urls: str) -> AsyncIterator[Fleet]:
    keep, churn = FakeReplica(), FakeReplica(_cached_answer)
    await keep.start()
    await churn.start()
    registry = MemoryRegistry()
    gs = GatewaySettings(
        port=free_port(),
        open_access=True,
        salt_secrets=[SecretStr("s" * 32)],
        seed=7,
        replica_allowlist=[keep.url, churn.url, *more_urls],
    )
    gw = Gateway(gs, parse_policy_text(policy), load_store=MemoryLoadStore(), registry=registry)
    try:
        async with serve_in_loop(gw) as url, httpx.AsyncClient(base_url=url, timeout=10) as h:
            assert gw.discovery is not None
            await gw.discovery.stop()  # refreshed by hand, at the test's times
            f = Fleet(gw, h, registry, keep, churn)
            await f.join("keep", keep.url, ttl_ms=3_600_000)
            yield f
    finally:
        await keep.stop()
        await churn.stop()


def _series_of(text: str, rid: str) -> list[str]:
    return [ln for ln in text.splitlines() if f'replica="{rid}"' in ln]


def _give_every_series(gw: Gateway, rid: str) -> None:
    """The per-replica series no fake engine makes here, made as their code paths make
    them (proxy.py's upstream errors, the Redis index's unreadable keys, a starved probe,
    a claim check that quarantines: Gateway._recheck), and the quarantine it leaves."""
    m = gw.metrics
    m.upstream_errors.labels(rid, "connect").inc()
    m.upstream_errors.labels(rid, "http_500").inc()
    m.index_unreadable.labels(rid).inc()
    m.health_inconclusive.labels(rid).inc()
    for _ in range(gw.policy.quarantine.k):
        m.claim_checks.labels(rid, "false").inc()
        changed = gw.quarantine.observe(ClaimCheck(rid, 10, 0, 10))
    assert changed is True and gw.quarantine.is_quarantined(rid)
    m.quarantined.labels(rid).set(1)
    m.quarantine_changes.labels(rid, "in").inc()
    gw._quarantine_watchers[rid] = gw.spawn(gw._watch_quarantine(rid))


async def test_fifty_churned_replicas_leave_nothing_behind() -> None:
    """50 replicas, each discovered, routed to (both strategies with per-replica state),
    given every per-replica series and quarantined, then removed: /metrics has no series
    of theirs, and every per-replica structure holds the live replica only (before: 50
    of each, 50 healthy series at 0 or 1, 50 finished watchers)."""
    async with fleet() as f:
        gw = f.gw
        for i in range(CHURN):
            rid = f"gpu-{i}"
            await f.join(rid, f.churn.url)
            # prefix_affinity keeps its tree per replica, expected_latency per scope
            gw.strategy_override = Strategy.PREFIX_AFFINITY if i % 2 else None
            await f.route_to_churn(rid)
            if i % 2:
                assert rid in gw.router._tree_tokens
            else:
                assert any(rid in t for t in gw.router._scope_trees.values())
            assert rid in gw.inflight._own
            _give_every_series(gw, rid)
            text = await f.metrics_text()
            got = _series_of(text, rid)
            assert f'kvgate_replica_healthy{{replica="{rid}"}} 1.0' in got
            assert any(ln.startswith("kvgate_e2e_seconds_bucket") for ln in got)
            assert any(ln.startswith("kvgate_predicted_cached_tokens") for ln in got)
            await f.leave(rid)
        gw.strategy_override = None
        assert gw.refresher is not None
        await gw.refresher.refresh_once()  # the flush after the removals
        text = await f.metrics_text()
        left = [ln for ln in text.splitlines() if 'replica="gpu-' in ln]
        assert left == [], left[:5]
        assert _series_of(text, "keep")  # the live replica's stay
        live = {"keep"}
        assert set(gw.inflight._own) <= live
        assert set(gw.inflight.pending_deltas) <= live
        assert set(gw.refresher._pushed) <= live
        assert set(gw.router._tree_tokens) <= live and gw.router._round <= live
        for draws in gw.router._scope_draws.values():  # each scope's tie round (D26)
            assert draws.rounds <= live
        for tree in gw.router._scope_trees.values():
            assert set(tree) <= live
        assert gw.quarantine.quarantined() == [] and gw.quarantine._replicas == {}
        assert gw._quarantine_watchers == {}
        assert gw._verified <= live and set(gw._settling) <= live
        # the cancelled watchers are gone from the background set too
        for _ in range(10):
            if gw.background_settled():
                break
            await asyncio.sleep(0.05)
        assert gw.background_settled()


async def test_a_replica_back_under_its_id_is_a_new_one() -> None:
    """Removed while quarantined, then registered again under the same id (a restarted
    pod keeping its name): healthy 1 again, routed to, not quarantined, its series made
    anew (one request in its histogram, not the departed one's)."""
    async with fleet() as f:
        gw = f.gw
        await f.join("gpu-a", f.churn.url)
        await f.route_to_churn("first life")
        _give_every_series(gw, "gpu-a")
        await f.leave("gpu-a")
        assert _series_of(await f.metrics_text(), "gpu-a") == []
        await f.join("gpu-a", f.churn.url)
        assert not gw.quarantine.is_quarantined("gpu-a")
        text = await f.metrics_text()
        assert _series_of(text, "gpu-a") == ['kvgate_replica_healthy{replica="gpu-a"} 1.0']
        await f.route_to_churn("second life")
        got = _series_of(await f.metrics_text(), "gpu-a")
        assert 'kvgate_e2e_seconds_count{replica="gpu-a"} 1.0' in got
        assert 'kvgate_replica_healthy{replica="gpu-a"} 1.0' in got
        assert not any("quarantine" in ln or "upstream_errors" in ln for ln in got)
        assert gw.inflight.own("gpu-a") == (0.0, 0, 0)  # its one request is done


async def test_a_request_in_flight_when_its_replica_left_ends_cleanly() -> None:
    """A request sent before its replica was removed answers after: it completes (200)
    and its release touches nothing of the replica now (before: the in-flight entry
    stayed; a KeyError if forgotten without the ticket's entry). Its latency histograms
    are made again at its end: accepted, bounded by such requests."""
    go = asyncio.Event()
    sent = asyncio.Event()

    async def slow(w: asyncio.StreamWriter) -> None:
        sent.set()
        await asyncio.wait_for(go.wait(), 30)
        w.write(_usage_answer(0))

    async with fleet() as f:
        gw = f.gw
        f.churn.script = slow
        await f.join("gpu-b", f.churn.url)
        with f.keep_cordoned():
            req = asyncio.ensure_future(
                f.http.post("/v1/completions", json=completion("in flight words"))
            )
            await asyncio.wait_for(sent.wait(), 30)
        assert gw.inflight.own("gpu-b")[1] + gw.inflight.own("gpu-b")[2] == 1
        await f.leave("gpu-b")
        assert "gpu-b" not in gw.inflight._own
        go.set()
        r = await asyncio.wait_for(req, 30)
        assert r.status_code == 200
        assert "gpu-b" not in gw.inflight._own
        assert "gpu-b" not in gw.inflight.pending_deltas
        assert gw.refresher is not None
        await gw.refresher.refresh_once()
        assert "gpu-b" not in gw.refresher._pushed


_BOMB = gzip.compress(b" " * (9 << 20))
_MODELS_BOMB = (
    b"HTTP/1.1 200 X\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
    b"content-length: %d\r\n\r\n" % len(_BOMB)
) + _BOMB


async def test_a_claim_check_out_when_its_replica_left_leaves_nothing() -> None:
    """A claim check still settling when its replica was removed ends after: no verdict
    (before: a claim_checks series, a quarantine, its gauge and a watcher made again for a
    replica that is gone), and its settling count leaves no entry (before: one at 0 per
    replica ever checked)."""
    async with fleet("quarantine: {settle_s: 0.3, k: 1, m: 1}") as f:
        gw = f.gw
        assert gw.index is not None and isinstance(gw.index.primary, MemoryIndex)
        primary = gw.index.primary
        await f.join("gpu-q", f.churn.url)
        bs = f.block_size
        keys = BlockKeyer(bs).keys(list(range(bs * 4)), "kvg1:t", MODEL)
        # its agent's claim: 4 blocks stored (an agent-written replica: the index keeps it)
        epoch = await primary.clear_replica("gpu-q", ReplicaState.LIVE, f.now)
        await primary.apply("gpu-q", epoch, IndexWrite({k: 1 for k in keys}), f.now)
        d = Dispatch(
            request_id="r1", tenant="t", endpoint="completion", path="/v1/completions",
            body={}, stream=False, client_wants_usage=False, model=MODEL,
            prompt_tokens=bs * 4, block_size=bs, scope=Scope(ScopeKind.TENANT, "t"),
            salts=["s"], keys=[keys], matches=[{}], index_source="primary", candidates=[],
            decision=Decision("gpu-q", Strategy.EXPECTED_LATENCY, "test", ()),
            lookup_ms=int(time.time() * 1000),
        )  # fmt: skip
        check = gw.spawn(gw._recheck(d, 4, 0))  # the engine had none of the 4 claimed
        for _ in range(200):  # bounded: until the check waits for the agent's report
            if gw._settling["gpu-q"]:
                break
            await asyncio.sleep(0.005)
        assert gw._settling["gpu-q"] == 1
        await f.leave("gpu-q")
        await asyncio.wait_for(check, 30)
        assert "gpu-q" not in gw._settling
        assert _series_of(await f.metrics_text(), "gpu-q") == []
        assert gw.quarantine._replicas == {} and gw._quarantine_watchers == {}


class _ProbeEngine:
    """An engine whose ``held`` GET (``/health``) is held until released, then answers
    ``status``; its ``/v1/models`` is a gzip bomb (a few KB inflating past the pool's
    8 MiB cap)."""

    def __init__(self, held: bytes = b"GET /health") -> None:
        self.path = held
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.status = 503
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100):  # bounded
                req = await read_request(r)
                if req is None:
                    return
                line = req[0].split(b"\r\n", 1)[0]
                if line.startswith(self.path):
                    self.held.set()
                    await asyncio.wait_for(self.release.wait(), 30)
                    w.write(answer(self.status, b"{}"))
                elif line.startswith(b"GET /v1/models"):
                    w.write(_MODELS_BOMB)
                else:
                    w.write(answer(404, b"{}"))
                await w.drain()
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            w.close()


async def test_a_probe_out_when_its_replica_left_makes_no_series_again() -> None:
    """A health probe that was out when discovery removed its replica answers after:
    its verdict (unhealthy) reported then must not make the replica's healthy series
    again, nor a starved probe's count (before: kvgate_replica_healthy{gpu-c} 0 for ever)."""
    eng = _ProbeEngine()
    await eng.start()
    try:
        async with fleet("health: {interval_s: 60, timeout_s: 20}", eng.url) as f:
            gw = f.gw
            assert gw.pool is not None
            await f.join("gpu-c", eng.url)
            probe = asyncio.ensure_future(gw.pool.check_once())
            await asyncio.wait_for(eng.held.wait(), 30)
            await f.leave("gpu-c")
            assert _series_of(await f.metrics_text(), "gpu-c") == []
            eng.release.set()
            await asyncio.wait_for(probe, 30)
            gw._on_inconclusive("gpu-c")  # as a starved probe of it would report now
            assert _series_of(await f.metrics_text(), "gpu-c") == []
    finally:
        await eng.stop()


async def test_a_block_size_check_out_when_its_replica_left_verifies_nothing() -> None:
    """The gateway's block-size check of a replica (its engine's /metrics) answered after
    the replica was removed: the replica is not marked verified (before: a mark per
    replica id ever checked, and a re-added one taken as checked)."""
    eng = _ProbeEngine(held=b"GET /metrics")
    eng.status = 404  # no metrics: verified, nothing to compare
    await eng.start()
    try:
        async with fleet("health: {interval_s: 60}", eng.url) as f:
            gw = f.gw
            await f.join("gpu-v", eng.url)
            check = gw.spawn(gw._check_replica("gpu-v"))
            await asyncio.wait_for(eng.held.wait(), 30)
            await f.leave("gpu-v")
            eng.release.set()
            await asyncio.wait_for(check, 30)
            assert "gpu-v" not in gw._verified and "gpu-v" not in gw._verifying
            # the control: a check that answers while its replica is there verifies it
            await f.join("gpu-w", eng.url)
            await asyncio.wait_for(gw._check_replica("gpu-w"), 30)
            assert "gpu-w" in gw._verified
    finally:
        await eng.stop()


async def test_the_pool_forgets_its_once_per_replica_warning() -> None:
    """ReplicaPool warns once per replica of a /v1/models over its cap; a removed replica's
    mark goes with it (before: one per id ever seen), and one removed while its model read
    was out is not marked after."""
    eng = _ProbeEngine()
    eng.status = 200
    eng.release.set()
    await eng.start()
    try:
        async with httpx.AsyncClient() as client:
            pool = ReplicaPool(client, HealthPolicy(timeout_s=10))
            for i in range(5):
                pool.add(ReplicaSpec(f"big-{i}", eng.url))
            await pool.check_once(refresh_models=True)
            assert pool._models_too_large == {f"big-{i}" for i in range(5)}
            for i in range(5):
                pool.remove(f"big-{i}")
            assert pool._models_too_large == set()
            # removed while its model read is out: not marked when the read fails after
            rep = pool.add(ReplicaSpec("big-x", eng.url))
            models = asyncio.ensure_future(pool._models(rep))
            pool.remove("big-x")
            await asyncio.wait_for(models, 30)
            assert pool._models_too_large == set()
    finally:
        await eng.stop()


def test_inflight_forgets_a_replica_and_its_late_tickets() -> None:
    """InFlight.forget drops the entry and unflushed deltas; a ticket of the forgotten
    replica ends as a no-op (no KeyError, no entry, no delta), also once the id is back:
    the new replica's counts are not lowered by the old one's requests."""
    inf = InFlight()
    old = inf.dispatch("r", 100.0, expected=5.0)
    old2 = inf.dispatch("r", 50.0)
    inf.first_token(old2)
    inf.forget("r")
    assert inf._own == {} and inf.pending_deltas == {}
    inf.done(old)
    inf.progressed("r", 6.0)
    assert inf._own == {} and inf.pending_deltas == {}
    new = inf.dispatch("r", 10.0)
    inf.pending_deltas.clear()
    inf.done(old2)  # the departed replica's running request ends
    assert inf.own("r") == (10.0, 1, 0) and inf.pending_deltas == {}
    inf.done(new)
    assert inf.own("r") == (0.0, 0, 0) and inf.pending_deltas == {"r": [-1, -10]}


def test_the_router_forgets_a_replicas_trees_and_round() -> None:
    """Router.forget: prefix_affinity's tree size, the tie rounds and every scope tree
    lose the replica (an emptied scope tree goes); back, it starts with empty trees."""
    router = Router(RoutingParams(), random.Random(1))
    cands = [Candidate(f"r{i}", LoadView()) for i in range(3)]
    for i in range(30):
        req = RouteRequest(64, 16, scope_key=f"s{i % 4}")
        router.decide(req, cands, Coefficients())
        router.decide(req, cands, Coefficients(), strategy=Strategy.PREFIX_AFFINITY)
    assert "r1" in router._tree_tokens
    assert any("r1" in t for t in router._scope_trees.values())
    lone = RouteRequest(64, 16, scope_key="lone")
    d = router.decide(lone, [Candidate("r1", LoadView())], Coefficients())
    assert d.replica == "r1" and set(router._scope_trees["lone"]) == {"r1"}
    router._round.add("r1")
    router._draws("s0").rounds.add("r1")  # a scope's own round (D26)
    router.forget("r1")
    assert "r1" not in router._tree_tokens and "r1" not in router._round
    assert "r1" not in router.tie_round("s0")
    assert all("r1" not in t for t in router._scope_trees.values())
    assert "lone" not in router._scope_trees
    assert "r0" in router._tree_tokens  # the others' stay


async def test_the_memory_load_store_drops_replicas_past_their_key_ttl() -> None:
    """MemoryLoadStore kept a record per replica id ever written; one no one wrote for
    its Redis key TTL goes at the next heartbeat (its record read as empty already), and
    what the live replicas hold stays."""
    store = MemoryLoadStore()
    now = 1_000_000
    for i in range(CHURN):
        rid = f"gpu-{i}"
        await store.publish_engine(rid, EngineLoad(1, 0, 0.5, now), 2_000, now)
        await store.add_inflight("gw1", rid, 1, 10, now)
        await store.heartbeat("gw1", ["keep", rid], now)
        now += 1_000
    await store.add_inflight("gw1", "keep", 2, 20, now)
    await store.heartbeat("gw1", ["keep"], now + 60_000, {"keep": (2, 20)})
    assert len(store._replicas) == CHURN + 1  # within their key TTL: kept
    ids = [f"gpu-{i}" for i in range(CHURN)]
    later = now + store.gateway_ttl_ms + PRUNE_AFTER_MS + GARBAGE_GRACE_MS + 1
    before = await store.snapshot(ids, later)
    await store.heartbeat("gw1", ["keep"], later, {"keep": (2, 20)})
    assert set(store._replicas) == {"keep"}
    assert await store.snapshot(ids, later) == before  # nothing readable was dropped
    got = (await store.snapshot(["keep"], later))["keep"]
    assert (got.inflight_requests, got.inflight_prefill_tokens, got.gateways) == (2, 20, 1)
