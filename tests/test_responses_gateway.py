"""The Responses API through the gateway (D30), end to end: real simulated replicas and a
real gateway on free loopback ports. A first turn is keyed and routed as its chat; a
follow-up (``previous_response_id``) and a retrieval go to the replica that stored the
response, named by a sealed id the gateway hands out in the engine's id's place (the
replica and the engine's id, encrypted and bound to the tenant under the salt secrets)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from pydantic import SecretStr

from cachecore.keys import Scope, ScopeKind
from cachecore.responses import chat_tools, input_messages
from cachecore.testing import free_port
from cachecore.tokenizer import ChatOptions, HFTokenizer
from gateway.app import create_app
from gateway.responses import SEALED_PREFIX, ResponseIds
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from tests.test_agent_helpers import counter_total as _count
from tests.test_gateway_support import (
    FAST,
    SECRET,
    keys_file,
    kill_replica,
    record_pending,
    stack,
    words,
)
from tests.test_responses_replica import template_model, tools_model

pytestmark = pytest.mark.timeout(90)


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        data = block.split("data: ", 1)[1]
        out.append(orjson.loads(data))
    return out


def _engine_ids(raw: bytes) -> set[str]:
    """Every engine response id (``resp_`` but not sealed) in an answer."""
    found = set()
    for part in raw.split(b'"resp_')[1:]:
        rid = "resp_" + part.split(b'"', 1)[0].decode()
        if not rid.startswith(SEALED_PREFIX):
            found.add(rid)
    return found


async def test_the_sdk_creates_streams_and_retrieves_through_the_gateway() -> None:
    async with stack(count=2) as st, st.http() as h:
        c = st.client()
        r = await c.responses.create(
            model=st.model, input=words(40, 1), instructions=words(8, 2), max_output_tokens=4
        )
        assert r.id.startswith(SEALED_PREFIX) and r.object == "response"
        assert r.output_text and r.usage is not None and r.usage.output_tokens == 4
        got = await c.responses.retrieve(r.id)
        assert (got.id, got.output_text) == (r.id, r.output_text)
        # streamed: every event that carries the response carries the sealed id
        stream = await c.responses.create(
            model=st.model, input=words(30, 3), max_output_tokens=3, stream=True
        )
        seen = [e async for e in stream]
        assert [e.type for e in seen][:2] == ["response.created", "response.in_progress"]
        assert seen[-1].type == "response.completed"
        ids = {e.response.id for e in seen if hasattr(e, "response")}
        assert len(ids) == 1 and next(iter(ids)).startswith(SEALED_PREFIX)
        done = seen[-1].response
        assert (await c.responses.retrieve(done.id)).output_text == done.output_text
        # raw: no engine id anywhere, in a JSON answer, a stream or a retrieval
        body = {"model": st.model, "input": words(20, 4), "max_output_tokens": 2}
        plain = await h.post("/v1/responses", json=body)
        assert plain.status_code == 200 and not _engine_ids(plain.content)
        async with h.stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
            raw = await resp.aread()
        events = _events(raw)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert not _engine_ids(raw) and raw.count(SEALED_PREFIX.encode()) == 3
        back = await h.get(f"/v1/responses/{plain.json()['id']}")
        assert back.status_code == 200 and not _engine_ids(back.content)
        assert back.headers["x-kvgate-replica"] == plain.headers["x-kvgate-replica"]
        assert _count(st.gw.metrics.requests, endpoint="responses", status="200") == 4
        assert _count(st.gw.metrics.requests, endpoint="response_get", status="200") == 3


async def test_a_chain_stays_on_its_replica_with_growing_cached_tokens() -> None:
    async with stack(count=2) as st, st.http() as h:
        for chain in range(3):  # bounded: three chains, three turns each
            prev = None
            used, cached = [], []
            for turn in range(3):
                # the instructions on every turn: vLLM does not carry a stored turn's over
                body: dict[str, Any] = {
                    "model": st.model,
                    "instructions": words(20, 99),
                    "input": words(60 if turn == 0 else 25, 10 * chain + turn),
                    "max_output_tokens": 6,
                }
                if turn > 0:
                    body["previous_response_id"] = prev
                r = await h.post("/v1/responses", json=body)
                assert r.status_code == 200, r.text
                got = r.json()
                assert got["previous_response_id"] == prev  # the client's sealed id back
                prev = got["id"]
                used.append(r.headers["x-kvgate-replica"])
                cached.append(got["usage"]["input_tokens_details"]["cached_tokens"])
            # only the replica that stored the previous response could answer (another's
            # store would not hold it): every turn on one replica, reading more cache
            assert len(set(used)) == 1, used
            assert cached[1] > 0 and cached[2] > cached[1], cached
        # a follow-up is routed by that replica alone: no prediction, no pending entries
        assert "x-kvgate-predicted-cached-tokens" not in r.headers
        assert _count(st.gw.metrics.decisions, reason="unkeyed_load") == 6


async def test_another_tenants_or_a_forged_id_is_a_404(tmp_path: Path) -> None:
    async with stack(count=2, api_keys_file=keys_file(tmp_path, "ab")) as st, st.http() as h:
        a, b = st.client(api_key="sk-a"), st.client(api_key="sk-b")
        mine = await a.responses.create(model=st.model, input=words(30, 1), max_output_tokens=2)
        text = mine.id[len(SEALED_PREFIX) :]
        flipped = text[:-3] + ("A" if text[-3] != "A" else "B") + text[-2:]
        forged = [mine.id, SEALED_PREFIX + flipped, "resp_nope", SEALED_PREFIX + "x" * 40]
        bodies = []
        for i, rid in enumerate(forged):
            who = "sk-b" if i == 0 else "sk-a"
            auth = {"authorization": f"Bearer {who}"}
            for method, url, body in (
                ("GET", f"/v1/responses/{rid}", None),
                ("POST", "/v1/responses",
                 {"model": st.model, "input": "x", "previous_response_id": rid}),
            ):  # fmt: skip
                r = await h.request(method, url, json=body, headers=auth)
                assert r.status_code == 404, (rid, r.text)
                err = r.json()["error"]
                bodies.append(orjson.dumps({**err, "message": err["message"].replace(rid, "ID")}))
        # one answer whatever the id was: nothing tells another tenant's id from none
        assert len(set(bodies)) == 1, bodies
        assert orjson.loads(bodies[0])["message"] == "Response with id 'ID' not found."
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(mine.id)
        # the owner goes on
        assert (await a.responses.retrieve(mine.id)).output_text == mine.output_text
        more = await a.responses.create(
            model=st.model, input="more", previous_response_id=mine.id, max_output_tokens=2
        )
        assert more.previous_response_id == mine.id
        # the engines never saw the refused ones
        assert _count(st.gw.metrics.requests, endpoint="responses", status="404") == 4


async def test_the_affinity_replica_out_of_service_or_gone(tmp_path: Path) -> None:
    async with stack(count=2) as st, st.http() as h:
        c = st.client()
        first = await c.responses.create(model=st.model, input=words(30, 5), max_output_tokens=2)
        home = await h.get(f"/v1/responses/{first.id}")
        rid = home.headers["x-kvgate-replica"]
        idx = [st.replica_id(0), st.replica_id(1)].index(rid)
        follow = {"model": st.model, "input": "next", "previous_response_id": first.id}
        # cordoned: 503 no_replica with Retry-After, never served elsewhere
        r = await h.post(f"/admin/replicas/{rid}/cordon", headers=st.admin_headers())
        assert r.status_code == 200
        for method, url, body in (
            ("POST", "/v1/responses", follow),
            ("GET", f"/v1/responses/{first.id}", None),
        ):
            r = await h.request(method, url, json=body)
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert r.json()["error"]["code"] == "no_replica"
        # a first turn still goes to the other replica
        r = await h.post("/v1/responses", json={"model": st.model, "input": "fresh"})
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] != rid
        await h.post(f"/admin/replicas/{rid}/uncordon", headers=st.admin_headers())
        r = await h.post("/v1/responses", json={**follow, "max_output_tokens": 2})
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == rid, r.text
        # killed: the connection fails and the request is not retried elsewhere (502)
        await kill_replica(st.fleet, idx)
        r = await h.post("/v1/responses", json=follow)
        assert r.status_code in (502, 503), r.text
        assert r.json()["error"]["code"] in ("upstream_unreachable", "no_replica")
        assert "x-kvgate-replica" not in r.headers or r.headers["x-kvgate-replica"] == rid
        # removed from the pool: its store is gone with it, the engine's 404
        assert st.gw.pool is not None
        st.gw.pool.remove(rid)
        r = await h.post("/v1/responses", json=follow)
        assert r.status_code == 404 and r.json()["error"]["param"] == "response_id", r.text


async def test_a_first_turn_is_keyed_as_its_chat_with_pending_entries() -> None:
    async with stack(count=2) as st, st.http() as h:
        pending = record_pending(st.gw)
        system, question = words(64, 7), words(40, 8)
        body = {"model": st.model, "instructions": system, "input": question}
        r = await h.post("/v1/responses", json={**body, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        assert len(pending) == 1  # the prompt's blocks, pending on the chosen replica
        first = r.headers["x-kvgate-replica"]
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == 0
        # the same prompt as a chat: the same keys, so the prediction is the cached prefix
        chat = {
            "model": st.model, "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
        }  # fmt: skip
        r = await h.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        assert predicted > 0
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= predicted
        # and a Responses turn after it reads the engine's cached_tokens (input_tokens_details)
        before = _count(st.gw.metrics.actual_cached)
        r = await h.post("/v1/responses", json={**body, "max_output_tokens": 2})
        assert r.headers["x-kvgate-replica"] == first
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == predicted
        cached = r.json()["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= predicted
        assert _count(st.gw.metrics.actual_cached) - before == cached
        assert _count(st.gw.metrics.decisions, reason="unkeyed_load") == 0
        # a malformed input is the gateway's 400 naming it, before routing
        for bad in ({"input": 3}, {"input": [{"type": "function_call_output"}]}, {}):
            r = await h.post("/v1/responses", json={"model": st.model, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


async def test_each_tenant_salted_and_a_request_scope_cannot_chain(tmp_path: Path) -> None:
    policy = "tenants:\n  s: {sensitive: {default: request}}\n"
    keys = keys_file(tmp_path, "abs")
    async with stack(count=1, policy=policy, api_keys_file=keys) as st, st.http() as h:
        prompt = words(48, 11)
        for t in ("a", "b"):
            r = await h.post(
                "/v1/responses",
                json={"model": st.model, "input": prompt, "cache_salt": "mine",
                      "max_output_tokens": 2},
                headers={"authorization": f"Bearer sk-{t}"},
            )  # fmt: skip
            assert r.status_code == 200, r.text
        async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url) as direct:
            blocks = (await direct.get("/debug/blocks")).json()["blocks"]
        roots = {k for b in blocks if b["parent_block_hash"] is None for k in b["extra_keys"] or []}
        want = {st.gw.minter.salt(Scope(ScopeKind.TENANT, t)) for t in "ab"}
        assert want <= roots and "mine" not in roots
        # the per-request scope: answered, not stored, and no chain from it
        s = {"authorization": "Bearer sk-s"}
        r = await h.post("/v1/responses", json={"model": st.model, "input": prompt}, headers=s)
        assert r.status_code == 200 and r.json()["store"] is False, r.text
        rid = r.json()["id"]
        assert rid.startswith(SEALED_PREFIX)
        assert (await h.get(f"/v1/responses/{rid}", headers=s)).status_code == 404
        a = {"authorization": "Bearer sk-a"}
        theirs = await h.post("/v1/responses", json={"model": st.model, "input": "q"}, headers=a)
        for prev in (rid, theirs.json()["id"], "resp_nope"):
            r = await h.post(
                "/v1/responses",
                json={"model": st.model, "input": "x", "previous_response_id": prev},
                headers=s,
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "previous_response_id"


_ACME = Scope(ScopeKind.TENANT, "acme")  # a shared scope: the id binds the tenant alone
_OTHER = Scope(ScopeKind.TENANT, "other")


def test_sealed_ids_bind_the_tenant_hide_the_replica_and_survive_a_rotation() -> None:
    old, new = b"o" * 32, b"n" * 32
    sealed = ResponseIds([old]).seal("acme", _ACME, "http://10.0.0.7:8000", "resp_abc")
    assert ResponseIds([old]).open("acme", _ACME, sealed) == ("http://10.0.0.7:8000", "resp_abc")
    assert ResponseIds([old]).open("other", _OTHER, sealed) is None  # another tenant's
    # rotated: the old secret still listed second opens it; once dropped, it does not
    assert ResponseIds([new, old]).open("acme", _ACME, sealed) == (
        "http://10.0.0.7:8000",
        "resp_abc",
    )
    assert ResponseIds([new]).open("acme", _ACME, sealed) is None
    fresh = ResponseIds([new, old]).seal("acme", _ACME, "r1", "resp_x")
    assert ResponseIds([new]).open("acme", _ACME, fresh) == ("r1", "resp_x")  # the primary
    # the replica's id and the engine's do not show in the id
    raw = base64.urlsafe_b64decode(sealed[len(SEALED_PREFIX) :] + "==")
    assert b"10.0.0.7" not in raw and b"abc" not in raw and "10.0.0.7" not in sealed
    # every bit is authenticated: any one flipped is refused
    body = bytearray(raw)
    for i in range(len(body)):
        body[i] ^= 1
        bad = SEALED_PREFIX + base64.urlsafe_b64encode(bytes(body)).rstrip(b"=").decode()
        assert ResponseIds([old]).open("acme", _ACME, bad) is None
        body[i] ^= 1
    for junk in (None, 5, "", "resp_", SEALED_PREFIX, SEALED_PREFIX + "!!", "x" * 5000):
        assert ResponseIds([old]).open("acme", _ACME, junk) is None


async def test_the_asgi_routes_serve_responses_as_the_hot_path() -> None:
    async with stack(count=1) as st:
        transport = httpx.ASGITransport(app=create_app(st.gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as asgi:
            body = {"model": st.model, "input": words(20, 1), "max_output_tokens": 2}
            r = await asgi.post("/v1/responses", json=body)
            assert r.status_code == 200 and r.json()["id"].startswith(SEALED_PREFIX), r.text
            rid = r.json()["id"]
            r = await asgi.get(f"/v1/responses/{rid}")
            assert r.status_code == 200 and r.json()["id"] == rid
            r = await asgi.post("/v1/responses", json={**body, "previous_response_id": rid})
            assert r.status_code == 200 and r.json()["previous_response_id"] == rid, r.text
            r = await asgi.post("/v1/responses", json={**body, "stream": True})
            assert r.status_code == 200 and not _engine_ids(r.content)
            assert _events(r.content)[-1]["type"] == "response.completed"
            assert (await asgi.get("/v1/responses/resp_nope")).status_code == 404


async def test_a_rotation_keeps_ids_valid_across_gateways(tmp_path: Path) -> None:
    """A second gateway sharing the secrets (the old one listed second) opens the first's
    ids: the affinity lives in the id, not in a gateway's memory."""
    async with stack(count=2) as st, st.http() as h:
        r = await h.post("/v1/responses", json={"model": st.model, "input": words(30, 2)})
        rid = r.json()["id"]
        specs = [e.url for e in st.fleet.endpoints]
        for secrets, status in ((["z" * 32, SECRET], 200), (["z" * 32], 404)):
            gs = GatewaySettings(
                replicas=specs, port=free_port(), open_access=True, seed=7,
                salt_secrets=[SecretStr(s) for s in secrets],
            )  # fmt: skip
            async with (
                serve_in_loop(build_gateway(gs)) as url,
                httpx.AsyncClient(base_url=url) as h2,
            ):
                got = await h2.get(f"/v1/responses/{rid}")
                assert got.status_code == status, got.text


