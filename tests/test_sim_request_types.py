"""Request fields of the wrong type: the simulated engine refuses them as vLLM does, and
the gateway answers the client a 400 in OpenAI's shape (an operator walkthrough).

vLLM declares its sampling fields with types (``temperature: float | None``, ``seed: int``,
``stop: str | list[str]``, ...) in pydantic models read in pydantic's lax mode: ``"0.5"``
is a float and ``"yes"`` a bool there, ``"hot"``, ``"many"`` and ``2.5`` (for an int) a
400. The simulated replica declared only the fields it acts on, so ``"temperature": "hot"``
(or ``"top_p": "x"``, ``"stop": 5``, ``"user": 5``, ...) got a 200 from it, and the
gateway's handling of the engine's refusal was never exercised. ``"max_tokens": "many"``,
``"n": 2.5`` and ``"stream": "maybe"`` were refused before, and ``"stream": "yes"`` is
accepted by vLLM (a lax bool), by the replica and by the gateway, which streams it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from cachecore.replica import ReplicaSettings, run_fleet
from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(90)

MODEL = "kvgate-sim-8b"

# (field, a value vLLM's request models refuse): 200s from the simulated replica before
REFUSED: list[tuple[str, Any]] = [
    ("temperature", "hot"),
    ("top_p", "x"),
    ("top_k", 2.5),
    ("min_p", []),
    ("presence_penalty", {}),
    ("frequency_penalty", "x"),
    ("repetition_penalty", "x"),
    ("length_penalty", None),
    ("seed", "s"),
    ("seed", 2**64),
    ("stop", 5),
    ("stop", [1]),
    ("stop_token_ids", ["a"]),
    ("bad_words", None),
    ("logit_bias", {"50256": "x"}),
    ("allowed_token_ids", "x"),
    ("ignore_eos", "maybe"),
    ("min_tokens", "x"),
    ("skip_special_tokens", None),
    ("include_stop_str_in_output", []),
    ("use_beam_search", 2),
    ("user", 5),
    ("priority", "x"),
    ("return_token_ids", "x"),
]
# refused before too: kept so
REFUSED_BEFORE: list[tuple[str, Any]] = [
    ("max_tokens", "many"),
    ("n", 2.5),
    ("stream", "maybe"),
    ("echo", "x"),
]
# what vLLM's lax pydantic models take, and so the replica
ACCEPTED: list[tuple[str, Any]] = [
    ("temperature", "0.5"),
    ("temperature", 0),
    ("max_tokens", "2"),
    ("n", 1.0),
    ("seed", "7"),
    ("stop", "x"),
    ("stop", ["x", "y"]),
    ("logit_bias", {"50256": -100}),
    ("ignore_eos", "true"),
    ("user", "someone"),
    ("priority", 0),
]


def _body(endpoint: str, field: str, value: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, field: value}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        return "/v1/chat/completions", body
    body["prompt"] = "hi"
    return "/v1/completions", body


@pytest.fixture
async def replica() -> AsyncIterator[httpx.AsyncClient]:
    async with (
        run_fleet(ReplicaSettings(time_scale=0.02), count=1) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=10) as h,
    ):
        yield h


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_the_replica_refuses_a_field_of_the_wrong_type(
    replica: httpx.AsyncClient, endpoint: str
) -> None:
    for field, value in REFUSED + REFUSED_BEFORE:
        path, body = _body(endpoint, field, value)
        r = await replica.post(path, json=body)
        assert r.status_code == 400, (field, value, r.text)
        err = r.json()["error"]
        # vLLM's error object: its type, the status as its code, the field as the param
        assert err["type"] == "BadRequestError" and err["code"] == 400, err
        assert err["param"].split(".")[0] == field and err["message"].startswith(field), err


@pytest.mark.parametrize("endpoint", ["chat", "completion"])
async def test_the_replica_takes_what_vllms_lax_models_take(
    replica: httpx.AsyncClient, endpoint: str
) -> None:
    for field, value in ACCEPTED:
        path, body = _body(endpoint, field, value)
        r = await replica.post(path, json=body)
        assert r.status_code == 200, (field, value, r.text)


async def test_per_endpoint_fields(replica: httpx.AsyncClient) -> None:
    """A chat's ``logprobs`` is a flag and a completion's a count (vLLM's); ``suffix`` is a
    completion's string; a field of the other endpoint is ignored, as vLLM ignores it."""
    for endpoint, field, value, status in (
        ("chat", "logprobs", "x", 400),
        ("chat", "logprobs", True, 200),
        ("chat", "parallel_tool_calls", "x", 400),
        ("completion", "logprobs", "x", 400),
        ("completion", "suffix", 5, 400),
        ("completion", "messages", "not a list", 200),
        ("chat", "suffix", 5, 200),
    ):
        path, body = _body(endpoint, field, value)
        r = await replica.post(path, json=body)
        assert r.status_code == status, (endpoint, field, value, r.text)


async def test_a_union_field_names_the_field_and_every_way_it_failed(
    replica: httpx.AsyncClient,
) -> None:
    path, body = _body("completion", "stop", [1])
    r = await replica.post(path, json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "stop"
    assert "stop.str: " in err["message"] and "stop.list[str].0: " in err["message"]


@pytest.mark.parametrize(
    "policy",
    [None, "models: {default: {tokenizer: engine_render, alignment_check: false}}"],
    ids=["local-tokenizer", "engine-render"],
)
async def test_through_the_gateway_the_client_gets_the_engines_400(policy: str | None) -> None:
    """The gateway does not read these fields: it routes the request and relays the
    engine's 400 as it came (OpenAI's error object, vLLM's words), for a stream too (the
    refusal comes before any chunk), and the replica that refused is no worse for it (a
    4xx is the client's: no ejection). With an engine_render pool the engine's render
    refuses it first: a 400 too. Never a 500, never a 200."""
    async with stack(count=2, policy=policy) as st, st.http() as h:
        for endpoint in ("chat", "completion"):
            for field, value in REFUSED + REFUSED_BEFORE:
                for stream in (False, True):
                    path, body = _body(endpoint, field, value)
                    body["model"] = st.model
                    if field != "stream":
                        body["stream"] = stream
                    r = await h.post(path, json=body)
                    assert r.status_code == 400, (endpoint, field, value, stream, r.text)
                    assert r.headers["content-type"].startswith("application/json")
                    err = r.json()["error"]
                    assert isinstance(err["message"], str) and err["message"], err
                    assert isinstance(err["type"], str) and "param" in err and "code" in err
        # every replica still routable: refusals of the client's input eject none
        replicas = (await h.get("/admin/replicas", headers=st.admin_headers())).json()
        assert all(r["routable"] for r in replicas["replicas"]), replicas
        # and what vLLM takes is served
        for endpoint in ("chat", "completion"):
            for field, value in ACCEPTED:
                path, body = _body(endpoint, field, value)
                body["model"] = st.model
                r = await h.post(path, json=body)
                assert r.status_code == 200, (endpoint, field, value, r.text)
