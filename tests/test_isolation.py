"""Isolation boundaries of the gateway: the per-scope tokenization cache, the debug flag that
disables scoping (only for the attack suite's positive controls), sensitive scopes with real
agents (never indexed, routed by load, sticky per session among load-eligible replicas),
trust groups, and authenticated admin endpoints."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from cachecore.agent.embedded import EmbeddedAgents, build_embedded_agents
from cachecore.index.base import PrefixIndex
from cachecore.keys import ScopeKind
from cachecore.loadstate import LoadStore
from cachecore.tokenizer import SegmentCache, builtin_tokenizer
from gateway.app import ADMIN_DISABLED, METRICS_DISABLED, create_app
from gateway.auth import KeyStore, hash_key
from gateway.core import DEBUG_SHARED_SCOPE, Gateway
from gateway.replicas import ReplicaSpec
from gateway.settings import GatewaySettings
from gateway.tokenization import LocalPromptTokenizer
from policies.schema import parse_policy_text
from tests.test_gateway_support import ADMIN, FAST, SECRET, stack, words

pytestmark = pytest.mark.timeout(90)

KEYS = {"sk-a": "a", "sk-b": "b", "sk-a2": "a2"}


def key_store() -> KeyStore:
    return KeyStore({hash_key(k): t for k, t in KEYS.items()})


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def gateway_with(policy: str = "", **settings: Any) -> Gateway:
    s = GatewaySettings(salt_secrets=[SecretStr(SECRET)], open_access=True, **settings)
    return Gateway(s, parse_policy_text(policy))


def chat_body(model: str, system: str, user: str, max_tokens: int = 1) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def cached_tokens(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


# ---------------------------------------------------------------- tokenization cache


def test_segment_cache_entries_never_cross_scopes() -> None:
    tok = builtin_tokenizer()
    cache = SegmentCache(tok)
    assert cache.enabled
    system = "<|im_start|>system\n" + words(300, 1) + "<|im_end|>\n"
    want = tok.encode(system)
    for _ in range(2):  # admitted on second sight
        assert cache.encode(system, "tenant:a") == want
    hits = cache.hits
    assert cache.encode(system, "tenant:a") == want and cache.hits == hits + 1
    # another scope: a miss (same ids), then its own admission; a's entry is untouched
    assert cache.encode(system, "tenant:b") == want and cache.hits == hits + 1
    assert cache.encode(system, "tenant:b") == want and cache.hits == hits + 1
    assert cache.encode(system, "tenant:b") == want and cache.hits == hits + 2
    # a per-request scope (None) is never cached, however often it repeats
    fresh = "<|im_start|>system\n" + words(300, 2) + "<|im_end|>\n"
    for _ in range(4):
        assert cache.encode(fresh, None) == tok.encode(fresh)
    assert cache.hits == hits + 2
    assert all(scope != "" for scope, _ in cache._cache)


async def test_gateway_tokenizes_a_tenants_repeated_system_prompt_from_its_own_cache() -> None:
    """Tenant b sending a's system prompt (sent twice by a) must not hit a's cache entry:
    a hit is ~10x faster and would show in b's TTFT."""
    async with stack(count=1, policy="tenants: {a: {}, b: {}}") as st:
        gw = st.gw
        lt = gw.tokenizers.local(gw.policy.models.default) if gw.tokenizers else None
        assert isinstance(lt, LocalPromptTokenizer)
        system = words(400, 3)
        for i in range(2):
            body = chat_body(st.model, system, words(8, 10 + i))
            await gw.prepare("chat", "a", body, {}, "r", explain_only=True)
        hits = lt.segments.hits
        await gw.prepare("chat", "a", chat_body(st.model, system, "x y"), {}, "r", True)
        assert lt.segments.hits == hits + 1  # a's own entry
        await gw.prepare("chat", "b", chat_body(st.model, system, "x z"), {}, "r", True)
        assert lt.segments.hits == hits + 1  # b: a miss


