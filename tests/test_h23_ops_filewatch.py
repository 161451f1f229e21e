"""The policy and API key file watchers, as an operator's file operations meet them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.filewatch import file_version
from gateway.policy_store import PolicyStore
from gateway.routing import Strategy
from policies.schema import PolicyError


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