def test_a_sealed_id_opens_under_its_one_encoding_only() -> None:
    # review of D30: base64's lenient decoder dropped characters outside its alphabet,
    # took the standard alphabet's + and / and ignored a last character's spare bits, so
    # one sealed id had many spellings, each opening to the same response
    ids = ResponseIds([b"k" * 32])
    for n in range(40, 46):  # each length mod 3: a last character with spare bits or none
        sealed = ids.seal("acme", _ACME, "r1", "resp_" + "a" * n)
        assert ids.open("acme", _ACME, sealed) == ("r1", "resp_" + "a" * n)
        text = sealed[len(SEALED_PREFIX) :]
        variants = [SEALED_PREFIX + text[:10] + c + text[10:] for c in ('"', "\\", ".", " ", "\n")]
        variants.append(sealed + "==")
        variants.append(SEALED_PREFIX + text.replace("-", "+").replace("_", "/"))
        alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
        variants += [sealed[:-1] + c for c in alphabet if c != sealed[-1]]
        for other in variants:
            if other != sealed:
                assert ids.open("acme", _ACME, other) is None, (other, sealed)


async def test_a_respelled_sealed_id_is_a_404_and_never_reaches_the_answer() -> None:
    # the client's id is copied into the engine's answer as bytes: a spelling carrying a
    # quote (which the lenient decoder dropped) opened, and broke the JSON answer
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "input": words(20, 1), "max_output_tokens": 2}
        r = await h.post("/v1/responses", json=body)
        rid = r.json()["id"]
        bad = rid[:12] + '",{' + rid[12:]
        r = await h.post("/v1/responses", json={**body, "previous_response_id": bad})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "response_not_found"
        r = await h.get("/v1/responses/" + rid[:12] + "%22" + rid[12:])
        assert r.status_code == 404, r.text


