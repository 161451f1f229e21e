"""A policy file reload that weakens isolation waits for the file to keep still longer
(review S6).

The watcher applied a file once it had changed and kept still for one poll. A writer
that pauses longer than a poll between two parts (`cat > policy.yaml` from a pipe, a
config agent over a slow mount) left a part that parses, and every section is optional:
isolation-strict.yaml cut before `default_tenant:` ran unknown tenants non-sensitive, with
no limits and no cold confinement, until the write ended. Now a file reload that weakens
isolation (``policy_store.isolation_weakenings``) is applied only once the file has kept
still for ``KVGATE_POLICY_WEAKEN_SETTLE_S`` (5 s), logged at WARNING naming what weakens;
one that does not weaken keeps the one-poll rule; ``POST /admin/policy`` applies at once
and logs the same WARNING.

Real pieces: a gateway on loopback with simulated replicas (tests.test_gateway_support's
stack, policy polled every 0.05 s) and a real PolicyStore with its watcher on a tmp file."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

import gateway.policy_store as policy_store
from gateway.policy_store import PolicyStore
from policies.schema import (
    Policy,
    PriorityPolicy,
    QuarantinePolicy,
    SensitivePolicy,
    TenantLimits,
    TenantPolicy,
    builtin_policy_path,
    parse_policy_text,
)
from tests.test_api_keys import wait_until
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)

POLL_S = 0.05
STRICT = builtin_policy_path("isolation-strict").read_text()


def _held(caplog: pytest.LogCaptureFixture) -> list[list[str]]:
    return [
        list(getattr(r, "weakens", []))
        for r in caplog.records
        if r.levelname == "WARNING" and r.getMessage().startswith("policy file weakens")
    ]


def _applied_weakening(caplog: pytest.LogCaptureFixture) -> list[list[str]]:
    return [
        list(getattr(r, "weakens", []))
        for r in caplog.records
        if r.levelname == "WARNING" and r.getMessage() == "policy reload weakens isolation"
    ]


def _replace(path: Path, text: str) -> None:
    """Write beside and rename over: the file changes in one step."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_a_policy_rewritten_in_place_by_a_slow_writer_is_not_applied_half_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The reviewer's repro: isolation-strict rewritten in place, its first part (all
    before `default_tenant:`) written, then a pause of 10 polls. Before, the part was
    applied: an unlisted tenant's session request was keyed in its plain tenant scope and
    its cold traffic unconfined (('tenant', None) during the pause). Now it is held (it
    weakens isolation and has not kept still for 5 s) and logged; the whole file, when
    the write ends, is applied as before."""
    caplog.set_level("WARNING", logger="gateway.policy_store")
    cut = STRICT.index("default_tenant:")
    path = tmp_path / "policy.yaml"
    path.write_text(STRICT)
    async with stack(count=1, policy_file=path) as st:
        gw = st.gw
        body = {"model": st.model, "prompt": words(40, 996), "max_tokens": 1}

        async def state() -> tuple[str, int | None]:
            d = await gw.prepare(
                "completion", "unlisted", dict(body), {"x-kvgate-session": "s1"}, "x", True
            )
            return d.scope.kind.value, gw.policy.default_tenant.limits.cold_replica_count

        before, reloads = await state(), gw.policies.reloads
        with path.open("w") as f:  # rewrite in place: the first part, then a pause
            f.write(STRICT[:cut])
            f.flush()
            await asyncio.sleep(10 * POLL_S)
            during = await state()
            held = _held(caplog)
            f.write(STRICT[cut:])
        await wait_until(lambda: gw.policies.reloads > reloads)
        after = await state()
    assert before == ("session", 2) and after == ("session", 2)
    assert during == ("session", 2), "the half-written file was applied"
    assert len(held) == 1, held  # logged once, naming what it weakens
    assert "default_tenant.sensitive.default: session -> none" in held[0]
    assert "default_tenant.limits.cold_replica_count: 2 -> null" in held[0]
    assert gw.policies.reloads == reloads + 1  # the whole file, not the part
    assert gw.policies.last_error is None
    assert _applied_weakening(caplog) == []


async def test_a_weakening_file_is_applied_once_it_has_kept_still_for_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """KVGATE_POLICY_WEAKEN_SETTLE_S reaches the gateway's store: a file that weakens
    (strict -> the default tenant non-sensitive) is not applied at the one-poll mark,
    and is applied, with a WARNING naming what weakens, once it has kept still for it."""
    caplog.set_level("WARNING", logger="gateway.policy_store")
    settle_s = 1.0
    path = tmp_path / "policy.yaml"
    path.write_text(STRICT)
    loose = STRICT.replace("default: session        #", "default: none        #")
    assert loose != STRICT
    async with stack(count=1, policy_file=path, policy_weaken_settle_s=settle_s) as st:
        gw = st.gw
        assert gw.policies.weaken_settle_s == settle_s
        t0 = time.monotonic()
        _replace(path, loose)
        await wait_until(lambda: len(_held(caplog)) == 1)
        early = time.monotonic() - t0 < settle_s  # not applied before the window, ever
        assert gw.policy.default_tenant.sensitive.default == "session"
        await wait_until(lambda: gw.policy.default_tenant.sensitive.default == "none")
        waited = time.monotonic() - t0
    assert early
    assert waited >= settle_s
    assert _applied_weakening(caplog) == [["default_tenant.sensitive.default: session -> none"]]


async def test_post_admin_policy_applies_a_weakening_at_once_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's POST is an explicit act: applied at once (no settle), with the same
    WARNING naming what it weakens."""
    caplog.set_level("WARNING", logger="gateway.policy_store")
    path = tmp_path / "policy.yaml"
    path.write_text(STRICT)
    async with stack(count=1, policy_file=path) as st, st.http() as h:
        r = await h.post("/admin/policy", content="{}", headers=st.admin_headers())
        assert r.status_code == 200, r.text
        assert st.gw.policy.default_tenant.sensitive.default == "none"
    (weakens,) = _applied_weakening(caplog)
    assert "default_tenant.sensitive.default: session -> none" in weakens
    assert "quarantine.missing_fraction: 0.3 -> 0.5" in weakens
    assert _held(caplog) == []


