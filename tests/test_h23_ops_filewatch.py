"""The policy and API key file watchers, as an operator's file operations meet them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gateway.auth import KeyFileError, KeyStore, hash_key
from gateway.filewatch import FileVersion, file_version
from gateway.policy_store import PolicyStore
from gateway.routing import Strategy
from policies.schema import Policy, PolicyError, builtin_policy_path, parse_policy_text


def test_a_permission_fix_alone_is_a_change(tmp_path: Path) -> None:
    """A policy file installed unreadable (`install -m 600` as another user) is refused
    with `cannot read: Permission denied`, and the watcher records that version as seen.
    The operator's fix, `chmod 644` (or `chown`), changes neither mtime, size nor inode:
    the file was never read again, the old policy stayed in force and `last_error` kept
    the permission error until some later edit. The ctime moves on a mode change."""
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = PolicyStore(f)
    f.write_text("routing: {strategy: least_loaded}\n")
    f.chmod(0o000)
    if os.geteuid() != 0:  # root reads it anyway; elsewhere the refusal itself is checked
        with pytest.raises(PolicyError, match="cannot read"):
            store.reload_file()
        assert store.policy.routing.strategy is Strategy.ROUND_ROBIN
    else:
        store.reload_file()
    assert not store.changed_on_disk()
    before = file_version(f)
    f.chmod(0o644)  # the fix: content, mtime, size and inode unchanged
    assert file_version(f) != before
    assert store.changed_on_disk()
    store.reload_file()
    assert store.policy.routing.strategy is Strategy.LEAST_LOADED
    assert store.last_error is None


def test_an_api_key_file_whose_permissions_are_fixed_is_read_again(tmp_path: Path) -> None:
    """The key file watcher shares the version: a key file refused as unreadable, then
    fixed by chmod alone, is read again at the watcher's looks (it changed, then kept
    still), where before its version never moved and the new keys never came in."""
    f = tmp_path / "keys.yaml"
    f.write_text(f"keys:\n  - {{sha256: {hash_key('sk-old')}, tenant: acme}}\n")
    store = KeyStore(key_file=f)
    f.write_text(f"keys:\n  - {{sha256: {hash_key('sk-new')}, tenant: acme}}\n")
    f.chmod(0o000)
    if os.geteuid() != 0:  # root reads it anyway
        with pytest.raises(KeyFileError):
            store.reload_file()
    else:
        store.reload_file()
    reloads = store.reloads
    assert store.poll_file() is None  # nothing changed since that read
    f.chmod(0o644)
    assert store.poll_file() is None  # changed: seen, and read once it keeps still
    assert store.poll_file() is not None
    assert store.reloads == reloads + 1


class _LookingStore(PolicyStore):
    """A PolicyStore that says when its watcher has looked at the file (``armed`` on)."""

    def __init__(self, path: Path) -> None:
        self.armed = False  # before the start-up read, which stats the file too
        self.looked = asyncio.Event()
        super().__init__(path)

    def _stat(self) -> FileVersion | None:
        version = super()._stat()
        if self.armed:
            self.looked.set()
        return version


async def test_a_policy_written_in_parts_is_not_applied_half_written(tmp_path: Path) -> None:
    """A policy file written in parts (an editor's save, `cat` from a pipe, a copy in
    chunks) was reloaded at the first look that found it changed: a part that parses was
    applied. Rewriting isolation-strict.yaml cut after its `cost:` section ran every
    unknown tenant with no sensitive scope and no limits until the next poll (live: 0.9 s
    into a two-part write, `GET /admin/policy` showed sensitive `none`, max_concurrency
    null). It is now applied once it has kept still for a poll interval."""
    strict = builtin_policy_path("isolation-strict").read_text()
    new = strict.replace("max_concurrency: 16", "max_concurrency: 8")
    assert new != strict
    lines = new.splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if line.startswith("default_tenant:"))
    first = "".join(lines[:cut])
    parse_policy_text(first, "first part", allow_empty=False)  # a part that parses
    f = tmp_path / "p.yaml"
    f.write_text(strict)
    store = _LookingStore(f)
    applied: list[Policy] = []
    store.on_change = applied.append
    results: list[tuple[bool, str]] = []
    done = asyncio.Event()

    def on_result(ok: bool, err: str) -> None:
        results.append((ok, err))
        done.set()

    store.start(0.05, on_result)
    try:
        with f.open("w") as out:
            out.write(first)
            out.flush()
            store.armed = True
            # the watcher looks at the half-written file (its look and any reload run in
            # one step of the loop, before this coroutine resumes)
            await asyncio.wait_for(store.looked.wait(), 5.0)
            store.armed = False
            out.write("".join(lines[cut:]))
        await asyncio.wait_for(done.wait(), 5.0)
    finally:
        await store.stop()
    assert results[0] == (True, "")
    assert [p.default_tenant.limits.max_concurrency for p in applied] == [8]
    assert store.policy.default_tenant.sensitive.default == "session"


async def test_a_deleted_policy_file_is_reported_once_and_its_return_loaded(
    tmp_path: Path,
) -> None:
    """A policy file deleted (not replaced) was ignored without a word: `GET /admin/policy`
    showed no error, no log line, no `outcome="invalid"` count, while the next restart
    of the gateway would fail on the missing file. Now, once it has been gone for a poll,
    it is reported once as a reload that cannot read it (the old policy stays), and the
    file's return is loaded."""
    f = tmp_path / "p.yaml"
    f.write_text("routing: {strategy: round_robin}\n")
    store = _LookingStore(f)
    results: list[tuple[bool, str]] = []
    got = asyncio.Event()

    def on_result(ok: bool, err: str) -> None:
        results.append((ok, err))
        got.set()

    async def looks(n: int) -> None:
        for _ in range(n):  # bounded: n looks, 5 s each at most
            store.looked.clear()
            store.armed = True
            await asyncio.wait_for(store.looked.wait(), 5.0)
        store.armed = False

    store.start(0.05, on_result)
    try:
        f.unlink()
        await asyncio.wait_for(got.wait(), 5.0)
        assert len(results) == 1 and not results[0][0]
        assert "No such file" in results[0][1]
        assert store.last_error and "No such file" in store.last_error
        assert store.policy.routing.strategy is Strategy.ROUND_ROBIN
        await looks(3)  # still gone: not reported again
        assert len(results) == 1
        got.clear()
        f.write_text("routing: {strategy: least_loaded}\n")
        await asyncio.wait_for(got.wait(), 5.0)
    finally:
        await store.stop()
    assert results[-1] == (True, "")
    assert store.policy.routing.strategy.value == "least_loaded"
    assert store.last_error is None