async def test_a_follow_up_is_charged_the_prefill_its_engine_reports() -> None:
    # review of D30: a follow-up is charged, before it runs, its own instructions and input
    # (the history is the engine's, unseen here); new instructions go first in vLLM's
    # prompt, so each follow-up with other instructions made the engine prefill the whole
    # stored conversation again, charged a few tokens: a 1,000-token budget bought ~3,000
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 1000}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        body = {"model": st.model, "input": words(300, 1), "max_output_tokens": 2}
        r = await h.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        prev = r.json()["id"]
        computed, statuses = 0, []
        for i in range(8):  # bounded: eight follow-ups, each other instructions
            r = await h.post(
                "/v1/responses",
                json={
                    "model": st.model,
                    "input": "x",
                    "instructions": words(3, 50 + i),
                    "previous_response_id": prev,
                    "max_output_tokens": 2,
                },
            )
            statuses.append(r.status_code)
            if r.status_code != 200:
                break
            u = r.json()["usage"]
            computed += u["input_tokens"] - u["input_tokens_details"]["cached_tokens"]
        # the engine's prefill past the first turn is charged: the budget runs out
        assert statuses[-1] == 429, (statuses, computed)
        assert r.json()["error"]["limit"] == "uncached_tokens"
        assert computed < 1000 + 400, computed


