"""``GET /v1/models`` lists the models of replicas out of service (an operator walkthrough).

With every replica serving a model cordoned (or draining), ``/v1/models`` was empty and
``/v1/models/{id}`` a 404 ``model_not_found``, while a request naming the model got the
503 ``no_replica`` "every replica serving this model is cordoned or draining": an OpenAI
client that lists the models before sending concluded the model did not exist, though it
comes back with the uncordon. The list now says what exists (every replica's models, as the
request path's 404 rule reads them); a request for such a model stays a retryable 503."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.replicas import ReplicaPool, ReplicaSpec
from policies.schema import HealthPolicy
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)


async def _listed(h: httpx.AsyncClient) -> list[str]:
    r = await h.get("/v1/models")
    assert r.status_code == 200, r.text
    return [c["id"] for c in r.json()["data"]]


@pytest.mark.parametrize("out_of_service", ["cordon", "drain"])
async def test_a_model_whose_replicas_are_all_out_of_service_is_listed_and_a_503(
    out_of_service: str,
) -> None:
    async with stack(count=2) as st, st.http() as h:
        adm = st.admin_headers()
        listed = await _listed(h)
        assert listed == [st.model]
        card = (await h.get(f"/v1/models/{st.model}")).json()
        for i in range(2):
            r = await h.post(f"/admin/replicas/{st.replica_id(i)}/{out_of_service}", headers=adm)
            assert r.status_code == 200 and r.json()["routable"] is False
        # still listed, with the same card; GET /v1/models/{id} finds it
        assert await _listed(h) == listed
        one = await h.get(f"/v1/models/{st.model}")
        assert one.status_code == 200 and one.json() == card
        # the OpenAI SDK sees the model, and a request for it is a retryable 503 in
        # OpenAI's error shape (InternalServerError: the SDK retries 5xx), not a 404
        c = st.client()
        assert st.model in [m.id async for m in c.models.list()]
        assert (await c.models.retrieve(st.model)).id == st.model
        with pytest.raises(openai.InternalServerError) as err:
            await c.completions.create(model=st.model, prompt=words(8, 1), max_tokens=1)
        assert err.value.status_code == 503
        body = {"model": st.model, "messages": [{"role": "user", "content": "hi"}]}
        r = await h.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert r.status_code == 503
        assert r.json()["error"] == {
            "message": "every replica serving this model is cordoned or draining",
            "type": "service_unavailable",
            "param": None,
            "code": "no_replica",
        }
        # one naming no model is told why too (it said "no healthy replica")
        r = await h.post("/v1/chat/completions", json={"messages": body["messages"]})
        assert r.status_code == 503
        assert r.json()["error"]["message"] == (
            "every replica is cordoned or draining: none can serve a request without 'model'"
        )
        # a model nobody serves is still a 404, listed or asked for
        missing = await h.get("/v1/models/no-such-model")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        r = await h.post("/v1/chat/completions", json={**body, "model": "no-such-model"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # back in service: served again
        for i in range(2):
            await h.post(f"/admin/replicas/{st.replica_id(i)}/uncordon", headers=adm)
        done = await c.completions.create(model=st.model, prompt=words(8, 2), max_tokens=1)
        assert done.choices


def _engine(models: dict[str, list[dict[str, object]]]) -> httpx.MockTransport:
    """Replicas by host: /health answers 200, /v1/models the host's cards."""

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": models[request.url.host]})
        return httpx.Response(200, json={})

    return httpx.MockTransport(answer)


async def test_the_list_holds_every_replicas_models_routable_cards_first() -> None:
    """Unhealthy, ejected, cordoned and draining replicas' models are listed (a request
    for them is a 503, not a 404); a removed replica's are not; where replicas in and out
    of service both list a model, the card is one read from a routable replica."""
    cards: dict[str, list[dict[str, object]]] = {
        "a": [{"id": "m", "max_model_len": 1000}, {"id": "only-a"}],
        "b": [{"id": "m", "max_model_len": 2000}, {"id": "only-b"}],
        "c": [{"id": "only-c"}],
        "d": [{"id": "only-d"}],
    }
    now = [100.0]
    async with httpx.AsyncClient(transport=_engine(cards)) as client:
        pool = ReplicaPool(client, HealthPolicy(eject_s=30), clock=lambda: now[0])
        for rid in cards:
            pool.add(ReplicaSpec(rid, f"http://{rid}:8000"))
        await pool.check_once()
        pool.record_failure("a", definitive=True)  # unhealthy and ejected
        pool.cordon("c")
        pool.drain("d")
        assert [r.id for r in pool.candidates("m")] == ["b"]
        listed = {c["id"]: c for c in pool.model_cards()}
        assert set(listed) == {"m", "only-a", "only-b", "only-c", "only-d"}
        assert listed["m"]["max_model_len"] == 2000  # b's: a is out of service
        pool.remove("c")
        assert "only-c" not in {c["id"] for c in pool.model_cards()}
