"""Request fields of the wrong type, as a demanding client sends them: the gateway answers
what vLLM's OpenAI server answers, rather than rewriting the field into something valid."""

from __future__ import annotations

import pytest

from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)


async def test_stream_options_that_are_no_object_are_a_400() -> None:
    """``"stream_options": "x"`` (or a list, a number) on a stream was ignored as "no
    options", and the gateway sent its own ``{"include_usage": true}`` in its place: the
    engine never saw the client's mistake, and the client got a 200 stream where vLLM's
    model answers 400. Null is "no options", as in vLLM."""
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "prompt": words(20, 3), "max_tokens": 1, "stream": True}
        bads: list[object] = ["x", [], 5, True]
        for bad in bads:
            for path in ("/v1/completions", "/v1/chat/completions"):
                sent = dict(body, stream_options=bad)
                if path.endswith("chat/completions"):
                    sent = {k: v for k, v in sent.items() if k != "prompt"}
                    sent["messages"] = [{"role": "user", "content": "hi"}]
                r = await h.post(path, json=sent)
                assert r.status_code == 400, (bad, r.text)
                assert r.json()["error"]["param"] == "stream_options"
        r = await h.post("/v1/completions", json={**body, "stream_options": None})
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", "x"), ("documents", {"a": 1}), ("chat_template_kwargs", [1])],
)
async def test_a_chat_option_of_the_wrong_type_is_named_as_the_param(
    field: str, value: object
) -> None:
    """A ``tools`` (``documents``, ``chat_template_kwargs``) of the wrong type was a 400
    whose ``param`` was ``messages``: an SDK user was pointed at the wrong field."""
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "messages": [{"role": "user", "content": "hi"}], field: value}
        r = await h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"]
