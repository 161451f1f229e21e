"""``/admin/route/explain`` for every endpoint the gateway routes: the load-routed ones (D28,
D29: embeddings, /tokenize, /detokenize, the pooling endpoints), a Responses first turn (keyed
as its chat) and a Responses follow-up or retrieval (pinned by its sealed id, D30). Before,
explain took ``chat`` and ``completion`` only, a 400 for the rest. Explaining charges,
commits, makes pending, stores and sends nothing, and moves no router state: real simulated
replicas and a real gateway on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core import ENDPOINT_PATHS, Gateway
from tests.test_gateway_support import Stack, keys_file, stack, words

pytestmark = pytest.mark.timeout(120)

EXPLAIN = "/admin/route/explain"
_PROXIED = (*ENDPOINT_PATHS.values(), "/v1/chat/completions/render")


def _bodies(model: str) -> dict[str, dict[str, Any]]:
    """One body per load-routed endpoint name, each with an exact token count."""
    q, docs = words(20, 3), [words(24, 4), words(30, 5)]
    return {
        "embeddings": {"model": model, "input": words(40, 1)},
        "pooling": {"model": model, "input": [words(40, 7), words(36, 8)]},
        "classify": {"model": model, "input": words(40, 9)},
        "score": {"model": model, "text_1": q, "text_2": docs},
        "score_v1": {"model": model, "text_1": q, "text_2": docs},
        "rerank": {"model": model, "query": q, "documents": docs},
        "rerank_v1": {"model": model, "query": q, "documents": docs},
        "rerank_v2": {"model": model, "query": q, "documents": docs},
        "tokenize": {"model": model, "prompt": words(30, 2)},
        "detokenize": {"model": model, "tokens": [5, 6, 7]},
    }


def _turn(model: str, seed: int) -> dict[str, Any]:
    return {
        "model": model,
        "instructions": words(40, 90 + seed),
        "input": words(24, seed),
        "max_output_tokens": 2,
    }


class Watch:
    """Spies on everything a routed request does besides deciding: the budget charge, the
    router commit, pending entries, the dispatch, and every call to a replica's proxied
    paths (the gateway's upstream transport and its httpx clients, the tokenizer's)."""

    def __init__(self, st: Stack, mp: pytest.MonkeyPatch) -> None:
        gw = st.gw
        assert gw.index is not None and gw.upstream is not None
        self.st = st
        self.charges: list[float] = []
        self.commits: list[str] = []
        self.pending: list[Any] = []
        self.dispatched: list[str] = []
        self.sent: list[str] = []
        charge, commit = gw.limiter.charge_uncached, gw.router.commit
        add_pending, on_dispatch = gw.index.add_pending, gw.on_dispatch
        send, client_send = gw.upstream.send, httpx.AsyncClient.send

        def spy_charge(tenant: str, limits: Any, tokens: float, now: float) -> Any:
            self.charges.append(tokens)
            return charge(tenant, limits, tokens, now)

        def spy_commit(decision: Any) -> None:
            self.commits.append(decision.replica)
            commit(decision)

        def spy_pending(*args: Any, **kw: Any) -> Any:
            self.pending.append(args)
            return add_pending(*args, **kw)

        def spy_dispatch(d: Any) -> None:
            self.dispatched.append(d.replica)
            on_dispatch(d)

        def proxied(path: str) -> None:
            if path.startswith(_PROXIED):
                self.sent.append(path)

        async def spy_send(key: Any, data: bytes, *args: Any, **kw: Any) -> Any:
            proxied(data.split(b" ", 2)[1].decode())
            return await send(key, data, *args, **kw)

        replicas = tuple(st.fleet.urls)

        async def spy_client_send(
            client: httpx.AsyncClient, request: httpx.Request, **kw: Any
        ) -> httpx.Response:
            if str(request.url).startswith(replicas):  # not the test's own calls
                proxied(request.url.path)
            return await client_send(client, request, **kw)

        mp.setattr(gw.limiter, "charge_uncached", spy_charge)
        mp.setattr(gw.router, "commit", spy_commit)
        mp.setattr(gw.index, "add_pending", spy_pending)
        mp.setattr(gw, "on_dispatch", spy_dispatch)
        mp.setattr(gw.upstream, "send", spy_send)
        mp.setattr(httpx.AsyncClient, "send", spy_client_send)

    def state(self) -> tuple[Any, ...]:
        """What explains must leave as they found it: the above, each replica's stored
        responses, the router's RNG, cursor and commits, the decisions counted."""
        gw = self.st.gw
        r = gw.router
        stored = tuple(len(rep.responses) for rep in self.st.fleet.replicas)
        decided = [s for m in gw.metrics.decisions.collect() for s in m.samples]
        return (
            len(self.charges), len(self.commits), len(self.pending), len(self.dispatched),
            len(self.sent), stored, r.rng.getstate(), r._rr, r._commits, frozenset(r._round),
            dict(r._tree_tokens), {k: dict(v) for k, v in r._scope_trees.items()}, decided,
        )  # fmt: skip


