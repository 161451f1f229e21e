"""Request fields of the wrong type, as a demanding client sends them: the gateway answers
what vLLM's OpenAI server answers, rather than rewriting the field into something valid."""

from __future__ import annotations

import orjson
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


@pytest.mark.parametrize(
    ("options", "final_usage", "per_chunk"),
    [
        ({}, True, False),
        ({"continuous_usage_stats": True}, True, True),
        ({"include_usage": None, "continuous_usage_stats": True}, False, False),
        ({"include_usage": False}, False, False),
    ],
)
async def test_stream_options_without_include_usage_ask_for_usage_as_in_vllm(
    options: dict[str, object], final_usage: bool, per_chunk: bool
) -> None:
    """vLLM's ``StreamOptions.include_usage`` defaults to true: ``"stream_options": {}``
    (or only ``continuous_usage_stats``) gets the final usage chunk from vLLM, and per-chunk
    usage with ``continuous_usage_stats``. The gateway read an absent ``include_usage`` as
    false and dropped the usage chunk it had asked for itself, so a client that counts its
    tokens that way got none through kvgate. Null is false, as in vLLM."""
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "prompt": words(20, 4), "max_tokens": 3, "stream": True}
        r = await h.post("/v1/completions", json={**body, "stream_options": options})
        assert r.status_code == 200, r.text
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        chunks = [orjson.loads(e) for e in events[:-1]]
        usage_only = [c for c in chunks if c.get("usage") and not c["choices"]]
        assert len(usage_only) == (1 if final_usage else 0), chunks
        with_text = [c for c in chunks if c["choices"]]
        assert all(bool(c.get("usage")) is per_chunk for c in with_text), with_text


async def test_continue_final_message_is_read_as_the_engine_reads_it() -> None:
    """``"continue_final_message": "false"`` (or ``"no"``) is false to vLLM's pydantic
    model, but the chat options took it by truthiness: the gateway rendered the last turn
    continued, the engine did not, and the gateway's token count (so its block keys and
    prediction) differed from the engine's ("tokenizers are misaligned" in the log). A
    value that is no boolean is a 400 before routing, as the engine answers."""
    async with stack(count=1) as st, st.http() as h:
        turns = [
            {"role": "user", "content": words(20, 3)},
            {"role": "assistant", "content": "par"},
        ]
        base = {"model": st.model, "messages": turns, "max_tokens": 1}
        for value in (False, "false", "no", 0, True, "true", 1):
            body = {**base, "continue_final_message": value, "add_generation_prompt": False}
            ex = await h.post("/admin/route/explain", json=body, headers=st.admin_headers())
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == ex.status_code == 200, (value, r.text)
            assert ex.json()["prompt_tokens"] == r.json()["usage"]["prompt_tokens"], value
        r = await h.post("/v1/chat/completions", json={**base, "continue_final_message": "maybe"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "continue_final_message"