@pytest.mark.parametrize("kind", ["engine_render", "engine_tokenize"])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_engine_side_tokenization_is_cached_per_tenant(kind: str, endpoint: str) -> None:
    """With the engine tokenizing, the replica's own tokenization cache is the one a tenant
    could time (routing waits for the call): the gateway sends each call under the scope's
    salt, so b's render of a's text misses a's entry."""
    policy = f"models: {{default: {{tokenizer: {kind}}}}}\ntenants: {{a: {{}}, b: {{}}}}"
    async with stack(count=1, policy=policy) as st:
        gw = st.gw
        app: Any = st.fleet.servers[0].config.app
        segments: SegmentCache = app.state.segments
        text = words(2000, 5)  # past the replica's threaded-encode bound: through its cache

        def body(user: str) -> dict[str, Any]:
            if endpoint == "chat":
                return chat_body(st.model, text, user)
            # the cache keeps the pieces between special tokens, and a text with none is
            # one piece, never repeated: a completion prompt with a chat-like head
            prompt = f"<|im_start|>system\n{text}<|im_end|>\n{user}"
            return {"model": st.model, "prompt": prompt, "max_tokens": 1}

        def prepare(tenant: str, user: str) -> Awaitable[Any]:
            return gw.prepare(endpoint, tenant, body(user), {}, "r", explain_only=True)

        for i in range(2):  # admitted on second sight
            await prepare("a", f" q{i}")
        hits = segments.hits
        await prepare("a", " q2")
        assert segments.hits > hits  # a's own entry
        hits = segments.hits
        await prepare("b", " q3")
        assert segments.hits == hits  # b: a miss


@pytest.mark.parametrize("where", ["header", "body"])
async def test_client_chosen_request_ids_do_not_collide_across_tenants(where: str) -> None:
    """Two tenants sending the same request id at once: the engine refused the second
    (400 duplicate request id), which told it the other tenant's request was running.
    The gateway makes the engine's id unique; each client still gets its own id back."""
    slow = FAST.model_copy(update={"time_scale": 1.0})  # a 1,600-token prefill: ~0.43 s
    build = {"key_store": key_store()}
    async with (
        stack(count=1, replica=slow, build=build, open_access=False) as st,
        st.http() as h,
    ):

        async def send(key: str, user: str) -> httpx.Response:
            body = chat_body(st.model, words(1600, 40), user)
            headers = auth(key)
            if where == "header":
                headers["x-request-id"] = "order-1"
            else:  # vLLM's and SGLang's body fields
                body.update(request_id="order-1", rid="order-1")
            return await h.post("/v1/chat/completions", json=body, headers=headers)

        first = asyncio.create_task(send("sk-a", "q1"))
        await asyncio.sleep(0.1)  # a's request is in its prefill
        second = await send("sk-b", "q2")
        r = await first
        assert r.status_code == second.status_code == 200, second.text
        assert r.json()["id"] != second.json()["id"]
        if where == "header":
            assert r.headers["x-request-id"] == second.headers["x-request-id"] == "order-1"


# ---------------------------------------------------------------- the debug flag


def test_debug_shared_scope_is_off_by_default_and_merges_tenant_scopes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert GatewaySettings().debug_unsafe_shared_scope is False
    policy = (
        "tenants: {a: {trust_group: g}, b: {}, s: {sensitive: {default: request}}}\n"
        "trust_groups: {g: [a]}"
    )
    gw = gateway_with(policy)
    sa, _ = gw.resolve_scope("a", gw.policy.tenant("a"), {}, {}, "m")
    sb, _ = gw.resolve_scope("b", gw.policy.tenant("b"), {}, {}, "m")
    assert gw.minter.salt(sa) != gw.minter.salt(sb)
    monkeypatch.setenv("KVGATE_DEBUG_UNSAFE_SHARED_SCOPE", "true")
    s = GatewaySettings(salt_secrets=[SecretStr(SECRET)], open_access=True)
    assert s.debug_unsafe_shared_scope is True
    dbg = Gateway(s, parse_policy_text(policy))
    scopes = [dbg.resolve_scope(t, dbg.policy.tenant(t), {}, {}, "m")[0] for t in ("a", "b", "c")]
    assert {sc.name for sc in scopes} == {DEBUG_SHARED_SCOPE}
    assert len({dbg.minter.salt(sc) for sc in scopes}) == 1
    # sensitive scopes stay ephemeral and per request even then
    ss, _ = dbg.resolve_scope("s", dbg.policy.tenant("s"), {}, {}, "m")
    assert ss.kind is ScopeKind.REQUEST and ss.ephemeral


@pytest.mark.parametrize("shared", [False, True])
async def test_cross_tenant_hit_only_with_the_debug_flag(shared: bool) -> None:
    build = {"key_store": key_store()}
    async with (
        stack(count=1, build=build, open_access=False, debug_unsafe_shared_scope=shared) as st,
        st.http() as h,
    ):
        body = chat_body(st.model, words(400, 20), "hello there")
        r = await h.post("/v1/chat/completions", json=body, headers=auth("sk-a"))
        assert cached_tokens(r) == 0
        body = chat_body(st.model, body["messages"][0]["content"], "hello again")
        r = await h.post("/v1/chat/completions", json=body, headers=auth("sk-b"))
        if shared:
            assert cached_tokens(r) >= 400  # the positive control: b hits a's prefix
        else:
            assert cached_tokens(r) == 0