@contextmanager
def watching(st: Stack) -> Iterator[Watch]:
    with pytest.MonkeyPatch.context() as mp:
        yield Watch(st, mp)


async def _explain(
    h: httpx.AsyncClient,
    st: Stack,
    endpoint: str,
    body: dict[str, Any],
    tenant: str | None = None,
    session: str | None = None,
) -> httpx.Response:
    params = {"endpoint": endpoint} | ({"tenant": tenant} if tenant else {})
    headers = st.admin_headers() | ({"x-kvgate-session": session} if session else {})
    return await h.post(EXPLAIN, params=params, json=body, headers=headers)


async def test_every_routed_endpoint_is_explained_and_an_unknown_one_names_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with stack(count=2) as st, st.http() as h:
        w = Watch(st, monkeypatch)
        for endpoint, body in _bodies(st.model).items():
            r = await _explain(h, st, endpoint, body)
            assert r.status_code == 200, (endpoint, r.text)
            got = r.json()
            assert got["endpoint"] == endpoint and got["pinned"] is None
            assert got["load_only"]["why"] == "endpoint", got
            assert got["decision"]["reason"] == "unkeyed_load" and got["index_source"] == "none"
            assert all(s["matched_blocks"] == 0 for s in got["decision"]["scores"])
            # each pooling request charged whole; /tokenize and /detokenize compute nothing
            tokens = 0 if endpoint in ("tokenize", "detokenize") else got["prompt_tokens"]
            assert got["charge_uncached_tokens"] == got["prompt_tokens"] == tokens, got
            # the real request is charged what explain said
            before = len(w.charges)
            r = await h.post(ENDPOINT_PATHS[endpoint], json=body)
            assert r.status_code == 200, (endpoint, r.text)
            assert w.charges[before:] == [tokens], endpoint
        assert _bodies(st.model)["embeddings"]["input"] and w.charges[0] == 40
        # chat and completion as before: defaults by body shape, keyed
        chat = {"model": st.model, "messages": [{"role": "user", "content": words(40, 5)}]}
        for body, endpoint in ((chat, "chat"), ({"model": st.model, "prompt": "hi"}, "completion")):
            r = await h.post(EXPLAIN, json=body, headers=st.admin_headers())
            got = r.json()
            assert r.status_code == 200 and got["endpoint"] == endpoint, r.text
            assert got["load_only"] is None and got["pinned"] is None
            assert got["charge_uncached_tokens"] == got["prompt_tokens"]
        r = await _explain(h, st, "chat_completions", chat)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_endpoint", r.text
        assert err["param"] == "endpoint"
        assert all(name in err["message"] for name in (*ENDPOINT_PATHS, "response_get"))


