"""Pooling request options the gateway must read as vLLM does before it charges the
budget (review of D29, vLLM 0.33's ``vllm/entrypoints/pooling``): a rerank's ``top_n``
(``RerankRequest.top_n: Field(default=0, ge=0)``), ``padding: "max_length"`` (each engine
request padded to the model's context by ``TokenizeParams.with_kwargs`` /
``_token_padding``), and which form runs when an embeddings body holds both ``input`` and
``messages``. Real simulated replicas and a real gateway on free loopback ports."""

from __future__ import annotations

import pytest

from tests.test_agent_helpers import counter_total
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(90)


async def test_a_negative_or_malformed_top_n_is_the_gateways_400_before_any_work() -> None:
    """vLLM refuses ``top_n`` < 0 (and what no int is) with a 400 naming it. The gateway
    charged the request's pairs, routed it and relayed the replica's 400 (the charge
    refunded): now it refuses first, naming ``top_n``, with no budget spent or replica
    trip. 0 (every document) and lax ints as vLLM reads them pass."""
    policy = "default_tenant:\n  limits: {uncached_tokens_per_s: 1, uncached_tokens_burst: 500}"
    async with stack(count=1, policy=policy) as st, st.http() as h:
        docs = [words(20, i) for i in range(3)]
        for top_n in (-1, -100, 1.5, "x", None, [1]):
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                r = await h.post(path, json={"query": "q", "documents": docs, "top_n": top_n})
                assert r.status_code == 400, (top_n, path, r.text)
                assert r.json()["error"]["param"] == "top_n", r.text
        assert counter_total(st.gw.metrics.decisions) == 0  # nothing routed
        for top_n in (0, 2, "2", 2.0, 10):
            r = await h.post("/rerank", json={"query": "q", "documents": docs, "top_n": top_n})
            assert r.status_code == 200, (top_n, r.text)
            want = 3 if top_n in (0, 10) else 2
            assert len(r.json()["results"]) == want, top_n
        assert counter_total(st.gw.metrics.decisions) == 5


async def test_with_both_input_and_messages_the_replica_runs_what_vllm_runs() -> None:
    """vLLM's embeddings, /pooling and /classify requests are unions of a completion form
    (``input``) and a chat form (``messages``), and pydantic's smart union runs the member
    with the most fields set, the keys of each message counting for the chat form: with
    both, the messages run, unless they are empty with no chat-only field set (a tie: the
    first member, the input) or are not chat messages (the chat form fails). The simulated
    replica ran the input whenever one was given. The gateway charges the larger form."""
    msgs = [{"role": "system", "content": words(40, 1)}, {"role": "user", "content": "hi"}]
    async with stack(count=1) as st, st.http() as h:
        replica = st.fleet.endpoints[0].url
        for path in ("/v1/embeddings", "/pooling", "/classify"):
            chat = (await h.post(f"{replica}{path}", json={"messages": msgs})).json()
            text = (await h.post(f"{replica}{path}", json={"input": "a b"})).json()
            assert chat["usage"]["prompt_tokens"] > 40 and text["usage"]["prompt_tokens"] == 2
            cases = [
                ({"input": "a b", "messages": msgs}, chat),
                ({"input": [1, 2], "messages": msgs, "add_generation_prompt": False}, chat),
                ({"input": "a b", "messages": []}, text),
                ({"input": "a b", "messages": [{"content": "no role"}]}, text),
            ]
            for body, want in cases:
                r = await h.post(f"{replica}{path}", json=body)
                assert r.status_code == 200, (path, body, r.text)
                assert r.json()["data"] == want["data"], (path, body)
                assert r.json()["usage"] == want["usage"], (path, body)
            # an empty conversation with a chat-only field set: the chat form runs, and the
            # simulated template refuses an empty conversation
            r = await h.post(
                f"{replica}{path}",
                json={"input": "a b", "messages": [], "add_generation_prompt": True},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
            # through the gateway: the engine's answer, charged at least what it ran
            body = {"input": "a b", "messages": msgs}
            r = await h.post(path, json=body)
            assert r.status_code == 200 and r.json()["data"] == chat["data"], r.text
            ep = {"/v1/embeddings": "embeddings"}.get(path, path[1:])
            d = await st.gw.prepare(ep, "anonymous", dict(body), {}, "x", True)
            assert d.prompt_tokens >= chat["usage"]["prompt_tokens"]
