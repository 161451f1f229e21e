"""Review R7: vLLM serves a completion request without ``model`` (its request models declare
``model: str | None = None``; ``OpenAIServing._is_model_supported`` is true for a missing
name and ``_get_model_name`` answers with ``base_model_paths[0]``, its first served model).
The gateway answered 400 "'model' is required", so a client written against one vLLM broke
behind it even when the whole fleet serves one model. Now a request whose model is absent,
null or "" is routed as the one base model the healthy fleet serves (adapters aside), that
model deciding the pool, the scope and the ``sensitive.models`` rules; a fleet of several
base models keeps a 400 that names them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import httpx
import orjson
import pytest

from cachecore.keys import ScopeKind
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import DEFAULT_MODEL, ReplicaSettings
from gateway.core import Dispatch, Gateway, Outcome
from gateway.errors import GatewayError
from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def _recording(gw: Gateway) -> list[tuple[Dispatch, Outcome]]:
    seen: list[tuple[Dispatch, Outcome]] = []
    finish = gw.finish

    def record(d: Dispatch, out: Outcome) -> None:
        seen.append((d, out))
        finish(d, out)

    gw.finish = record  # type: ignore[method-assign]
    return seen


async def test_without_model_a_one_model_fleet_serves_it_as_vllm_does() -> None:
    async with stack(count=2) as st, st.http() as h:
        seen = _recording(st.gw)
        engine = st.fleet.endpoints[0].url
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            for absent in ({}, {"model": None}, {"model": ""}):
                sent: dict[str, Any] = {**body, **absent}
                direct = await h.post(engine + path, json=sent)
                via = await h.post(path, json=sent)
                assert direct.status_code == 200, direct.text
                assert via.status_code == 200, (path, absent, via.text)
                assert via.json()["model"] == direct.json()["model"] == st.model
        assert len(seen) == 6 and all(d.model == st.model for d, _ in seen)
        # the engine is told the model, not left to pick its own (the client's bytes lack
        # it: a JSON answer's are not forwarded as they are)
        for d, _ in seen:
            assert d.raw_body is not None and not d.stream
            assert orjson.loads(st.gw.upstream_body(d))["model"] == st.model
        # streamed, and through the re-serialized body (stream) as the raw one (JSON)
        r = await h.post("/v1/completions", json={**COMPLETION, "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


async def test_without_model_the_request_is_keyed_as_that_model() -> None:
    # the same prompt with and without model is one prefix in the index: the second is
    # predicted (and served) from the cache the first left
    async with stack(count=1, expose_replica=True) as st, st.http() as h:
        prompt = words(200, 5)
        first = await h.post("/v1/completions", json={"model": st.model, "prompt": prompt,
                                                      "max_tokens": 2})  # fmt: skip
        assert first.status_code == 200
        again = await h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert again.status_code == 200, again.text
        assert int(again.headers["x-kvgate-predicted-cached-tokens"]) > 0
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_adapters_aside_the_base_model_serves_it() -> None:
    replica = ReplicaSettings(time_scale=0.05, lora=["ad-one", "ad-two"])
    async with stack(count=1, replica=replica) as st, st.http() as h:
        seen = _recording(st.gw)
        models = {m["id"] for m in (await h.get("/v1/models")).json()["data"]}
        assert models == {st.model, "ad-one", "ad-two"}
        r = await h.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert [d.model for d, _ in seen] == [st.model]


async def test_several_base_models_keep_a_400_that_names_them() -> None:
    other = ReplicaSettings(time_scale=0.05, model="other-model")
    async with (
        run_fleet(other) as fleet,
        stack(count=1, extra_replicas=[fleet.endpoints[0].url]) as st,
        st.http() as h,
    ):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            r = await h.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "model" and err["type"] == "invalid_request_error"
            assert st.model in err["message"] and "other-model" in err["message"]
        # naming one still routes to it
        r = await h.post("/v1/completions", json={**COMPLETION, "model": "other-model"})
        assert r.status_code == 200 and r.json()["model"] == "other-model"


async def test_a_model_that_is_not_a_string_is_still_a_400() -> None:
    async with stack(count=1) as st, st.http() as h:
        for bad in (123, ["m"], {"m": 1}, False):
            r = await h.post("/v1/completions", content=orjson.dumps({**COMPLETION, "model": bad}))
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "model"
        assert st.gw.in_flight == 0


async def test_the_filled_in_model_decides_the_sensitive_models_rule() -> None:
    # sensitive.models names the served model: a request without model is that model's,
    # so it is isolated as a request naming it is (a per-session scope by its user), not
    # run in the tenant's shared scope
    model = DEFAULT_MODEL
    policy = f"default_tenant: {{sensitive: {{default: none, models: [{model}]}}}}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        seen = _recording(st.gw)
        for body in ({**COMPLETION, "user": "u1"}, {**COMPLETION, "model": model, "user": "u1"}):
            r = await h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        kinds = [d.scope.kind for d, _ in seen]
        assert kinds == [ScopeKind.SESSION, ScopeKind.SESSION], kinds


# ---- review 4: V9 (served-name aliases; models not known) and V2 (cost per request)


def _engine(cards: list[dict[str, Any]] | dict[str, list[dict[str, Any]]]) -> httpx.MockTransport:
    """Replicas that answer /health 200 and /v1/models with ``cards`` in that order (per
    host when a dict)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            data = cards[request.url.host] if isinstance(cards, dict) else cards
            return httpx.Response(200, json={"object": "list", "data": data})
        return httpx.Response(200)

    return httpx.MockTransport(handler)