async def test_a_first_turn_is_explained_as_its_chat() -> None:
    async with stack(count=2) as st, st.http() as h:
        turn = _turn(st.model, 1)
        chat = {
            "model": st.model,
            "messages": [
                {"role": "system", "content": turn["instructions"]},
                {"role": "user", "content": turn["input"]},
            ],
        }
        r = await h.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
        assert r.status_code == 200, r.text
        stored_on = r.headers["x-kvgate-replica"]
        r = await _explain(h, st, "responses", turn)
        assert r.status_code == 200, r.text
        got = r.json()
        want = (await _explain(h, st, "chat", chat)).json()
        assert got["load_only"] is None and got["pinned"] is None and got["endpoint"] == "responses"
        assert got["decision"]["replica"] == want["decision"]["replica"] == stored_on
        assert got["prompt_tokens"] == want["prompt_tokens"]
        chosen = next(s for s in got["decision"]["scores"] if s["replica"] == stored_on)
        assert chosen["predicted_cached_tokens"] > 0
        assert (
            got["charge_uncached_tokens"]
            == got["prompt_tokens"] - (chosen["predicted_cached_tokens"])
        )


async def test_a_follow_up_is_explained_as_pinned_and_an_id_that_does_not_open_is_the_404(
    tmp_path: Path,
) -> None:
    policy = "tenants:\n  s: {sensitive: {default: session}}\n"
    async with (
        stack(count=2, policy=policy, api_keys_file=keys_file(tmp_path, "abs")) as st,
        st.http() as h,
    ):
        a = {"authorization": "Bearer sk-a"}
        r = await h.post("/v1/responses", json=_turn(st.model, 1), headers=a)
        assert r.status_code == 200, r.text
        sealed, stored_on = r.json()["id"], r.headers["x-kvgate-replica"]
        follow = {"model": st.model, "input": words(12, 2), "previous_response_id": sealed}
        with watching(st) as w:
            before = w.state()
            for tenant in ("a", "a"):  # twice: the second sees what the first left
                r = await _explain(h, st, "responses", follow, tenant)
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["pinned"]["replica"] == stored_on
                assert got["pinned"]["engine_response_id"].startswith("resp_")
                assert got["load_only"]["why"] == "pinned"
                assert [s["replica"] for s in got["decision"]["scores"]] == [stored_on]
                assert got["charge_uncached_tokens"] == got["prompt_tokens"] > 0
            r = await _explain(h, st, "response_get", {"response_id": sealed}, "a")
            assert r.status_code == 200 and r.json()["pinned"]["replica"] == stored_on, r.text
            assert r.json()["charge_uncached_tokens"] == 0
            assert w.state() == before
            # another tenant's, a forged and an unknown id: the 404 the real request gets
            for tenant, rid in (("b", sealed), ("a", sealed[:-2] + "AA"), ("a", "resp_x")):
                body = {**follow, "previous_response_id": rid}
                auth = {"authorization": f"Bearer sk-{tenant}"}
                real = await h.post("/v1/responses", json=body, headers=auth)
                got = await _explain(h, st, "responses", body, tenant)
                assert real.status_code == got.status_code == 404, got.text
                assert got.json() == real.json()
                real = await h.get(f"/v1/responses/{rid}", headers=auth)
                got = await _explain(h, st, "response_get", {"response_id": rid}, tenant)
                assert real.status_code == got.status_code == 404, got.text
                assert got.json() == real.json()
            r = await _explain(h, st, "response_get", {}, "a")
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
            # explained under the tenant's session scope: another session's is the 404
            s = {"authorization": "Bearer sk-s", "x-kvgate-session": "one"}
            r = await h.post("/v1/responses", json=_turn(st.model, 3), headers=s)
            mine = {**follow, "previous_response_id": r.json()["id"]}
            r = await _explain(h, st, "responses", mine, "s")
            assert r.status_code == 400, r.text  # no session: a per-request scope cannot chain
            for session, status in (("one", 200), ("two", 404)):
                r = await _explain(h, st, "responses", mine, "s", session)
                assert r.status_code == status, r.text
            # the pinned replica out of service: the real request's 503
            adm = st.admin_headers()
            r = await h.post(f"/admin/replicas/{stored_on}/cordon", headers=adm)
            assert r.status_code == 200, r.text
            real = await h.post("/v1/responses", json=follow, headers=a)
            got = await _explain(h, st, "responses", follow, "a")
            assert real.status_code == got.status_code == 503, got.text
            assert got.json()["error"] == real.json()["error"]