async def test_a_change_that_does_not_weaken_keeps_the_one_poll_rule(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Tightening (max_concurrency 16 -> 8) and a change outside isolation (routing) are
    applied once the file has kept still for one poll, however long the weakening window:
    no hold, no WARNING."""
    caplog.set_level("WARNING", logger="gateway.policy_store")
    f = tmp_path / "p.yaml"
    f.write_text(STRICT)
    store = PolicyStore(f, weaken_settle_s=30.0)
    results: list[tuple[bool, str]] = []
    store.start(POLL_S, lambda ok, err: results.append((ok, err)))
    try:
        tighter = STRICT.replace("max_concurrency: 16", "max_concurrency: 8")
        _replace(f, tighter.replace("cold_fraction: 0.2", "cold_fraction: 0.3"))
        await wait_until(lambda: len(results) == 1, timeout_s=5.0)
    finally:
        await store.stop()
    assert results == [(True, "")]
    assert store.policy.default_tenant.limits.max_concurrency == 8
    assert store.policy.routing.cold_fraction == 0.3
    assert _held(caplog) == [] and _applied_weakening(caplog) == []


async def test_a_post_drops_a_held_file_and_a_change_supersedes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A held file is not applied after a later POST (the operator's act is the newer
    one: the file is read again when it changes), and a file that changes while held is
    judged afresh (a tightening then applies at the one-poll mark)."""
    caplog.set_level("WARNING", logger="gateway.policy_store")
    settle_s = 0.5
    f = tmp_path / "p.yaml"
    f.write_text(STRICT)
    store = PolicyStore(f, weaken_settle_s=settle_s)
    applied: list[Policy] = []
    store.on_change = applied.append
    store.start(POLL_S, lambda ok, err: None)
    try:
        _replace(f, "{}\n")
        await wait_until(lambda: len(_held(caplog)) == 1)
        await store.reload(STRICT.replace("max_concurrency: 16", "max_concurrency: 4"))
        await asyncio.sleep(settle_s + 6 * POLL_S)
        assert [p.default_tenant.limits.max_concurrency for p in applied] == [4]
        _replace(f, "{}\n# again\n")  # weakening again: held again
        await wait_until(lambda: len(_held(caplog)) == 2)
        _replace(f, STRICT.replace("max_concurrency: 16", "max_concurrency: 2"))
        await wait_until(lambda: len(applied) == 2, timeout_s=5.0)
        await asyncio.sleep(settle_s + 6 * POLL_S)  # the dropped hold applies nothing
    finally:
        await store.stop()
    assert [p.default_tenant.limits.max_concurrency for p in applied] == [4, 2]
    assert _applied_weakening(caplog) == []


async def test_a_held_file_then_refused_from_outside_is_retried_with_backoff(
    tmp_path: Path,
) -> None:
    """A weakening file whose window passes and whose prepare refuses it (a tokenizer
    still being copied) goes to the retry's backoff, reported once; it is applied once
    prepare passes."""
    settle_s = 0.3
    f = tmp_path / "p.yaml"
    f.write_text(STRICT)
    store = PolicyStore(f, weaken_settle_s=settle_s)
    at: list[float] = []
    ready = False

    async def prepare(_pol: Policy) -> list[tuple[str, str]]:
        at.append(time.monotonic())
        return [] if ready else [("models.default.tokenizer_dir", "does not load")]

    store.prepare = prepare
    results: list[tuple[bool, str]] = []
    store.start(POLL_S, lambda ok, err: results.append((ok, err)))
    try:
        t0 = time.monotonic()
        _replace(f, "{}\n")
        await wait_until(lambda: len(at) >= 4, timeout_s=10.0)
        assert at[0] - t0 >= settle_s  # prepared only once the hold is over
        assert len(results) == 1 and not results[0][0]
        ready = True
        await wait_until(lambda: len(results) == 2, timeout_s=10.0)
    finally:
        await store.stop()
    assert results[1] == (True, "")
    assert store.policy.default_tenant.sensitive.default == "none"
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert gaps[1] >= 2 * POLL_S * 0.9, gaps  # backing off, not read at every poll


# ----------------------------------------------------------------- what counts


def _pol(text: str) -> Policy:
    return parse_policy_text(text)


def test_isolation_weakenings_lists_each_weakening() -> None:
    weak = policy_store.isolation_weakenings
    strict = _pol(STRICT)
    assert weak(strict, strict) == []
    assert weak(_pol("{}"), strict) == []  # tightening: nothing
    everything = weak(strict, _pol("{}"))
    for line in (
        "default_tenant.sensitive.default: session -> none",
        "default_tenant.limits.requests_per_s: 20.0 -> null",
        "default_tenant.limits.uncached_tokens_per_s: 50000.0 -> null",
        "default_tenant.limits.max_concurrency: 16 -> null",
        "default_tenant.limits.cold_replica_count: 2 -> null",
        "quarantine.missing_fraction: 0.3 -> 0.5",
        "quarantine.k/m: 2/4 -> 3/5",
        "quarantine.min_claimed_blocks: 1 -> 2",
        "quarantine.recover_after: 5 -> 3",
        "quarantine.max_unverifiable/unverifiable_window: 4/2000 -> 6/1000",
    ):
        assert line in everything, (line, everything)

    base = _pol(
        "tenants:\n"
        "  a: {trust_group: g, sensitive: {default: request, models: [m1, m2],"
        " models_kind: request}, limits: {requests_per_s: 10, requests_burst: 5},"
        " priority: {mode: clamp, min: 0, max: 10}}\n"
        "  b: {trust_group: g}\n"
        "  c: {trust_group: h, limits: {requests_per_s: 10}}\n"
        "trust_groups: {g: [a, b], h: [c]}\n"
    )
    assert weak(base, base) == []

    def diff(text: str) -> list[str]:
        return weak(base, _pol(text))

    # a: default lowered to session; m1 still request through models, m2 dropped
    got = diff(
        "tenants:\n"
        "  a: {trust_group: g, sensitive: {default: session, models: [m1],"
        " models_kind: request}, limits: {requests_per_s: 10, requests_burst: 5},"
        " priority: {mode: clamp, min: 0, max: 10}}\n"
        "  b: {trust_group: g}\n"
        "  c: {trust_group: h, limits: {requests_per_s: 10}}\n"
        "trust_groups: {g: [a, b], h: [c]}\n"
    )
    assert got == [
        "tenants.a.sensitive.default: request -> session",
        "tenants.a.sensitive.models: 'm2' request -> session",
    ]
    # a's burst raised by dropping it (max(rate, 1) = 10 > 5), a's priority widened,
    # c joins g: a, b and c each share with a tenant they did not
    got = diff(
        "tenants:\n"
        "  a: {trust_group: g, sensitive: {default: request, models: [m1, m2],"
        " models_kind: request}, limits: {requests_per_s: 10},"
        " priority: {mode: clamp, min: -5, max: 10}}\n"
        "  b: {trust_group: g}\n"
        "  c: {trust_group: g, limits: {requests_per_s: 10}}\n"
        "trust_groups: {g: [a, b, c]}\n"
    )
    assert got == [
        "tenants.a.limits.requests_burst: 5.0 -> 10.0",
        "tenants.a.priority: clamp [0, 10] -> clamp [-5, 10]",
        "tenants.a.trust_group: 'g' shares its scope with c",
        "tenants.b.trust_group: 'g' shares its scope with c",
        "tenants.c.trust_group: 'g' shares its scope with a, b",
    ]
    # a dropped from tenants: compared with the default tenant it becomes
    got = diff("tenants:\n  b: {}\n  c: {limits: {requests_per_s: 10}}\ntrust_groups: {}\n")
    assert "tenants.a.sensitive.default: request -> none" in got
    assert "tenants.a.limits.requests_per_s: 10.0 -> null" in got
    assert not any("trust_group" in line for line in got)  # leaving a group shares less
    # a renamed group with the same members shares with nobody new; passthrough priority
    got = weak(
        _pol("tenants: {a: {trust_group: g}, b: {trust_group: g}}\ntrust_groups: {g: [a, b]}"),
        _pol(
            "tenants: {a: {trust_group: k, priority: {mode: passthrough}}, b: {trust_group: k}}\n"
            "trust_groups: {k: [a, b]}"
        ),
    )
    assert got == ["tenants.a.priority: strip -> passthrough"]
    # allow_header only ever tightens a request's scope: not a weakening either way
    on = _pol("default_tenant: {sensitive: {allow_header: true}}")
    assert weak(_pol("{}"), on) == [] and weak(on, _pol("{}")) == []
    # quarantine off, its unverifiable track off
    assert weak(_pol("{}"), _pol("quarantine: {enabled: false, max_unverifiable: 0}")) == [
        "quarantine.enabled: true -> false",
        "quarantine.max_unverifiable/unverifiable_window: 6/1000 -> 0/1000",
    ]

    # k of m: a longer run (k raised) or a higher rate (k/m raised) passes; a lower k with
    # a lower rate does not, though m is lower
    def km(k: int, m: int) -> Policy:
        return _pol(f"quarantine: {{k: {k}, m: {m}}}")

    assert weak(km(3, 5), km(2, 4)) == []
    assert weak(km(3, 5), km(4, 10)) == ["quarantine.k/m: 3/5 -> 4/10"]
    assert weak(km(10, 100), km(9, 50)) == ["quarantine.k/m: 10/100 -> 9/50"]
    # routing, costs and the rest are not isolation
    assert weak(strict, _pol(STRICT.replace("cold_fraction: 0.2", "cold_fraction: 0.9"))) == []


def test_every_isolation_field_is_placed() -> None:
    """A field added to an isolation section must be placed in isolation_weakenings (a
    weakening, or stated not to be one): this list is what its docstring covers."""
    placed: dict[type[BaseModel], set[str]] = {
        Policy: {
            "version",
            "routing",
            "cost",
            "index",
            "models",
            "default_tenant",
            "tenants",
            "trust_groups",
            "quarantine",
            "health",
            "precision",
        },
        TenantPolicy: {"trust_group", "sensitive", "limits", "priority"},
        SensitivePolicy: {"default", "allow_header", "models", "models_kind"},
        TenantLimits: {
            "requests_per_s",
            "requests_burst",
            "max_concurrency",
            "uncached_tokens_per_s",
            "uncached_tokens_burst",
            "cold_replica_count",
        },
        PriorityPolicy: {"mode", "value", "min", "max"},
        QuarantinePolicy: {
            "enabled",
            "missing_fraction",
            "k",
            "m",
            "min_claimed_blocks",
            "recover_after",
            "recover_after_max",
            "forgive_after",
            "settle_s",
            "clock_skew_ms",
            "tamper_margin_ms",
            "max_unverifiable",
            "unverifiable_window",
        },
    }
    for cls, fields in placed.items():
        assert set(cls.model_fields) == fields, cls.__name__


def test_a_group_name_given_to_others_and_a_lower_media_charge_are_weakenings() -> None:
    """A trust group's cache scope is its name: a tenant put in a group that others held
    reads their cache (c served 384 cached tokens of a's prompt after such a reload, no
    WARNING); and media_part_tokens is what each media part costs against every tenant's
    uncached-token budget (a file cut before `models:` lowered it at one poll). Review 5,
    W1 and W2."""
    weak = policy_store.isolation_weakenings
    old = _pol(
        "trust_groups: {g: [a, b]}\ntenants: {a: {trust_group: g}, b: {trust_group: g}, c: {}}"
    )
    new = _pol("trust_groups: {g: [c]}\ntenants: {a: {}, b: {}, c: {trust_group: g}}")
    assert weak(old, new) == ["tenants.c.trust_group: 'g' shares its scope with a, b"]
    assert weak(new, new) == []
    media = _pol(
        "models: {default: {media_part_tokens: 4096}, pools: {m: {media_part_tokens: 64}}}"
    )
    # m's pool gone: its models fall back to the default's 1024, a higher charge
    assert weak(media, _pol("{}")) == ["models.default.media_part_tokens: 4096 -> 1024"]
    assert weak(_pol("{}"), media) == ["models.pools.m.media_part_tokens: 1024 -> 64"]
