"""Policy validation an operator's file meets (names the gateway can never see)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.auth import load_key_file
from gateway.policy_store import PolicyStore
from policies.schema import PolicyError, parse_policy_text


@pytest.mark.parametrize("name", ["acme corp", "", "acme/prod", "a" * 65, "acmé"])
def test_a_tenant_no_api_key_can_name_is_refused(name: str, tmp_path: Path) -> None:
    """`tenants: {"acme corp": {sensitive: {default: session}}}` was accepted, but no API
    key can carry that tenant (the key file and the Redis hash take [A-Za-z0-9._-]{1,64}):
    acme's requests ran under default_tenant, not sensitive, with none of its limits, and
    nothing said so. Refused at start-up and on reload (the old policy kept)."""
    text = f"tenants: {{{name!r}: {{sensitive: {{default: session}}}}}}\n"
    with pytest.raises(PolicyError) as info:
        parse_policy_text(text)
    assert info.value.fields == [f"tenants.{name}"]
    assert "is not a tenant name" in str(info.value)
    # the same name is one a key file refuses: no request can ever be that tenant
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - {{sha256: {'a' * 64}, tenant: {name!r}}}\n")
    with pytest.raises(ValueError):
        load_key_file(keys)
    f = tmp_path / "p.yaml"
    f.write_text("tenants: {acme: {sensitive: {default: session}}}\n")
    store = PolicyStore(f)
    f.write_text(text)
    with pytest.raises(PolicyError):
        store.reload_file()
    assert list(store.policy.tenants) == ["acme"]


def test_every_name_a_key_can_carry_is_accepted() -> None:
    pol = parse_policy_text("tenants: {acme: {}, a.b-c_1: {}, " + "Z" * 64 + ": {}}\n")
    assert len(pol.tenants) == 3
