"""A /rerank request whose ``documents`` is one string (H179 review of H175's /rerank):
vLLM 0.33's ``RerankRequest.documents`` is ``ScoreInput | list[ScoreInput]`` and
``validate_score_input`` makes a lone one a list of one, so the engine ranks it. The
gateway's pair reading and the simulated replica's model took only an array (a 400)."""

from __future__ import annotations

import pytest

from cachecore.tokenizer import builtin_tokenizer
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)


async def test_one_document_as_a_string_is_ranked_as_a_list_of_one() -> None:
    tok = builtin_tokenizer()
    query, doc = words(10, 1), words(14, 2)
    async with stack(count=1) as st, st.http() as h:
        one = {"query": query, "documents": doc}
        listed = {"query": query, "documents": [doc]}
        for route, name in (("/rerank", "rerank"), ("/v2/rerank", "rerank_v2")):
            r = await h.post(route, json=one)
            assert r.status_code == 200, (route, r.text)
            want = await h.post(route, json=listed)
            assert want.status_code == 200, want.text
            got = r.json()
            assert got["results"] == want.json()["results"]
            assert got["results"][0]["document"] == {"text": doc}
            used = got["usage"]["prompt_tokens"]
            assert used == want.json()["usage"]["prompt_tokens"] > len(tok.encode(doc))
            d = await st.gw.prepare(name, "anonymous", dict(one), {}, "x", True)
            assert d.prompt_tokens == used
        # the direct replica too, and what stays a 400
        url = st.fleet.endpoints[0].url
        r = await h.post(f"{url}/rerank", json=one)
        assert r.status_code == 200, r.text
        for bad in ([], [doc, 3], 3):
            r = await h.post("/rerank", json={"query": query, "documents": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