def _card(name: str, root: str, parent: str | None = None) -> dict[str, Any]:
    return {"id": name, "object": "model", "root": root, "parent": parent, "max_model_len": 8192}


async def _pool(per_replica: list[list[dict[str, Any]]]) -> ReplicaPool:
    """A pool of replicas whose /v1/models each list the cards given, read as the health
    loop reads them."""
    hosts = {f"r{i}": cards for i, cards in enumerate(per_replica)}
    pool = ReplicaPool(httpx.AsyncClient(transport=_engine(hosts)), HealthPolicy())
    for host in hosts:
        pool.add(ReplicaSpec(host, f"http://{host}:8000"))
    await pool.check_once(refresh_models=True)
    assert all(r.models is not None for r in pool.all())
    return pool


def _default(pool: ReplicaPool) -> str:
    return Gateway._default_model(cast(Gateway, SimpleNamespace(pool=pool)))


async def test_one_model_under_several_served_names_is_served_by_its_first_name() -> None:
    """vllm serve /models/llama --served-model-name llama meta-llama/Llama-3.1-8B: a card
    per name, one root, no parent; vLLM serves a request without model with the first.
    The gateway counted two base models: 400 "serves several models"."""
    aliases = [_card("llama", "/models/llama"), _card("meta-llama/Llama-3.1-8B", "/models/llama")]
    assert _default(await _pool([aliases, aliases])) == "llama"
    # the engine's order, not the alphabet's
    swapped = aliases[::-1]
    assert _default(await _pool([swapped, swapped])) == "meta-llama/Llama-3.1-8B"
    # replicas that disagree: the name most of them list first
    assert _default(await _pool([aliases, swapped, swapped])) == "meta-llama/Llama-3.1-8B"
    # an adapter beside them stays aside; a second engine model (another root) is a 400
    ad = _card("ad-one", "/loras/one", parent="llama")
    assert _default(await _pool([[*aliases, ad], aliases])) == "llama"
    other = [_card("qwen", "/models/qwen")]
    with pytest.raises(GatewayError) as err:
        _default(await _pool([aliases, other]))
    assert err.value.status == 400 and err.value.param == "model"
    assert "several models (llama, qwen)" in err.value.message
    # cards without a root: each name is its own model, as before
    bare = [{"id": "a"}, {"id": "b"}]
    with pytest.raises(GatewayError) as err:
        _default(await _pool([bare]))
    assert "several models (a, b)" in err.value.message


async def test_replicas_whose_models_are_unknown_ask_for_a_model() -> None:
    """Routable replicas whose /v1/models is not known (not read yet, mostly: just added,
    a failed read, a fleet registering again) take any model named: a request without
    one was told 503 "no healthy replica", which is untrue. It is a 503 still (a 400 was
    final to clients that retry only 5xx while the lists were being read: review 5, W4),
    saying that the lists are not known yet and that a named model is served now."""
    pool = ReplicaPool(httpx.AsyncClient(), HealthPolicy())
    for i in range(2):
        pool.add(ReplicaSpec(f"r{i}", f"http://r{i}:8000"))  # models None
    with pytest.raises(GatewayError) as err:
        _default(pool)
    assert err.value.status == 503 and err.value.param == "model"
    assert "not known yet" in err.value.message and "name the model" in err.value.message
    # none routable: the 503 is the truth
    for rep in pool.all():
        pool.cordon(rep.id)
    with pytest.raises(GatewayError) as err:
        _default(pool)
    assert err.value.status == 503 and err.value.code == "no_replica"
    # one known beside unknown ones: served by its model, as before
    known = await _pool([[_card("llama", "/models/llama")]])
    known.add(ReplicaSpec("new", "http://new:8000"))
    assert _default(known) == "llama"


async def test_the_default_model_is_not_rebuilt_per_request() -> None:
    """Each request without model rebuilt every replica's model cards (44-136 us at 256
    replicas): now it is kept until the pool changes (members, a models read, a
    routability reported)."""
    cards = [
        _card("llama", "/models/llama"),
        *[_card(f"ad{i}", f"/l/{i}", "llama") for i in range(8)],
    ]
    pool = await _pool([cards] * 256)
    built = {"model_cards": 0, "base_models": 0}
    model_cards, base_models = pool.model_cards, getattr(pool, "_base_models", None)

    def counting_cards() -> list[dict[str, object]]:
        built["model_cards"] += 1
        return model_cards()

    def counting_bases() -> Any:
        built["base_models"] += 1
        assert base_models is not None
        return base_models()

    pool.model_cards = counting_cards  # type: ignore[method-assign]
    pool._base_models = counting_bases  # type: ignore[method-assign]
    assert [_default(pool) for _ in range(1000)] == ["llama"] * 1000
    assert built == {"model_cards": 0, "base_models": 1}
    # a change of the pool is seen at once
    pool.cordon("r0")
    assert _default(pool) == "llama" and built["base_models"] == 2
    for rep in pool.all()[1:]:
        pool.cordon(rep.id)
    pool.cordon("r0", on=False)
    assert _default(pool) == "llama" and built["base_models"] == 3
    pool.remove("r0")
    with pytest.raises(GatewayError):  # nothing routable left
        _default(pool)
    added = pool.add(ReplicaSpec("r0", "http://r0:8000"))
    with pytest.raises(GatewayError) as err:  # routable, models unknown
        _default(pool)
    assert err.value.status == 503 and "not known yet" in err.value.message
    # its models read by the health loop: served again (r0's engine serves llama)
    await pool.check_once(refresh_models=True)
    assert added.models is not None and _default(pool) == "llama"
