"""A key file whose last line has no newline (a Kubernetes secret made from a literal,
``printf`` without one): read at start-up, so its later versions must reload too. Only a
file modified just now may be a write caught mid-line (ae901c4)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from gateway.auth import KeyFileError, KeyReload, KeyStore, hash_key

pytestmark = pytest.mark.timeout(60)


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def unended(keys: dict[str, str]) -> str:
    """The plain mapping form, no newline after the last line."""
    return "\n".join(f"{hash_key(k)}: {t}" for k, t in keys.items())


async def test_the_watcher_reloads_a_file_without_a_final_newline(tmp_path: Path) -> None:
    """Accepted at start-up, its every change was refused by the watcher ("the last line
    has no end"): a key removed from it was never revoked."""
    f = tmp_path / "keys.yaml"
    write_atomically(f, unended({"sk-a": "acme", "sk-b": "beta"}))
    store = KeyStore(key_file=f)  # start-up takes it
    results: list[tuple[KeyReload | None, str]] = []
    reported = asyncio.Event()

    def on_result(result: KeyReload | None, error: str) -> None:
        results.append((result, error))
        reported.set()

    store.start(0.05, on_result)
    try:
        write_atomically(f, unended({"sk-a": "acme"}))  # sk-b revoked
        async with asyncio.timeout(10.0):
            await reported.wait()
        assert results[0] == (
            KeyReload(keys=1, added=0, removed=1, retenanted=0),
            "",
        ), results
        assert await store.tenant_for("Bearer sk-b") is None
        assert await store.tenant_for("Bearer sk-a") == "acme"
    finally:
        await store.stop()


async def test_an_admin_reload_takes_a_settled_file_without_a_final_newline(
    tmp_path: Path,
) -> None:
    """POST /admin/keys/reload: a file that has kept still for the poll interval is whole;
    one modified just now that ends inside a line is still refused (a tenant name cut
    short could name another tenant)."""
    f = tmp_path / "keys.yaml"
    write_atomically(f, unended({"sk-a": "acme"}))
    store = KeyStore(key_file=f)
    full = unended({"sk-a": "acme", "sk-p": "acme-prod"})
    f.write_text(full[: full.rindex("acme") + 4])  # cut inside its last line, just now
    with pytest.raises(KeyFileError, match="last line"):
        store.reload_file()
    write_atomically(f, full)
    old = time.time() - 10 * store.settle_s
    os.utime(f, (old, old))  # written a while ago
    assert store.reload_file() == KeyReload(keys=2, added=1, removed=0, retenanted=0)
    assert await store.tenant_for("Bearer sk-p") == "acme-prod"