async def test_a_retrieved_follow_up_names_its_previous_response_by_the_sealed_id() -> None:
    # review of D30: a retrieval rewrote the retrieved id alone, so a follow-up's stored
    # previous_response_id came back as the engine's own id
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "input": words(20, 1), "max_output_tokens": 2}
        first = (await h.post("/v1/responses", json=body)).json()["id"]
        r = await h.post("/v1/responses", json={**body, "previous_response_id": first})
        second = r.json()["id"]
        r = await h.get(f"/v1/responses/{second}")
        assert r.status_code == 200, r.text
        assert not _engine_ids(r.content), r.text
        assert r.json()["previous_response_id"] == first


_TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}  # fmt: skip


async def test_a_first_turn_with_function_tools_is_keyed_as_its_chat_with_those_tools(
    tmp_path: Path,
) -> None:
    # vLLM renders a Responses request's function tools into the prompt, converted to the
    # chat-completions shape: the gateway keys and sizes them so, and the engine agrees
    # (both on a tokenizer whose chat template renders tools)
    model = tools_model(tmp_path)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        system, question = words(64, 11), words(40, 12)
        body = {
            "model": st.model, "instructions": system, "input": question, "tools": [_TOOL],
            "max_output_tokens": 2,
        }  # fmt: skip
        r = await h.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        first = r.headers["x-kvgate-replica"]
        # the second turn: predicted from the first's keys, and the engine has them
        r = await h.post("/v1/responses", json=body)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        assert predicted > 0
        usage = r.json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= predicted
        # the equivalent chat completion, its tools converted as vLLM does: the same
        # keys (the same prediction) and the same prompt tokens on the engine
        fn = {k: v for k, v in _TOOL.items() if k != "type"}
        chat = {
            "model": st.model, "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
            "tools": [{"type": "function", "function": fn}],
        }  # fmt: skip
        r = await h.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == predicted
        assert r.json()["usage"]["prompt_tokens"] == usage["input_tokens"]
        # no claim failed against the honest replica; every request keyed
        _every_request_keyed_no_claim_failed(st)


