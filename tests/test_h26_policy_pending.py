"""``GET /admin/policy`` shows a policy file held back because it weakens isolation.

Since review S6 a file reload that weakens isolation waits until the file has kept still
for ``KVGATE_POLICY_WEAKEN_SETTLE_S``; meanwhile GET /admin/policy showed the old policy
with no sign that a new one waited (only a WARNING in the log). Now it answers ``pending``:
the file, what it weakens, since when and when it may apply; ``null`` when nothing waits,
and again once the held file is applied or superseded.

Real pieces: a gateway on loopback with simulated replicas (policy polled every 0.05 s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.test_api_keys import wait_until
from tests.test_gateway_support import stack
from tests.test_h25_policy_partial import STRICT, _replace

pytestmark = pytest.mark.timeout(60)


async def test_get_admin_policy_shows_a_held_file_until_it_applies(tmp_path: Path) -> None:
    settle_s = 1.5
    path = tmp_path / "policy.yaml"
    path.write_text(STRICT)
    loose = STRICT.replace("default: session        #", "default: none        #")
    assert loose != STRICT
    async with (
        stack(count=1, policy_file=path, policy_weaken_settle_s=settle_s) as st,
        st.http() as h,
    ):
        gw = st.gw

        async def shown() -> dict[str, object]:
            r = await h.get("/admin/policy", headers=st.admin_headers())
            assert r.status_code == 200, r.text
            body: dict[str, object] = r.json()
            return body

        assert (await shown())["pending"] is None
        t0 = time.time()
        _replace(path, loose)
        await wait_until(lambda: gw.policies.pending() is not None)
        during = await shown()
        t1 = time.time()
        await wait_until(lambda: gw.policy.default_tenant.sensitive.default == "none")
        after = await shown()
    pending = during["pending"]
    assert isinstance(pending, dict)
    assert pending["file"] == str(path)
    assert pending["weakens"] == ["default_tenant.sensitive.default: session -> none"]
    since, applies_at = pending["since"], pending["applies_at"]
    assert isinstance(since, float) and isinstance(applies_at, float)
    assert t0 - 0.01 <= since <= t1  # the wall clock: when the file took that version
    assert applies_at == pytest.approx(since + settle_s, abs=0.002)
    policy = during["policy"]
    assert isinstance(policy, dict)
    assert policy["default_tenant"]["sensitive"]["default"] == "session"  # still the old
    assert after["pending"] is None


async def test_a_post_or_a_change_drops_what_get_admin_policy_shows(tmp_path: Path) -> None:
    """A POST applied meanwhile supersedes the held file, and so does a change of the file
    to one that weakens nothing: ``pending`` goes back to null."""
    path = tmp_path / "policy.yaml"
    path.write_text(STRICT)
    async with (
        stack(count=1, policy_file=path, policy_weaken_settle_s=30.0) as st,
        st.http() as h,
    ):
        gw = st.gw
        _replace(path, "{}\n")
        await wait_until(lambda: gw.policies.pending() is not None)
        r = await h.post("/admin/policy", content=STRICT, headers=st.admin_headers())
        assert r.status_code == 200, r.text
        r = await h.get("/admin/policy", headers=st.admin_headers())
        assert r.json()["pending"] is None
        _replace(path, "{}\n# again\n")  # weakening again: held again
        await wait_until(lambda: gw.policies.pending() is not None)
        _replace(path, STRICT.replace("max_concurrency: 16", "max_concurrency: 2"))
        await wait_until(lambda: gw.policy.default_tenant.limits.max_concurrency == 2)
        r = await h.get("/admin/policy", headers=st.admin_headers())
        assert r.json()["pending"] is None
