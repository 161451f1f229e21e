"""A model served under several names (vLLM's ``--served-model-name a b``) is one cache: the
gateway keys every name's prompts under the name the agents key by (the engine's first
served name, ``ReplicaPool.model_names``), so a request naming one alias predicts the hits
that requests naming another left. Before, each name keyed apart: the request after an
alias's was predicted 0 cached tokens and got 320 (the red team's note 5, this session).
Real gateway, simulated replica and the red-team test's aliasing proxy."""

from __future__ import annotations

import pytest

from tests.test_gateway_support import words
from tests.test_h29_redteam_aliases import ALIAS, _wait_models, aliased
from tests.test_isolation import auth, chat_body

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("first", ["alias", "served"])
async def test_every_served_name_predicts_the_hits_of_the_others(first: str) -> None:
    async with aliased("tenants: {b: {}}") as (st, model, bodies), st.http() as h:
        await _wait_models(st, {model, ALIAS})
        names = (ALIAS, model) if first == "alias" else (model, ALIAS)
        system = words(320, 9)
        seen: list[tuple[int, int]] = []
        for i, requested in enumerate(names):
            r = await h.post(
                "/v1/chat/completions",
                json=chat_body(requested, system, f"q{i}"),
                headers=auth("sk-b"),
            )
            assert r.status_code == 200, r.text
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            seen.append((predicted, cached))
        assert seen[0] == (0, 0), seen
        predicted, cached = seen[1]
        assert cached >= 300, seen  # the engine's one cache holds the first request's prompt
        assert predicted == cached, seen  # before: predicted 0 across names
        assert {b["model"] for b in bodies} == {model}  # the engine was asked by its name
