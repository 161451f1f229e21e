"""Policy files: the shipped ones validate, a bad one names its field, reload keeps the old."""

from __future__ import annotations

import asyncio
import math
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
    pol = parse_policy_text("tenants: {a: {trust_group: g}}\ntrust_groups: {g: [a]}")
    assert pol.tenant("a").trust_group == "g"


def test_not_yaml_and_not_a_mapping() -> None:
    with pytest.raises(PolicyError, match="not valid YAML"):
        parse_policy_text("routing: [unclosed")
    with pytest.raises(PolicyError, match="mapping"):
        parse_policy_text("- a list")


@pytest.mark.parametrize(
    ("text", "fields"),
    [
        # model-level checks: pydantic places them at the model, the error names the field
        ("tenants: {a: {trust_group: g}}", ["tenants.a.trust_group"]),
        ("tenants: {a: {trust_group: g}}\ntrust_groups: {g: [b]}", ["tenants.a.trust_group"]),
        ("default_tenant: {trust_group: g}", ["default_tenant.trust_group"]),
        ("quarantine: {k: 9}", ["quarantine.k"]),
        ("models: {pools: {m: {tokenizer: hf}}}", ["models.pools.m.tokenizer_dir"]),
        # a repeated key: where it is written
        ("routing:\n  strategy: round_robin\nrouting:\n  tie_epsilon_ms: 1.0\n", ["routing"]),
        ("cost:\n  saturation_ms: 4\n  saturation_ms: 1\n", ["cost.saturation_ms"]),
        ("tenants:\n  acme: {}\n  acme: {}\n", ["tenants.acme"]),
        ("x: &d {limits: {}, limits: {}}\n", ["x.limits"]),
        ("l:\n  - a: 1\n    a: 2\n", ["l.0.a"]),
        # flow style: one key name twice on one line, told apart by its column
        (
            "tenants: {a: {limits: {max_concurrency: 1}}, "
            "b: {limits: {max_concurrency: 1, max_concurrency: 2}}}",
            ["tenants.b.limits.max_concurrency"],
        ),
        # no field to name: none (it was [""])
        ("routing: [unclosed", []),
        ("- a list", []),
        ("42", []),
    ],
)
def test_policy_errors_name_the_real_field_or_none(text: str, fields: list[str]) -> None:
    """``PolicyError.fields`` is what POST /admin/policy answers as ``error.fields``."""
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text, "t.yaml")
    assert err.value.fields == fields
    for field in fields:  # the message names it once, before its problem
        assert str(err.value).count(f"{field}:") == 1


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


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("cost: {prefill_ms_per_token: .inf}", "cost.prefill_ms_per_token"),
        ("cost: {decode_ms_per_running: .inf}", "cost.decode_ms_per_running"),
        ("cost: {load_ms_per_token: .nan}", "cost.load_ms_per_token"),
        ("cost: {overhead_ms: 1e400}", "cost.overhead_ms"),  # YAML reads it as inf
        ("cost: {overhead_ms: 1e308, prefill_ms_per_token: 1e308}", "cost.overhead_ms"),
        ("cost: {saturation_ms: 1e7}", "cost.saturation_ms"),
        ("cost: {prefill_ms_per_token: 1e5}", "cost.prefill_ms_per_token"),
        ("cost: {tier_load_factor: {remote: 1e300}}", "cost.tier_load_factor.remote"),
        ("cost: {fit: {bound: 1e300}}", "cost.fit.bound"),
        ("routing: {temperature: .nan}", "routing.temperature"),
        ("routing: {sensitive_sticky: {slack_ms: .inf}}", "routing.sensitive_sticky.slack_ms"),
        ("health: {eject_s: .inf}", "health.eject_s"),
        ("tenants: {a: {limits: {requests_per_s: .inf}}}", "tenants.a.limits.requests_per_s"),
    ],
)
def test_non_finite_or_overflowing_numbers_are_refused(text: str, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy_text(text, "t.yaml")
    assert field in err.value.fields


def test_generous_cost_coefficients_stay_finite() -> None:
    # the largest accepted values still give a finite cost for a huge prompt and queue
    from cachecore.scoring import HitPrediction, LoadView, cost_of_hit

    pol = parse_policy_text(
        "cost: {overhead_ms: 1e6, saturation_ms: 1e6, prefill_ms_per_token: 1e4,"
        " load_ms_per_token: 1e4, decode_ms_per_running: 1e4, stall_weight: 10}"
    )
    load = LoadView(running=10**6, queued_prefill_tokens=10**10, capacity=1)
    hit = HitPrediction(10**8, 0, 0, 1e10, 0, 0.8)
    assert math.isfinite(cost_of_hit(hit, load, pol.cost.coefficients()).cost_ms)


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("routing:\n  strategy: round_robin\nrouting:\n  tie_epsilon_ms: 1.0\n", "routing", 3),
        ("cost:\n  saturation_ms: 4\n  overhead_ms: 1\n  saturation_ms: 1\n", "saturation_ms", 4),
        ("tenants:\n  acme: {limits: {requests_per_s: 1}}\n  acme: {}\n", "acme", 3),
        ("routing: {strategy: random, strategy: round_robin}\n", "strategy", 1),
        # a duplicate inside an anchored mapping is refused even when only merged elsewhere
        ("x: &d {limits: {}, limits: {}}\n", "limits", 1),
    ],
)
def test_duplicate_keys_are_refused(text: str, key: str, line: int) -> None:
    with pytest.raises(PolicyError, match=f"duplicate key '{key}' at line {line}"):
        parse_policy_text(text, "t.yaml")


