"""Policy validation an operator's file meets (names the gateway can never see)."""

from __future__ import annotations

import asyncio
import logging
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


LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4b9d1c2e0f1a3b5c7d9e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e\n"
    "size 9085657\n"
)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (LFS_POINTER, "Git LFS pointer"),
        ("<!DOCTYPE html><html>rate limited</html>\n", "no JSON object"),
        ("", "no JSON object"),
    ],
)
def test_an_hf_tokenizer_json_that_is_no_json_object_is_refused(
    content: str, problem: str, tmp_path: Path
) -> None:
    """A tokenizer_dir whose tokenizer.json is a Git LFS pointer (a model repo cloned
    without git-lfs) or a saved error page passed the policy check (files present), and
    then `POST /admin/policy` answered `reloaded` while every request got a 500 `internal
    gateway error` (the tokenizer is opened at the first request); at start-up with a
    healthy replica it was a traceback and exit 3. Refused, naming the field."""
    from cachecore.tokenizer import HFTokenizer, export_builtin

    tok_dir = tmp_path / "tok"
    export_builtin(tok_dir)
    text = f"models: {{pools: {{m: {{tokenizer: hf, tokenizer_dir: '{tok_dir}'}}}}}}\n"
    parse_policy_text(text)  # the exported directory is accepted
    (tok_dir / "tokenizer.json").write_text(content)
    # what the gateway met at the first request (the tokenizers library raises Exception)
    with pytest.raises(Exception, match=r"."):
        HFTokenizer.from_dir(tok_dir)
    with pytest.raises(PolicyError, match=problem) as info:
        parse_policy_text(text)
    assert info.value.fields == ["models.pools.m.tokenizer_dir"]
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    with pytest.raises(PolicyError):
        store.reload_text(text)
    assert store.policy.models.pool("m").tokenizer == "builtin"


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(r, "error", ""))
        for r in caplog.records
        if r.levelname == "ERROR" and r.getMessage().startswith("policy reload failed")
    ]


def test_a_refused_admin_reload_is_logged_once_as_a_file_one_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy POSTed to /admin/policy and refused was only the caller's 400: nothing in
    the log (the file watcher's refusals were logged), so an operator auditing the logs
    never saw a rejected change, e.g. another engineer's block size. Both are now logged,
    once each, with the failing field."""
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    with caplog.at_level(logging.ERROR, logger="gateway.policy_store"):
        with pytest.raises(PolicyError):
            store.reload_text("routing: {temperature: -1}", "POST /admin/policy")
        assert len(_refusals(caplog)) == 1
        assert "routing.temperature" in _refusals(caplog)[0]
        f.write_text("routing: {strategy: nonsense}\n")
        with pytest.raises(PolicyError):
            store.reload_file()  # POST with an empty body, and the watcher's read
        assert len(_refusals(caplog)) == 2
        assert "routing.strategy" in _refusals(caplog)[1]


async def test_a_refused_file_reload_by_the_watcher_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    got = asyncio.Event()
    store.start(0.05, lambda ok, err: got.set())
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.policy_store"):
            f.write_text("routing: {strategy: nonsense}\n")
            await asyncio.wait_for(got.wait(), 5.0)
    finally:
        await store.stop()
    assert len(_refusals(caplog)) == 1 and "routing.strategy" in _refusals(caplog)[0]
