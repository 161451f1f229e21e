"""Policy settings that would be silently ignored are refused at load (review R2, O1-O3).

O1: ``requests_burst`` / ``uncached_tokens_burst`` without their rate were accepted and
limited nothing (the limiter builds a bucket only from a rate): an operator who wrote only
the burst believed the tenant limited. O2: ``trust_groups`` membership was one-sided: a
member listed that is not a tenant, or does not name the group in its own ``trust_group``,
shared nothing (the scope comes from ``trust_group`` alone) and nothing said so."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.limits import TenantLimiter
from gateway.policy_store import PolicyStore
from policies.schema import (
    EMPTY_POLICY,
    Policy,
    PolicyError,
    TenantLimits,
    bucket_burst,
    builtin_policy_path,
    load_policy,
    parse_policy_text,
)


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (
            "default_tenant:\n  limits: {requests_burst: 1}",
            "default_tenant.limits.requests_burst",
            "needs requests_per_s",
        ),
        (
            "default_tenant:\n  limits: {uncached_tokens_burst: 1}",
            "default_tenant.limits.uncached_tokens_burst",
            "needs uncached_tokens_per_s",
        ),
        (  # the requests rate does not stand in for the tokens' one
            "tenants:\n  acme: {limits: {requests_per_s: 5, uncached_tokens_burst: 9000}}",
            "tenants.acme.limits.uncached_tokens_burst",
            "needs uncached_tokens_per_s",
        ),
    ],
)
def test_a_burst_without_its_rate_is_refused(text: str, field: str, words: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text)
    assert err.value.fields == [field]
    assert words in str(err.value)


def test_a_burst_with_its_rate_limits_and_a_rate_alone_holds_one_second() -> None:
    pol = parse_policy_text(
        "default_tenant:\n  limits: {requests_per_s: 0.001, requests_burst: 2,"
        " uncached_tokens_per_s: 1000}"
    )
    limits = pol.default_tenant.limits
    lim = TenantLimiter()
    got = []
    for _ in range(3):  # the burst of 2, then the rate's wait
        rej = lim.admit("t", limits, 100.0)
        got.append(None if rej is None else rej.limit)
        lim.release("t")
    assert got == [None, None, "rate"]
    # the documented default: one second of the rate, at least 1
    assert bucket_burst(1000.0, None) == 1000.0 and bucket_burst(0.001, None) == 1.0
    assert lim.charge_uncached("t", limits, 1000, 100.0) is None
    assert lim.charge_uncached("t", limits, 1, 100.0) is not None
    assert TenantLimits(requests_per_s=3).requests_burst is None


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        (  # listed on the group's side only: the reviewer's repro
            "tenants: {acme: {}, beta: {}}\ntrust_groups: {fam: [acme, beta]}",
            "trust_groups.fam.0",
            "'acme' does not set trust_group: fam",
        ),
        (
            "tenants: {acme: {trust_group: fam}, beta: {}}\ntrust_groups: {fam: [acme, beta]}",
            "trust_groups.fam.1",
            "'beta' does not set trust_group: fam",
        ),
        ("trust_groups: {g: [ghost]}", "trust_groups.g.0", "'ghost' is not in tenants"),
        ("trust_groups: {g: ['not a tenant!']}", "trust_groups.g.0", "is not a tenant name"),
        (  # a in g1 only, also listed in g2
            "tenants: {a: {trust_group: g1}}\ntrust_groups: {g1: [a], g2: [a]}",
            "trust_groups.g2.0",
            "'a' does not set trust_group: g2",
        ),
    ],
)
def test_a_one_sided_trust_group_is_refused(text: str, field: str, words: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text)
    assert err.value.fields == [field]
    assert words in str(err.value)


def test_a_group_declared_on_both_sides_loads() -> None:
    pol = parse_policy_text(
        "tenants: {a: {trust_group: g}, b: {trust_group: g}, c: {}}\n"
        "trust_groups: {g: [a, b], empty: []}"
    )
    assert pol.tenant("a").trust_group == pol.tenant("b").trust_group == "g"
    # the commented example of isolation-strict.yaml, written out, loads
    text = (
        builtin_policy_path("isolation-strict")
        .read_text()
        .replace(
            "tenants: {}\n",
            "tenants: {acme: {trust_group: acme-family}, acme-labs: {trust_group: acme-family}}\n",
        )
    )
    text = text.replace("trust_groups: {}\n", "trust_groups: {acme-family: [acme, acme-labs]}\n")
    assert parse_policy_text(text).tenant("acme-labs").trust_group == "acme-family"


@pytest.mark.parametrize("name", ["default", "isolation-strict", "latency-first"])
def test_every_builtin_policy_still_loads(name: str) -> None:
    load_policy(builtin_policy_path(name), allow_empty=False)


@pytest.mark.parametrize("text", ["", "# rendered from a template: nothing\n", "\n\n"])
def test_an_empty_policy_file_is_refused_at_start_up_as_at_a_reload(
    text: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """O3: a reload refuses an empty file (read between its truncation and its rewrite, it
    would be the built-in defaults), but start-up took it and served the defaults without a
    word: no sensitive default, no limits, no cold confinement."""
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError, match="the policy is empty"):
        PolicyStore(path)
    assert main(["serve", "--open", "--port", "0", "--policy", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"kvgate serve: invalid policy {path}: {EMPTY_POLICY}"  # (a log line)
    path.write_text("{}\n")  # the explicit way to ask for the defaults
    assert PolicyStore(path).policy == Policy()


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ("cost: {overhead_ms: true}", "cost.overhead_ms", "a number, not true"),
        ("quarantine: {k: true}", "quarantine.k", "a number, not true"),
        ("routing: {temperature: false}", "routing.temperature", "a number, not false"),
        ("routing: {spill_queue_ms: true}", "routing.spill_queue_ms", "a number"),
        ("models: {pools: {m: {block_size: yes}}}", "models.pools.m.block_size", "a number"),
        ("version: true", "version", "a number"),
        (  # read by no tokenizer but hf: the directory would never be looked at
            "models: {default: {tokenizer: builtin, tokenizer_dir: /nonexistent}}",
            "models.default.tokenizer_dir",
            "only with tokenizer 'hf'",
        ),
        (
            "models: {pools: {m: {tokenizer: engine_render, tokenizer_dir: /x}}}",
            "models.pools.m.tokenizer_dir",
            "only with tokenizer 'hf'",
        ),
    ],
)
def test_a_value_that_cannot_take_effect_is_refused(text: str, field: str, words: str) -> None:
    """O9: YAML's true/false in a number field were read as 1 and 0 (pydantic's lax mode):
    `overhead_ms: true` was 1 ms, accepted; a tokenizer_dir beside another tokenizer than hf
    was never looked at."""
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text)
    assert err.value.fields == [field]
    assert words in str(err.value)


def test_booleans_still_load_where_the_field_is_one() -> None:
    pol = parse_policy_text(
        "quarantine: {enabled: false}\n"
        "default_tenant: {sensitive: {allow_header: true}}\n"
        "models: {default: {alignment_check: false}}\n"
        "cost: {fit: {enabled: false}}"
    )
    assert not pol.quarantine.enabled and pol.default_tenant.sensitive.allow_header
    assert not pol.models.default.alignment_check and not pol.cost.fit.enabled
