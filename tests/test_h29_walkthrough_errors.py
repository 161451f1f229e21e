"""An operator's walkthrough of the error answers (twenty-ninth session): a chat content
part of a type that is neither text nor media (a typo such as ``"type": "foo"``, a number)
was refused with "kvgate routes text; media parts are not supported", although the gateway
takes media parts (docs/gateway.md, Request path, 6: sized by their text, routed by load).
A client reading that message would drop its images. The 400 stays; its message now names
the part types there are, and a media part is still routed."""

from __future__ import annotations

import pytest

from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(60)


def _chat(model: str, part: object) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}],
    }


@pytest.mark.parametrize(
    "part",
    [
        {"type": "foo", "text": "x"},
        {"type": 5, "text": "x"},
        # unhashable types: a set lookup of them raised TypeError, a 500 not this 400
        {"type": ["text"], "text": "x"},
        {"type": {"text": "x"}, "text": "x"},
    ],
)
async def test_an_unknown_part_type_is_a_400_that_does_not_refuse_media(part: object) -> None:
    async with stack(count=1) as st, st.http() as h:
        r = await h.post("/v1/chat/completions", json=_chat(st.model, part))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "messages"
        msg = err["message"]
        assert "unsupported content part type" in msg and repr(part["type"]) in msg  # type: ignore[index]
        assert "not supported" not in msg, msg
        assert "image_url" in msg and "input_text" in msg, msg  # the types there are


async def test_a_media_part_is_still_routed_by_load() -> None:
    """What the old message denied: the gateway sizes an image part and routes the chat by
    load alone (explained, since the simulated engine itself serves text only)."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    async with stack(count=1) as st, st.http() as h:
        r = await h.post(
            "/admin/route/explain", json=_chat(st.model, image), headers=st.admin_headers()
        )
        assert r.status_code == 200, r.text
        assert r.json()["decision"]["reason"] == "unkeyed_load"
