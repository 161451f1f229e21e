"""`/admin/route/explain` refuses a tenant name no request can carry and says whether a
well-formed one is known, and the admin API's own refusals carry the gateway's codes
(review R2, O7 and N4).

O7: `?tenant=a%20b` was explained as a cold tenant, 200: the answer every replica
`matched_blocks` 0 looks authoritative, while no API key can ever map to that name. N4: an
unknown replica operation (404) and an unknown strategy (400) answered `code: null`, where
gateway.md promises the gateway's own codes. Real pieces: a gateway on loopback with two
simulated replicas."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.auth import KeyStore, hash_key
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)


async def test_explain_refuses_a_tenant_name_no_key_can_carry() -> None:
    async with stack(count=2) as st, st.http() as h:
        body = {"model": st.model, "prompt": words(40, 3), "max_tokens": 1}
        adm = st.admin_headers()
        for name in ("a b", "x" * 65, "é", "a/b"):
            r = await h.post(
                "/admin/route/explain", params={"tenant": name}, json=body, headers=adm
            )
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_tenant" and err["param"] == "tenant", err
        r = await h.post(
            "/admin/route/explain", json=body, headers={**adm, "x-kvgate-tenant": "not a name"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tenant"
        # a name a key can carry is explained as before
        for name in ("acme", "a.b-c_9", "x" * 64):
            r = await h.post(
                "/admin/route/explain", params={"tenant": name}, json=body, headers=adm
            )
            assert r.status_code == 200 and r.json()["tenant"] == name, r.text


async def test_the_admin_apis_refusals_carry_the_gateways_codes() -> None:
    async with stack(count=2) as st, st.http() as h:
        body = {"model": st.model, "prompt": words(40, 3), "max_tokens": 1}
        adm = st.admin_headers()
        r = await h.post(
            "/admin/route/explain", params={"strategy": "fastest"}, json=body, headers=adm
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_strategy", r.text
        assert err["param"] == "strategy" and "expected_latency" in err["message"]
        r = await h.post(
            "/admin/route/explain", params={"endpoint": "embedding"}, json=body, headers=adm
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "invalid_endpoint", r.text
        assert err["param"] == "endpoint" and "embeddings" in err["message"]
        rid = st.gw.replicas_state()[0]["id"]
        r = await h.post(f"/admin/replicas/{rid}/explode", headers=adm)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_operation", r.text


async def test_explain_says_whether_the_tenant_is_one_the_gateway_knows() -> None:
    """O7: `?tenant=acm` (a typo of acme) answered 200 as a cold tenant with nothing to say
    it was unknown; the answer now carries `tenant_known` and, when false, a note."""
    keys = KeyStore({hash_key("sk-acme"): "acme", hash_key("sk-beta"): "beta"})
    policy = "tenants: {gamma: {}}"
    async with (
        stack(count=2, policy=policy, open_access=False, build={"key_store": keys}) as st,
        st.http() as h,
    ):
        body = {"model": st.model, "prompt": words(40, 3), "max_tokens": 1}
        adm = st.admin_headers()

        async def explain(**params: str) -> dict[str, Any]:
            r = await h.post("/admin/route/explain", params=params, json=body, headers=adm)
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out

        for name in ("acme", "beta", "gamma"):  # a key's tenant, the policy's
            got = await explain(tenant=name)
            assert got["tenant_known"] is True and "note" not in got, got
        got = await explain(tenant="acm")
        assert got["tenant_known"] is False and "'acm'" in got["note"], got
        got = await explain()  # anonymous without --open: no key carries it
        assert got["tenant"] == "anonymous" and got["tenant_known"] is False
        r = await h.post(
            "/admin/route/explain",
            json=body,
            headers={**adm, "authorization": "Bearer sk-beta"},
        )
        assert r.json()["tenant"] == "beta" and r.json()["tenant_known"] is True


async def test_under_open_access_anonymous_is_known() -> None:
    async with stack(count=1) as st, st.http() as h:
        body = {"model": st.model, "prompt": words(40, 3), "max_tokens": 1}
        r = await h.post("/admin/route/explain", json=body, headers=st.admin_headers())
        assert r.json()["tenant"] == "anonymous" and r.json()["tenant_known"] is True