# ---------------------------------------------------------------- trust groups


async def test_trust_group_members_share_and_outsiders_do_not() -> None:
    policy = (
        "tenants: {a: {trust_group: g}, a2: {trust_group: g}, b: {}}\ntrust_groups: {g: [a, a2]}"
    )
    build = {"key_store": key_store()}
    async with stack(count=1, policy=policy, build=build, open_access=False) as st, st.http() as h:
        system = words(320, 30)
        r = await h.post(
            "/v1/chat/completions", json=chat_body(st.model, system, "q1"), headers=auth("sk-a")
        )
        assert cached_tokens(r) == 0
        r = await h.post(
            "/v1/chat/completions", json=chat_body(st.model, system, "q2"), headers=auth("sk-a2")
        )
        assert cached_tokens(r) >= 320
        r = await h.post(
            "/v1/chat/completions", json=chat_body(st.model, system, "q3"), headers=auth("sk-b")
        )
        assert cached_tokens(r) == 0


# ---------------------------------------------------------------- sensitive scopes


async def test_sensitive_by_policy_rule_is_dropped_by_real_agents_and_never_indexed() -> None:
    """Real embedded agents see the engine store the sensitive blocks and drop them (the
    ephemeral salt marker); the gateway writes no pending entries; routing ignores matches."""
    policy = "tenants: {a: {sensitive: {models: [kvgate-sim-8b], models_kind: session}}, b: {}}"
    groups: list[EmbeddedAgents] = []

    async def hook(
        specs: Sequence[ReplicaSpec], index: PrefixIndex, load: LoadStore | None, _: object
    ) -> Callable[[], Awaitable[None]]:
        group = build_embedded_agents(specs, index, load)
        for agent in group.agents:
            await agent.start()
        groups.append(group)
        return group.stop

    build = {"key_store": key_store(), "agent_hook": hook}
    async with (
        stack(count=2, policy=policy, agents=True, build=build, open_access=False) as st,
        st.http() as h,
    ):
        gw = st.gw
        assert gw.index is not None
        system = words(500, 40)
        hdr = {**auth("sk-a"), "x-kvgate-session": "s-1"}
        hits, served = [], []
        for i in range(3):
            body = chat_body(st.model, system, words(6, 41 + i))
            r = await h.post("/v1/chat/completions", json=body, headers=hdr)
            hits.append(cached_tokens(r))
            served.append(r.headers["x-kvgate-replica"])
        assert hits[0] == 0 and min(hits[1:]) >= 496 and len(set(served)) == 1
        d = await gw.prepare("chat", "a", chat_body(st.model, system, "x"), hdr, "e", True)
        assert d.scope.kind is ScopeKind.SESSION and d.keys == [] and d.matches == []
        assert d.decision.reason == "sensitive_sticky"
        assert all(s.note == "load_only" and s.matched_blocks == 0 for s in d.decision.scores)
        # the engines hold the session's blocks; the agents indexed none of them
        blocks = (await h.get(gw.replica(served[0]).url + "/debug/blocks")).json()
        assert blocks["num_cached_blocks"] >= 31
        dropped = 0.0
        for _ in range(100):  # bounded: 5 s for the agents to see the events
            await gw.index.settle()
            stats = await gw.index.primary.stats()
            dropped = _dropped_ephemeral(groups[0])
            if dropped >= 31:
                break
            await asyncio.sleep(0.05)
        assert dropped >= 31
        assert stats.stored_entries == 0 and stats.pending_entries == 0
        # tenant b sending the same system prompt (non-sensitive) gets no hit
        r = await h.post(
            "/v1/chat/completions", json=chat_body(st.model, system, "q"), headers=auth("sk-b")
        )
        assert cached_tokens(r) == 0


def _dropped_ephemeral(group: EmbeddedAgents) -> float:
    """Blocks the embedded agents dropped as ephemeral, summed over agents."""
    total = 0.0
    for agent in group.agents:
        for metric in agent.metrics.blocks_dropped.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("reason") == "ephemeral":
                    total += sample.value
    return total


