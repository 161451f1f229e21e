"""Policy files: the shipped ones validate, a bad one names its field, reload keeps the old."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.policy_store import PolicyStore
from gateway.routing import Strategy
from policies.schema import PolicyError, builtin_policy_path, load_policy, parse_policy_text


@pytest.mark.parametrize("name", ["default", "latency-first", "isolation-strict"])
def test_shipped_policies_validate(name: str) -> None:
    pol = load_policy(builtin_policy_path(name))
    assert pol.routing.strategy is Strategy.EXPECTED_LATENCY
    assert pol.cost.coefficients().prefill_ms_per_token > 0
    assert "#" in builtin_policy_path(name).read_text()  # commented


def test_isolation_strict_makes_unknown_tenants_sensitive() -> None:
    pol = load_policy(builtin_policy_path("isolation-strict"))
    t = pol.tenant("someone")
    assert t.sensitive.default == "session" and t.limits.uncached_tokens_per_s


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("routing: {temperature: -1}", "routing.temperature"),
        ("routing: {strategy: fastest}", "routing.strategy"),
        ("cost: {prefil_ms_per_token: 1}", "cost.prefil_ms_per_token"),
        ("quarantine: {missing_fraction: 2}", "quarantine.missing_fraction"),
        ("tenants: {acme: {limits: {max_concurrency: 0}}}", "tenants.acme.limits.max_concurrency"),
        ("models: {default: {tokenizer: hf}}", "models.default"),
    ],
)
def test_invalid_policy_names_the_failing_field(text: str, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text, "t.yaml")
    assert field in str(err.value)
    assert any(f.startswith(field) for f in err.value.fields) or field in str(err.value)


def test_trust_group_membership_is_checked() -> None:
    with pytest.raises(PolicyError, match="undeclared trust group"):
        parse_policy_text("tenants: {a: {trust_group: g}}")
    with pytest.raises(PolicyError, match="not a member"):
        parse_policy_text("tenants: {a: {trust_group: g}}\ntrust_groups: {g: [b]}")
    pol = parse_policy_text("tenants: {a: {trust_group: g}}\ntrust_groups: {g: [a, b]}")
    assert pol.tenant("a").trust_group == "g"


def test_not_yaml_and_not_a_mapping() -> None:
    with pytest.raises(PolicyError, match="not valid YAML"):
        parse_policy_text("routing: [unclosed")
    with pytest.raises(PolicyError, match="mapping"):
        parse_policy_text("- a list")


def current(store: PolicyStore) -> Strategy:
    return store.policy.routing.strategy


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # mtime moves for sure


def test_store_reloads_on_change_and_keeps_old_on_error(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    seen: list[Strategy] = []
    store.on_change = lambda p: seen.append(p.routing.strategy)
    assert store.policy.routing.strategy is Strategy.ROUND_ROBIN
    assert not store.changed_on_disk()
    _touch(f, "routing: {strategy: least_loaded}\n")
    assert store.changed_on_disk()
    store.reload_file()
    assert current(store) is Strategy.LEAST_LOADED and seen == [Strategy.LEAST_LOADED]
    _touch(f, "routing: {strategy: nonsense}\n")
    with pytest.raises(PolicyError):
        store.reload_file()
    assert current(store) is Strategy.LEAST_LOADED  # the old policy stays
    assert store.last_error and "routing.strategy" in store.last_error
    store.reload_text("routing: {strategy: random}")
    assert current(store) is Strategy.RANDOM


async def test_watch_picks_up_a_file_change(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    results: list[bool] = []
    got = asyncio.Event()

    def on_result(ok: bool, _err: str) -> None:
        results.append(ok)
        got.set()

    store.start(0.05, on_result)
    try:
        _touch(f, "routing: {strategy: random}\n")
        await asyncio.wait_for(got.wait(), 5.0)
    finally:
        await store.stop()
    assert results == [True] and store.policy.routing.strategy is Strategy.RANDOM