def test_anchors_and_merge_keys_still_work() -> None:
    pol = parse_policy_text(
        "default_tenant: &d\n"
        "  limits: {requests_per_s: 5, max_concurrency: 2}\n"
        "  sensitive: {default: request}\n"
        "tenants:\n"
        "  acme:\n"
        "    <<: *d\n"
        "    sensitive: {default: session}\n"  # overrides the merged key: not a duplicate
        "  beta:\n"
        "    <<: [*d]\n"
        "  gamma: *d\n"
    )
    assert pol.tenant("acme").sensitive.default == "session"
    assert pol.tenant("acme").limits.requests_per_s == 5
    assert pol.tenant("beta").sensitive.default == "request"
    assert pol.tenant("gamma").limits.max_concurrency == 2


def test_reload_with_a_duplicate_key_keeps_the_old_policy(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("routing:\n  strategy: round_robin\n")
    store = PolicyStore(f)
    _touch(f, f.read_text() + "routing:\n  tie_epsilon_ms: 1.0\n")
    with pytest.raises(PolicyError, match="duplicate key 'routing' at line 3"):
        store.reload_file()
    assert current(store) is Strategy.ROUND_ROBIN and store.reloads == 0
    with pytest.raises(PolicyError, match="duplicate key"):
        PolicyStore(f)  # fatal at start-up too


def _hf_policy(directory: Path) -> str:
    return f"models: {{pools: {{m: {{tokenizer: hf, tokenizer_dir: '{directory}'}}}}}}"


def test_hf_tokenizer_dir_must_hold_what_from_dir_loads(tmp_path: Path) -> None:
    from cachecore.tokenizer import HFTokenizer, export_builtin

    field = "models.pools.m.tokenizer_dir"
    with pytest.raises(PolicyError, match="is not a directory") as err:
        parse_policy_text(_hf_policy(tmp_path / "missing"))
    assert field in err.value.fields
    export_builtin(tmp_path)
    pol = parse_policy_text(_hf_policy(tmp_path))  # an exported dir loads
    assert pol.models.pool("m").tokenizer_dir == str(tmp_path)
    assert HFTokenizer.from_dir(tmp_path).vocab_size > 0

    (tmp_path / "chat_template.jinja").unlink()  # the config's chat_template still serves
    parse_policy_text(_hf_policy(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "x"}')
    with pytest.raises(PolicyError, match="no chat template") as err:
        parse_policy_text(_hf_policy(tmp_path))
    assert field in err.value.fields
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(PolicyError, match="unreadable"):
        parse_policy_text(_hf_policy(tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(PolicyError, match=r"no tokenizer\.json") as err:
        parse_policy_text(_hf_policy(tmp_path))
    assert field in err.value.fields


def test_reload_with_a_bad_tokenizer_dir_keeps_the_old_policy(tmp_path: Path) -> None:
    store = PolicyStore(None)
    with pytest.raises(PolicyError, match="tokenizer_dir"):
        store.reload_text(_hf_policy(tmp_path))  # an empty directory
    assert store.reloads == 0 and store.policy.models.pool("m").tokenizer == "builtin"
    assert store.last_error and "no tokenizer.json" in store.last_error


def test_policy_error_lists_each_field_once() -> None:
    """A reload refused for two replicas' block sizes answered POST /admin/policy with
    ``fields: ["models.default.block_size", "models.default.block_size"]``: a field is
    listed once however many problems it has, and the message keeps every problem."""
    err = PolicyError(
        "POST /admin/policy",
        [
            ("models.default.block_size", "32, but replica r0 serves m with block size 16"),
            ("models.default.block_size", "32, but replica r1 serves m with block size 16"),
            ("", "no field"),
        ],
    )
    assert err.fields == ["models.default.block_size"]
    assert "replica r0" in str(err) and "replica r1" in str(err)


@pytest.mark.parametrize("text", ["", "\n", "# being rewritten\n", "null\n", "---\n"])
def test_a_reload_to_an_empty_document_keeps_the_old_policy(tmp_path: Path, text: str) -> None:
    """Review: a file truncated and then rewritten (`cat new.yaml > policy.yaml`, most
    editors' saves) can be read empty between the two, and an empty YAML document was
    applied as the built-in defaults: for isolation-strict.yaml that turned every unknown
    tenant's sensitive session scope off (its requests cached and indexed) and dropped
    every limit, until the next poll. A body of only comments POSTed to /admin/policy did
    the same for good. Refused (the old policy stays); `{}` still asks for the defaults."""
    f = tmp_path / "p.yaml"
    f.write_text(builtin_policy_path("isolation-strict").read_text())
    store = PolicyStore(f)
    strict = store.policy
    assert strict.default_tenant.sensitive.default == "session"
    _touch(f, text)
    with pytest.raises(PolicyError, match="empty"):
        store.reload_file()
    assert store.policy is strict
    with pytest.raises(PolicyError, match="empty"):
        store.reload_text(text or "# nothing")
    assert store.policy is strict
    store.reload_text("{}")  # the defaults, asked for explicitly
    assert store.policy.default_tenant.sensitive.default == "none"


def test_a_rewrite_in_the_same_mtime_tick_as_its_truncation_is_still_reloaded(
    tmp_path: Path,
) -> None:
    """Review: a reload that read the file between its truncation and its rewrite is refused
    (8d76503), but the store kept the truncated file's mtime, and a rewrite in the same
    timestamp tick (Linux stamps files with a coarse clock: `cat new > policy.yaml` is
    microseconds) left it unchanged: the new policy was never applied, until some later
    edit. The file's size (and inode) count as a change too."""
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    tick = f.stat().st_mtime_ns + 1_000_000_000
    f.write_text("")  # truncated: the poll reads it now
    os.utime(f, ns=(tick, tick))
    assert store.changed_on_disk()
    with pytest.raises(PolicyError, match="empty"):
        store.reload_file()
    f.write_text("routing: {strategy: least_loaded}\n")  # rewritten in the same tick
    os.utime(f, ns=(tick, tick))
    assert store.changed_on_disk()
    store.reload_file()
    assert current(store) is Strategy.LEAST_LOADED
    assert not store.changed_on_disk()


@pytest.mark.parametrize(
    "text",
    ["[" * 5000 + "]" * 5000, "routing: " + "{a: " * 3000 + "1" + "}" * 3000],
)
def test_a_deeply_nested_document_is_a_policy_error(text: str) -> None:
    # PyYAML composes recursively: a RecursionError was a traceback at start-up, a 500 from
    # POST /admin/policy, and the end of the file watcher
    with pytest.raises(PolicyError, match="nested too deeply"):
        parse_policy_text(text, "p", allow_empty=False)


def test_a_policy_file_that_is_no_text_is_a_policy_error(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_bytes(b"\xff\xfe\x00routing")
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(f)


async def test_the_watcher_survives_a_reload_that_fails_unexpectedly(tmp_path: Path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    results: list[tuple[bool, str]] = []
    got = asyncio.Event()

    def on_result(ok: bool, err: str) -> None:
        results.append((ok, err))
        got.set()

    def broken(p: object) -> None:
        raise RuntimeError("listener bug")

    store.on_change = broken  # the first reload's listener fails
    store.start(0.05, on_result)
    try:
        _touch(f, "routing: {strategy: random}\n")
        await asyncio.wait_for(got.wait(), 5.0)
        got.clear()
        store.on_change = None
        _touch(f, "routing: {strategy: least_loaded}\n")
        await asyncio.wait_for(got.wait(), 5.0)  # the watcher is still there
    finally:
        await store.stop()
    assert results[0][0] is False and "listener bug" in results[0][1]
    assert results[-1] == (True, "") and store.policy.routing.strategy is Strategy.LEAST_LOADED