async def test_built_in_tools_route_unkeyed_and_malformed_tools_are_a_400() -> None:
    async with stack(count=2) as st, st.http() as h:
        pending = record_pending(st.gw)
        base = {"model": st.model, "input": words(60, 13), "max_output_tokens": 2}
        # a built-in tool (whose prompt the gateway cannot reproduce): by load, no keys
        # (tool_choice "none" is keyed: the pool says whether its engines render the
        # tools, models.<pool>.exclude_tools_when_tool_choice_none, H210)
        for extra in (
            {"tools": [_TOOL, {"type": "web_search"}]},
            {"tools": [{"type": "mcp", "server_label": "x"}]},
        ):
            before = _count(st.gw.metrics.decisions, reason="unkeyed_load")
            r = await h.post("/v1/responses", json={**base, **extra})
            assert r.status_code == 200, r.text
            assert int(r.headers.get("x-kvgate-predicted-cached-tokens", "0")) == 0
            assert _count(st.gw.metrics.decisions, reason="unkeyed_load") == before + 1
        assert pending == []
        for bad in (
            {"tools": {"type": "function"}},
            {"tools": ["get_weather"]},
            {"tools": [{"name": "f"}]},
            {"tools": [{"type": "function"}]},
            {"tools": [{"type": "function", "name": "f", "parameters": "x"}]},
            {"tools": [{"type": "function", "name": "f", "description": 3}]},
        ):
            r = await h.post("/v1/responses", json={**base, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


async def test_a_tool_choice_naming_no_tool_is_a_400_and_lax_tool_flags_are_served() -> None:
    # vLLM 0.33's check_tool_usage refuses a named tool_choice naming no tool (or a local
    # name ambiguous across namespaces), and "required" without tools: the gateway's 400
    # naming tool_choice, before any engine request. Its models take "yes" / 1 for a
    # tool's strict and an empty tool name: served and keyed, as vLLM serves them.
    async with stack(count=1) as st, st.http() as h:
        base = {"model": st.model, "input": words(20, 15), "max_output_tokens": 2}
        ns = {"type": "namespace", "name": "a", "description": "",
              "tools": [{"type": "function", "name": "f"}]}  # fmt: skip
        ran = await _engine_requests(st)
        extra: dict[str, Any]
        for extra in (
            {"tools": [_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            {"tool_choice": {"type": "custom", "name": "get_weather"}},
            {"tool_choice": "required"},
            {"tools": [ns, {**ns, "name": "b"}], "tool_choice": {"type": "function", "name": "f"}},
        ):
            r = await h.post("/v1/responses", json={**base, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "tool_choice" and "Tool choice" in err["message"], err
        assert await _engine_requests(st) == ran
        lax = {"type": "function", "name": "", "parameters": {"type": "object"}, "strict": "yes"}
        for extra in (
            {"tools": [lax, _TOOL], "tool_choice": {"type": "function", "name": "get_weather"}},
            {"tools": [ns, {**ns, "name": "b"}], "tool_choice": {"type": "function",
                                                                  "name": "b__f"}},
        ):  # fmt: skip
            before = _count(st.gw.metrics.decisions, reason="unkeyed_load")
            r = await h.post("/v1/responses", json={**base, **extra})
            assert r.status_code == 200, r.text
            assert _count(st.gw.metrics.decisions, reason="unkeyed_load") == before


async def test_a_malformed_background_is_a_400_naming_it() -> None:
    # D33 serves background: true (tests/test_responses_background.py); the gateway holds
    # its ticket until the response ends, so it reads the field as the engine does
    async with stack(count=1) as st, st.http() as h:
        base = {"model": st.model, "input": words(10, 14), "max_output_tokens": 2}
        for extra in ({"background": "yes"}, {"background": 1}):
            r = await h.post("/v1/responses", json={**base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "background", r.text
        for flag in (False, None):
            r = await h.post("/v1/responses", json={**base, "background": flag})
            assert r.status_code == 200 and r.json()["status"] != "queued", r.text


async def _repeated_on_one_replica(h: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    """``body`` sent twice: the repeat is served by the same replica, predicted (above 0)
    exactly as the engine has it cached. The repeat's response."""
    seen = []
    for _ in range(2):
        r = await h.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == predicted
        seen.append((r.headers["x-kvgate-replica"], predicted))
    assert seen[1][0] == seen[0][0] and seen[1][1] > 0, seen
    return r


def _every_request_keyed_no_claim_failed(st: Any) -> None:
    m = st.gw.metrics
    assert _count(m.decisions, reason="unkeyed_load") == 0
    for bad in ("false", "tampered"):
        assert _count(m.claim_checks, outcome=bad) == 0


async def _engine_requests(st: Any) -> float:
    """Requests the replicas' engines have finished, from their /metrics."""
    total = 0.0
    async with httpx.AsyncClient(timeout=10) as c:
        for e in st.fleet.endpoints:
            text = (await c.get(e.url + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("vllm:request_success_total"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_client_tool_loop_is_keyed_as_the_engine_renders_it(tmp_path: Path) -> None:
    # D31: function_call / function_call_output items, stateless (store false, the whole
    # history in input) or after a stored turn (previous_response_id), on a model whose
    # template renders tool calls and tool messages: the gateway keys the loop as the engine
    # renders it (its prediction is the engine's cached_tokens), a follow-up carrying a
    # call's output reaches the storing replica, and a malformed item is its 400
    model = tools_model(tmp_path, tool_loop=True)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        call = {
            "type": "function_call", "id": "fc_1", "call_id": "call_1",
            "name": "get_weather", "arguments": '{"city": "Oslo"}', "status": "completed",
        }  # fmt: skip
        out = {"type": "function_call_output", "call_id": "call_1", "output": words(40, 23)}
        said = {
            "type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": words(6, 24), "annotations": []}],
        }  # fmt: skip
        history: list[Any] = [{"role": "user", "content": words(40, 22)}, said, call, out]
        base = {
            "model": st.model, "instructions": words(64, 21), "tools": [_TOOL],
            "max_output_tokens": 2, "store": False,
        }  # fmt: skip
        r = await h.post("/v1/responses", json={**base, "input": history})
        assert r.status_code == 200, r.text
        first = r.headers["x-kvgate-replica"]
        # the loop's next turn (the answer, a second call and its output after the same
        # history) and a repeat of it: predicted exactly as the engine has it cached
        text = r.json()["output"][0]["content"][0]["text"]
        answer = {**said, "content": [{"type": "output_text", "text": text}]}
        call2 = {**call, "id": "fc_2", "call_id": "call_2", "arguments": '{"city": "Bergen"}'}
        out2 = {**out, "call_id": "call_2", "output": words(40, 25)}
        history += [answer, call2, out2]
        for _ in range(2):
            r = await h.post("/v1/responses", json={**base, "input": history})
            assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first, r.text
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            assert predicted > 0
            assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == predicted
        _every_request_keyed_no_claim_failed(st)
        # a stored turn, then the follow-up carrying its call's output: on that replica,
        # reading the stored conversation from its cache
        stored = await h.post("/v1/responses", json={**base, "store": True, "input": words(50, 26)})
        assert stored.status_code == 200, stored.text
        follow = await h.post(
            "/v1/responses",
            json={"model": st.model, "tools": [_TOOL], "max_output_tokens": 2,
                  "previous_response_id": stored.json()["id"], "input": [call, out]},
        )  # fmt: skip
        assert follow.status_code == 200, follow.text
        assert follow.headers["x-kvgate-replica"] == stored.headers["x-kvgate-replica"]
        assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        # malformed items: the gateway's 400 naming input, no routing, no engine request
        decided, ran = _count(st.gw.metrics.decisions), await _engine_requests(st)
        for item in (
            {**call, "call_id": None},
            {**call, "arguments": {"city": "Oslo"}},
            {**out, "output": 7},
            {"type": "function_call_output", "output": "x"},
            # what vLLM's request model refuses (review of D31)
            {"role": "user", "content": [{"type": "output_text", "text": "x"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
        ):
            for extra in ({}, {"previous_response_id": follow.json()["id"]}):
                body = {**base, **extra, "input": [*history[:1], item]}
                r = await h.post("/v1/responses", json=body)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "input", r.text
        assert _count(st.gw.metrics.decisions) == decided
        assert await _engine_requests(st) == ran


async def test_a_custom_tool_loop_is_keyed_as_the_engine_renders_it(tmp_path: Path) -> None:
    # review H162 of D31: vLLM 0.33 renders custom_tool_call items as function calls
    # ({"input": ...} arguments), their outputs as tool messages and custom tools as a
    # one-string function; kvgate refused the items (400 naming input) and routed custom
    # tools unkeyed. Served, keyed as the replica renders them: a repeat's prediction is
    # the engine's cached_tokens. A follow-up renders a custom output's parts empty, as
    # vLLM's stored conversation holds them (a spent iterator).
    model = tools_model(tmp_path, tool_loop=True)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    tool = {"type": "custom", "name": "shell", "description": "Runs a command."}
    call = {"type": "custom_tool_call", "call_id": "call_1", "name": "shell",
            "input": words(12, 31)}  # fmt: skip
    out = {"type": "custom_tool_call_output", "call_id": "call_1", "output": words(40, 32)}
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        items: list[Any] = [{"role": "user", "content": words(40, 34)}, call, out]
        base = {
            "model": st.model, "instructions": words(64, 33), "tools": [tool, _TOOL],
            "max_output_tokens": 2, "store": False, "input": items,
        }  # fmt: skip
        r = await _repeated_on_one_replica(h, base)
        _every_request_keyed_no_claim_failed(st)
        # a stored turn whose custom output came as parts, then a follow-up: its prompt
        # has that tool message empty (the usage is the one of that rendering)
        parts = [{"type": "input_text", "text": words(40, 35)}]
        first = {**base, "store": True, "input": [*items[:2], {**out, "output": parts}]}
        r = await h.post("/v1/responses", json=first)
        assert r.status_code == 200, r.text
        follow = {"model": st.model, "max_output_tokens": 2, "tools": [tool, _TOOL],
                  "previous_response_id": r.json()["id"], "input": words(8, 36)}  # fmt: skip
        f = await h.post("/v1/responses", json=follow)
        assert f.status_code == 200, f.text
        tok = HFTokenizer.from_dir(model)
        tools, _ = chat_tools([tool, _TOOL])
        spent = [*input_messages(first["input"])[:-1], {**input_messages([out])[0], "content": ""}]
        said = [{"role": "assistant", "content": p["text"]}
                for item in r.json()["output"] for p in item["content"]]  # fmt: skip
        msgs = [*spent, *said, {"role": "user", "content": follow["input"]}]
        rendered = tok.encode_chat(msgs, True, ChatOptions(tools=tools))
        assert f.json()["usage"]["input_tokens"] == len(rendered)


async def test_a_namespace_tool_loop_is_keyed_as_the_engine_renders_it(tmp_path: Path) -> None:
    # vLLM 0.33 renders a namespace tool's function tools in its place, named
    # <namespace>__<name> (get_function_tools; its custom tools not rendered); kvgate
    # routed such a request unkeyed. Keyed as the replica renders it: a repeat's
    # prediction is the engine's cached_tokens, and the prompt has the flattened tools.
    model = tools_model(tmp_path, tool_loop=True)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    params = {"type": "object", "properties": {"q": {"type": "string"}}}
    crm = {"type": "namespace", "name": "crm", "description": "The CRM.", "tools": [
        {"type": "function", "name": "lookup", "description": words(12, 51),
         "parameters": params, "strict": True},
        {"type": "custom", "name": "note"},
    ]}  # fmt: skip
    call = {"type": "function_call", "call_id": "call_1", "namespace": "crm",
            "name": "lookup", "arguments": '{"q": "acme"}'}  # fmt: skip
    out = {"type": "function_call_output", "call_id": "call_1", "output": words(40, 52)}
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        body = {
            "model": st.model, "instructions": words(64, 53), "tools": [crm, _TOOL],
            "max_output_tokens": 2, "store": False,
            "input": [{"role": "user", "content": words(40, 54)}, call, out],
        }  # fmt: skip
        r = await _repeated_on_one_replica(h, body)
        _every_request_keyed_no_claim_failed(st)
        # the engine's prompt: the flattened function before the top-level one
        flat = {"name": "crm__lookup", "description": words(12, 51), "parameters": params,
                "strict": True}  # fmt: skip
        shown = [{"type": "function", "function": flat}, *(chat_tools([_TOOL])[0] or [])]
        msgs = [{"role": "system", "content": body["instructions"]}, *input_messages(body["input"])]
        tok = HFTokenizer.from_dir(model)
        rendered = tok.encode_chat(msgs, True, ChatOptions(tools=shown))
        assert r.json()["usage"]["input_tokens"] == len(rendered)
        # what vLLM's request model refuses: a 400 naming tools, before routing
        undescribed = {k: v for k, v in crm.items() if k != "description"}
        r = await h.post("/v1/responses", json={**body, "tools": [undescribed]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


async def test_tool_call_arguments_no_json_object_are_served_as_the_engine_renders_them(
    tmp_path: Path,
) -> None:
    # vLLM 0.33 renders a tool call's arguments that are no JSON object as {} (chat
    # completions and function_call items alike), where kvgate answered 400: served, keyed
    # as the replica renders them (a repeat's prediction is the engine's cached_tokens,
    # and "{}" renders the same prompt); arguments not a string vLLM refuses: a 400
    model = tools_model(tmp_path, tool_loop=True)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:

        def chat(arguments: Any) -> dict[str, Any]:
            fn = {"name": "get_weather", "arguments": arguments}
            return {
                "model": st.model, "max_tokens": 2,
                "messages": [
                    {"role": "system", "content": words(64, 41)},
                    {"role": "user", "content": words(40, 42)},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"id": "call_1", "type": "function", "function": fn}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": words(40, 43)},
                ],
            }  # fmt: skip

        seen = []
        for arguments in ("{city", "{city", "{}", "[1]"):
            r = await h.post("/v1/chat/completions", json=chat(arguments))
            assert r.status_code == 200, r.text
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
            seen.append((r.headers["x-kvgate-replica"], predicted))
        assert seen[0][1] == 0 and seen[1][1] > 0 and seen[1:] == [seen[1]] * 3, seen
        # the Responses path: the same rule, the same prompt (a function_call item)
        call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
        out = {"type": "function_call_output", "call_id": "call_1", "output": words(40, 45)}
        body = {"model": st.model, "max_output_tokens": 2, "store": False,
                "instructions": words(64, 44)}  # fmt: skip
        for arguments in ("not json", "not json", "7"):
            items = [{"role": "user", "content": words(40, 46)}, {**call, "arguments": arguments}]
            r = await h.post("/v1/responses", json={**body, "input": [*items, out]})
            assert r.status_code == 200, r.text
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == predicted
        assert predicted > 0
        # not a string: vLLM's request model refuses it; the gateway's 400 naming messages
        ran = await _engine_requests(st)
        for bad in (None, {"city": "Oslo"}):
            r = await h.post("/v1/chat/completions", json=chat(bad))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "messages", r.text
        assert await _engine_requests(st) == ran


async def test_a_partial_final_message_is_continued_as_the_engine_continues_it() -> None:
    # review of D31: vLLM continues an input whose last message or reasoning item is
    # in_progress or incomplete (no generation prompt, the chat cut after its content):
    # the replica renders the chat completion that continues it, and the gateway keys
    # that prompt (its prediction is the engine's cached_tokens, and the chat's)
    async with stack(count=2) as st, st.http() as h:
        system, question, partial = words(64, 31), words(40, 32), words(30, 33)
        said = {
            "type": "message", "role": "assistant", "status": "incomplete",
            "content": [{"type": "output_text", "text": partial}],
        }  # fmt: skip
        body = {
            "model": st.model, "instructions": system, "max_output_tokens": 2,
            "store": False, "input": [{"role": "user", "content": question}, said],
        }  # fmt: skip
        r = await _repeated_on_one_replica(h, body)
        first, usage = r.headers["x-kvgate-replica"], r.json()["usage"]
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        chat = {
            "model": st.model, "max_tokens": 2, "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question},
                         {"role": "assistant", "content": partial}],
        }  # fmt: skip
        r = await h.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first, r.text
        assert r.json()["usage"]["prompt_tokens"] == usage["input_tokens"]
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == predicted
        assert _count(st.gw.metrics.decisions, reason="unkeyed_load") == 0
        # an item vLLM's request model refuses: the same 400 from the replica itself
        bad = {**body, "input": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
        async with httpx.AsyncClient(base_url=st.fleet.endpoints[0].url, timeout=10) as c:
            r = await c.post("/v1/responses", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


async def test_a_reasoning_effort_is_keyed_and_rendered_as_the_chat_completions(
    tmp_path: Path,
) -> None:
    # review of D31: vLLM passes reasoning.effort to the chat template as a chat
    # completion's reasoning_effort (with enable_thinking): on a template that renders
    # them first, the gateway keys what the engine renders, and another effort is
    # another prompt from its first token
    head = (
        "{% if reasoning_effort is defined %}<effort {{ reasoning_effort }}>{% endif %}"
        "{% if enable_thinking is defined %}<think {{ enable_thinking }}>{% endif %}\n"
    )
    model = template_model(tmp_path, head)
    policy = f"models: {{default: {{tokenizer: hf, tokenizer_dir: '{model}'}}}}\n"
    replica = FAST.model_copy(update={"tokenizer_dir": str(model)})
    async with stack(count=2, replica=replica, policy=policy) as st, st.http() as h:
        system, question = words(64, 34), words(40, 35)
        base: dict[str, Any] = {"model": st.model, "instructions": system, "input": question}
        base["max_output_tokens"] = 2
        high = {**base, "reasoning": {"effort": "high"}}
        r = await h.post("/v1/responses", json=base)
        assert r.status_code == 200, r.text
        plain = r.json()["usage"]["input_tokens"]
        r = await _repeated_on_one_replica(h, high)
        first, usage = r.headers["x-kvgate-replica"], r.json()["usage"]
        predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
        assert usage["input_tokens"] > plain  # the template rendered them
        chat = {
            "model": st.model, "max_tokens": 2, "reasoning_effort": "high",
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}],
        }  # fmt: skip
        r = await h.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-kvgate-replica"] == first, r.text
        assert r.json()["usage"]["prompt_tokens"] == usage["input_tokens"]
        assert int(r.headers["x-kvgate-predicted-cached-tokens"]) == predicted
        r = await h.post("/v1/responses", json={**base, "reasoning": {"effort": "none"}})
        assert r.status_code == 200, r.text
        assert int(r.headers.get("x-kvgate-predicted-cached-tokens", "0")) == 0
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
        # an effort vLLM refuses: the gateway's 400 naming it, before routing
        decided = _count(st.gw.metrics.decisions)
        r = await h.post("/v1/responses", json={**base, "reasoning": {"effort": "extreme"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"
        assert _count(st.gw.metrics.decisions) == decided


def test_a_sealed_id_binds_an_isolating_scope_and_shared_ids_open_as_before() -> None:
    # review of D30: an id bound to the tenant alone opened in every session of it
    ids = ResponseIds([b"o" * 32])
    one = Scope(ScopeKind.SESSION, "acme/one")
    sealed = ids.seal("acme", one, "r1", "resp_abc")
    assert ids.open("acme", one, sealed) == ("r1", "resp_abc")
    for elsewhere in (
        Scope(ScopeKind.SESSION, "acme/two"),  # another session of the tenant
        Scope(ScopeKind.REQUEST, "acme/one"),  # the same name, another kind
        _ACME,  # the tenant's shared scope
        Scope(ScopeKind.GROUP, "g"),
    ):
        assert ids.open("acme", elsewhere, sealed) is None, elsewhere
    assert ids.open("other", Scope(ScopeKind.SESSION, "acme/one"), sealed) is None
    # an id sealed before scopes were bound (this very string, from the code before the
    # change): a shared scope binds the same bytes, so it still opens, and is sealed alike
    before = "resp_kvg1rJFziJTbZ7oj54fX-LyOYgx6LD31isqk8XIqgA"
    assert ids.seal("acme", _ACME, "r1", "resp_abc") == before
    for shared in (_ACME, Scope(ScopeKind.GROUP, "g")):  # a trust group shares no content
        assert ids.open("acme", shared, before) == ("r1", "resp_abc")
    # ...but not in a session: one made there before the change is a 404 in it now
    assert ids.open("acme", one, before) is None
    # rotation as for any id: the old secret listed second still opens a session's
    rotated = ResponseIds([b"n" * 32, b"o" * 32])
    assert rotated.open("acme", one, sealed) == ("r1", "resp_abc")
    assert rotated.open("acme", Scope(ScopeKind.SESSION, "acme/two"), sealed) is None


def _upstream_calls(gw: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths the gateway sends upstream from now on (a spy on its upstream client)."""
    calls: list[str] = []
    post = gw.upstream.post

    async def spy(url: str, path: str, *args: Any, **kw: Any) -> Any:
        calls.append(path)
        return await post(url, path, *args, **kw)

    monkeypatch.setattr(gw.upstream, "post", spy)
    return calls


async def test_another_session_of_the_tenant_gets_the_404_and_shared_ids_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # s: every request in its session's scope; m: its requests to the model (all of them
    # here) in their session's; a: shared (the default)
    policy = (
        "tenants:\n"
        "  s: {sensitive: {default: session}}\n"
        f"  m: {{sensitive: {{models: [{FAST.model}]}}}}\n"
    )
    keys = keys_file(tmp_path, "asm")
    async with stack(count=2, policy=policy, api_keys_file=keys) as st, st.http() as h:

        def who(tenant: str, session: str | None = None) -> dict[str, str]:
            out = {"authorization": f"Bearer sk-{tenant}"}
            return out | ({"x-kvgate-session": session} if session else {})

        body = {"model": st.model, "input": words(30, 1), "max_output_tokens": 2}
        r = await h.post("/v1/responses", json=body, headers=who("s", "one"))
        assert r.status_code == 200, r.text
        mine = r.json()["id"]
        calls = _upstream_calls(st.gw, monkeypatch)

        def shown(resp: httpx.Response, rid: str) -> bytes:
            err = resp.json()["error"]
            return orjson.dumps({**err, "message": err["message"].replace(rid, "ID")})

        follow = {**body, "input": "more", "previous_response_id": mine}
        seen = set()
        for headers in (who("s", "two"), who("s", "ONE"), who("a", "one")):
            for r in (
                await h.post("/v1/responses", json=follow, headers=headers),
                await h.get(f"/v1/responses/{mine}", headers=headers),
            ):
                assert r.status_code == 404, r.text
                seen.add(shown(r, mine))
        forged = SEALED_PREFIX + "A" * 40
        r = await h.get(f"/v1/responses/{forged}", headers=who("s", "two"))
        seen.add(shown(r, forged))
        # one answer, the same as a forged id's, and the engines never asked
        assert len(seen) == 1, seen
        assert calls == []
        # no session at all: the tenant's scope is then per request, which cannot chain
        r = await h.post("/v1/responses", json=follow, headers=who("s"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        # the session that made it continues and retrieves it
        r = await h.post("/v1/responses", json=follow, headers=who("s", "one"))
        assert r.status_code == 200 and r.json()["previous_response_id"] == mine, r.text
        second = r.json()["id"]
        r = await h.get(f"/v1/responses/{second}", headers=who("s", "one"))
        assert r.status_code == 200 and r.json()["previous_response_id"] == mine, r.text
        assert len(calls) == 2
        # a tenant whose scope is shared: a session header only steers stickiness (its
        # sessions share the tenant's cache, so nothing isolates them), and its ids are bound
        # to the tenant alone, as every id was before scopes were bound: another session of
        # it, or none, continues the chain
        r = await h.post("/v1/responses", json=body, headers=who("a", "one"))
        shared = r.json()["id"]
        for headers in (who("a", "two"), who("a")):
            r = await h.post(
                "/v1/responses", json={**follow, "previous_response_id": shared}, headers=headers
            )
            assert r.status_code == 200, r.text
            assert (await h.get(f"/v1/responses/{shared}", headers=headers)).status_code == 200
        # a model's sensitivity: a retrieval names no model, so its session is tried too;
        # another session's, or none, is the 404
        r = await h.post("/v1/responses", json=body, headers=who("m", "one"))
        sens = r.json()["id"]
        r = await h.get(f"/v1/responses/{sens}", headers=who("m", "one"))
        assert r.status_code == 200 and r.json()["id"] == sens, r.text
        for headers in (who("m", "two"), who("m")):
            r = await h.get(f"/v1/responses/{sens}", headers=headers)
            assert r.status_code == 404 and shown(r, sens) in seen, r.text
        r = await h.post(
            "/v1/responses", json={**follow, "previous_response_id": sens}, headers=who("m", "one")
        )
        assert r.status_code == 200, r.text


async def test_a_replica_removed_after_routing_is_the_404_of_a_removed_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # review of D30: a replica removed between the routing and the send answered a pinned
    # request 503 no_replica, where a removed replica's chains are a 404. Removed here at
    # two points, deterministically: while a follow-up is tokenized (inside prepare), and
    # after prepare returned, before the exchange sends
    from gateway.tokenization import LocalPromptTokenizer

    async with stack(count=1) as st, st.http() as h:
        pool = st.gw.pool
        assert pool is not None
        body = {"model": st.model, "input": words(30, 1), "max_output_tokens": 2}
        r = await h.post("/v1/responses", json=body)
        rid = r.json()["id"]
        spec = pool.all()[0].spec
        follow = {**body, "input": "more", "previous_response_id": rid}
        r = await h.post("/v1/responses", json={**follow, "previous_response_id": "resp_no"})
        unknown = r.json()["error"]
        assert r.status_code == 404

        def same_404(resp: httpx.Response, sent: str) -> None:
            assert resp.status_code == 404, resp.text
            err = resp.json()["error"]
            assert {**err, "message": err["message"].replace(sent, "resp_no")} == unknown

        calls = _upstream_calls(st.gw, monkeypatch)
        chat = LocalPromptTokenizer.chat

        async def removed_while_tokenized(self: Any, *args: Any, **kw: Any) -> Any:
            pool.remove(spec.id)
            return await chat(self, *args, **kw)

        monkeypatch.setattr(LocalPromptTokenizer, "chat", removed_while_tokenized)
        same_404(await h.post("/v1/responses", json=follow), rid)
        monkeypatch.setattr(LocalPromptTokenizer, "chat", chat)
        pool.add(spec)

        prepare = st.gw.prepare

        async def removed_after_routing(*args: Any, **kw: Any) -> Any:
            d = await prepare(*args, **kw)
            pool.remove(d.replica)
            return d

        monkeypatch.setattr(st.gw, "prepare", removed_after_routing)
        same_404(await h.post("/v1/responses", json=follow), rid)
        pool.add(spec)
        same_404(await h.get(f"/v1/responses/{rid}"), rid)
        pool.add(spec)
        # a request not pinned has no store to lose: still the 503 no_replica
        r = await h.post("/v1/responses", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica", r.text
        pool.add(spec)
        assert calls == []  # none of them reached the engine
        monkeypatch.setattr(st.gw, "prepare", prepare)
        r = await h.post("/v1/responses", json=follow)
        assert r.status_code == 200, r.text  # back: the chain goes on
        assert _count(st.gw.metrics.requests, endpoint="responses", status="404") == 3