@pytest.mark.parametrize("tokenizer", ["builtin", "engine_tokenize"])
@pytest.mark.parametrize("kind", ["load_routed", "first_turn", "follow_up"])
async def test_explain_charges_commits_pends_stores_and_sends_nothing(
    kind: str, tokenizer: str
) -> None:
    policy = f"models: {{default: {{tokenizer: {tokenizer}}}}}"
    engine = tokenizer != "builtin"
    async with stack(count=2, policy=policy) as st, st.http() as h:
        endpoint, path, body = "responses", "/v1/responses", _turn(st.model, 1)
        if kind == "load_routed":
            endpoint, path, body = "embeddings", "/v1/embeddings", _bodies(st.model)["embeddings"]
        elif kind == "follow_up":
            r = await h.post(path, json=body)
            assert r.status_code == 200, r.text
            body = {
                "model": st.model,
                "input": words(30, 4),
                "previous_response_id": r.json()["id"],
            }
        with watching(st) as w:
            before = w.state()
            for _ in range(3):
                r = await _explain(h, st, endpoint, body)
                assert r.status_code == 200, r.text
            tokenized = w.sent[:]
            if engine and kind == "first_turn":
                # a keyed chat on an engine-tokenized pool is tokenized by a replica's
                # /tokenize, as the real request is: that alone reaches a replica
                assert tokenized and set(tokenized) == {"/tokenize"}, tokenized
                w.sent.clear()
            assert w.state() == before
            explained = r.json()
            # the spies see a real request's charge, commit, dispatch and send
            r = await h.post(path, json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-replica"] == explained["decision"]["replica"]
            assert w.charges == [explained["charge_uncached_tokens"]]
            assert w.commits == w.dispatched == [explained["decision"]["replica"]]
            assert w.sent == (tokenized[:1] if tokenized else []) + [path]
            assert len(w.pending) == (kind == "first_turn")
            stored = sum(len(rep.responses) for rep in st.fleet.replicas)
            assert stored == {"load_routed": 0, "first_turn": 1, "follow_up": 2}[kind]


async def _picks(kind: str, explain_first: bool) -> list[tuple[int, str]]:
    """The replicas (by position: ids differ between stacks) and reasons of six routings
    (prepare: decided, charged and committed, not sent, so the fleet stays idle and its
    ties go by the router's rounds), each after two explains or none."""
    async with stack(count=3) as st, st.http() as h:
        gw: Gateway = st.gw
        order = [st.replica_id(i) for i in range(3)]
        sealed = ""
        if kind == "follow_up":
            r = await h.post("/v1/responses", json=_turn(st.model, 1))
            assert r.status_code == 200, r.text
            sealed = r.json()["id"]
        out = []
        for i in range(6):
            body: dict[str, Any]
            if kind == "load_routed":
                endpoint, body = "embeddings", {"model": st.model, "input": words(40, i)}
            elif kind == "first_turn":
                endpoint, body = "responses", _turn(st.model, 10 + i)
            else:
                endpoint = "responses"
                body = {"model": st.model, "input": words(9, i), "previous_response_id": sealed}
            if explain_first:
                for _ in range(2):
                    r = await _explain(h, st, endpoint, body)
                    assert r.status_code == 200, r.text
            d = await gw.prepare(endpoint, "anonymous", dict(body), {}, f"r{i}")
            out.append((order.index(d.replica), d.decision.reason))
        return out


@pytest.mark.parametrize("kind", ["load_routed", "first_turn", "follow_up"])
async def test_explaining_twice_then_routing_decides_as_routing_directly(kind: str) -> None:
    direct = await _picks(kind, False)
    assert await _picks(kind, True) == direct
    if kind != "follow_up":  # ties went by rounds: an explain that moved them would show
        assert len({p for p, _ in direct}) == 3, direct
