"""Two answers of the gateway's HTTP surface an operator's walkthrough (twenty-ninth
session) found wanting: a path with a trailing slash got a bare 307 to the path without it
(the only answer that was no OpenAI error JSON; OpenAI answers it 404 "Invalid URL"), and
``POST /admin/stages`` answered with the counters after its reset (all zeros), so what it
threw away could not be read."""

from __future__ import annotations

import pytest

from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions/"),
        ("POST", "/v1/completions/"),
        ("GET", "/health/"),
    ],
)
async def test_a_trailing_slash_is_an_openai_404_not_a_redirect(method: str, path: str) -> None:
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "messages": [{"role": "user", "content": "hi"}]}
        r = await h.request(method, path, json=body if method == "POST" else None)
        assert r.status_code == 404, (r.status_code, r.headers.get("location"), r.text)
        assert "location" not in r.headers
        err = r.json()["error"]
        assert err["message"] == f"Invalid URL ({method} {path})", err
        assert err["type"] == "invalid_request_error", err


async def test_post_stages_answers_with_what_it_resets() -> None:
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(3):
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        before = (await h.get("/admin/stages", headers=st.admin_headers())).json()["stages"]
        assert before["parse"]["count"] >= 3, before
        reset = await h.post("/admin/stages", headers=st.admin_headers())
        assert reset.status_code == 200, reset.text
        dropped = reset.json()["stages"]
        assert dropped["parse"]["count"] >= before["parse"]["count"], (dropped, before)
        assert dropped["parse"]["cpu_us_total"] > 0, dropped
        after = (await h.get("/admin/stages", headers=st.admin_headers())).json()["stages"]
        assert all(v["count"] == 0 and v["cpu_us_total"] == 0 for v in after.values()), after
