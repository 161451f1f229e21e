"""Review R7: vLLM serves a completion request without ``model`` (its request models declare
``model: str | None = None``; ``OpenAIServing._is_model_supported`` is true for a missing
name and ``_get_model_name`` answers with ``base_model_paths[0]``, its first served model).
The gateway answered 400 "'model' is required", so a client written against one vLLM broke
behind it even when the whole fleet serves one model. Now a request whose model is absent,
null or "" is routed as the one base model the healthy fleet serves (adapters aside), that
model deciding the pool, the scope and the ``sensitive.models`` rules; a fleet of several
base models keeps a 400 that names them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cachecore.keys import ScopeKind
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import DEFAULT_MODEL, ReplicaSettings
from gateway.core import Dispatch, Gateway, Outcome
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