async def test_sensitive_sessions_stick_among_load_eligible_replicas_only() -> None:
    policy = (
        "default_tenant: {sensitive: {default: session}}\n"
        "routing: {sensitive_sticky: {slack: 0.1, slack_ms: 5}}"
    )
    async with stack(count=3, policy=policy) as st:
        gw = st.gw
        body = {"model": st.model, "prompt": words(200, 50), "max_tokens": 1}
        homes: dict[str, str] = {}
        for s in range(12):
            hdr = {"x-kvgate-session": f"sess-{s}"}
            picks = set()
            for _ in range(3):
                d = await gw.prepare("completion", "anonymous", dict(body), hdr, "e", True)
                picks.add(d.replica)
                assert d.decision.reason == "sensitive_sticky"
            assert len(picks) == 1  # sticky while loads are equal
            homes[f"sess-{s}"] = picks.pop()
        assert len(set(homes.values())) >= 2  # sessions spread over the replicas
        # load one replica far beyond the slack: its sessions move, the others stay
        busy = Counter(homes.values()).most_common(1)[0][0]
        ticket = gw.inflight.dispatch(busy, 50_000)
        try:
            for sess, home in homes.items():
                hdr = {"x-kvgate-session": sess}
                d = await gw.prepare("completion", "anonymous", dict(body), hdr, "e", True)
                assert d.replica != busy
                if home != busy:
                    assert d.replica == home
        finally:
            gw.inflight.done(ticket)


# ---------------------------------------------------------------- admin endpoints

ADMIN_ENDPOINTS = [
    ("GET", "/admin/replicas"),
    ("POST", "/admin/replicas/x/cordon"),
    ("GET", "/admin/quarantine"),
    ("GET", "/admin/policy"),
    ("POST", "/admin/policy"),
    ("POST", "/admin/route/explain"),
    ("GET", "/admin/stages"),
    ("POST", "/admin/stages"),
    ("GET", "/admin/fit"),
    ("GET", "/admin/index"),
    ("GET", "/admin/keys"),
    ("POST", "/admin/keys/reload"),
    ("GET", "/metrics"),  # other tenants' traffic, request by request
]


def test_the_admin_endpoint_list_covers_every_admin_route() -> None:
    """An admin route added to the app and not to ADMIN_ENDPOINTS would go untested."""
    from starlette.routing import Match, Route

    app = create_app(gateway_with())
    for route in app.routes:
        if not isinstance(route, Route) or not route.path.startswith("/admin"):
            continue
        for method in route.methods or ():
            if method == "HEAD":
                continue
            listed = [  # this method's own entry: a route may serve several
                (m, p)
                for m, p in ADMIN_ENDPOINTS
                if m == method
                and route.matches({"type": "http", "path": p, "method": m})[0] == Match.FULL
            ]
            assert listed, f"{method} {route.path} is missing from ADMIN_ENDPOINTS"


@pytest.mark.parametrize("admin_configured", [True, False])
async def test_every_admin_endpoint_needs_the_admin_key(admin_configured: bool) -> None:
    build = {"key_store": key_store()}
    async with stack(count=1, build=build, open_access=False) as st, st.http() as h:
        if not admin_configured:
            st.gw.settings.admin_key = None  # read per request: an unconfigured admin key
        for method, path in ADMIN_ENDPOINTS:
            for headers in (
                {},
                {"x-admin-key": "wrong"},
                auth("sk-a"),  # a tenant's API key is not an admin key
                {"x-admin-key": ""},
            ):
                r = await h.request(method, path, headers=headers, content=b"")
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.json()["error"]["code"] == "invalid_admin_key"
                # no key configured: no key opens it, and the answer says so
                message = r.json()["error"]["message"]
                if admin_configured:
                    assert message == "admin key required"
                elif path == "/metrics":
                    assert message == METRICS_DISABLED
                else:
                    assert message == ADMIN_DISABLED
                    assert "admin API is disabled" in message and "no admin key" in message
            r = await h.request(method, path, headers={"x-admin-key": ADMIN}, content=b"{}")
            if admin_configured:
                assert r.status_code != 401, (method, path)
            else:
                assert r.status_code == 401  # no admin key configured: admin is closed


async def test_metrics_are_open_only_when_asked_or_with_one_tenant() -> None:
    build = {"key_store": key_store()}
    async with stack(count=1, build=build, open_access=False) as st, st.http() as h:
        assert (await h.get("/metrics", headers=auth("sk-a"))).status_code == 401
        r = await h.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200 and "kvgate_requests_total" in r.text  # Prometheus' form
    async with (
        stack(count=1, build=build, open_access=False, metrics_public=True) as st,
        st.http() as h,
    ):
        assert (await h.get("/metrics")).status_code == 200
    async with stack(count=1) as st, st.http() as h:  # open access: one tenant
        assert (await h.get("/metrics")).status_code == 200
