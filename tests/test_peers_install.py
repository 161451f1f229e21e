"""loadtest.peers.ensure_peer keeps only the pinned release of a peer (docs/peers.md's
versions). A venv made before the pin, or by hand, may hold another release that starts
and answers `--help` alike; it must be replaced, or skipped with the reason, never run.
The venvs here are real (``python -m venv``); the distribution in them is a stand-in with
the peer's name, version and module, so no test reaches PyPI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.peers import PACKAGES, ensure_peer

NAME = "sglang-router"
PINNED = PACKAGES[NAME].partition("==")[2]


def _dist_infos(venv: Path) -> list[str]:
    return sorted(p.name for p in venv.glob("lib/python3*/site-packages/sglang_router-*"))


def _stand_in_venv(venv: Path, version: str) -> None:
    """A venv whose ``sglang_router.launch_router`` imports (the harness's probe) and whose
    metadata says ``sglang-router VERSION``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "sglang_router").mkdir()
    (site / "sglang_router" / "__init__.py").write_text("")
    (site / "sglang_router" / "launch_router.py").write_text("")
    dist = site / f"sglang_router-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n")


def test_the_pinned_release_is_kept(tmp_path: Path) -> None:
    _stand_in_venv(tmp_path / NAME, PINNED)
    st = ensure_peer(NAME, tmp_path, install=False)
    assert st.ok, st.message
    assert st.message == f"installed ({NAME} {PINNED})"


def test_another_release_is_not_run_without_install(tmp_path: Path) -> None:
    _stand_in_venv(tmp_path / NAME, "0.0.1")
    st = ensure_peer(NAME, tmp_path, install=False)
    assert not st.ok
    assert st.message.startswith("skipped: ")
    assert f"holds {NAME} 0.0.1, not the pinned {PINNED}" in st.message


def test_another_release_is_reinstalled_and_a_failed_install_skips_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With install: pip is asked for the pinned release over the other one; here pip has
    no index (as on a machine without PyPI), so the install fails and the peer is skipped
    with pip's own reason and the log's path."""
    _stand_in_venv(tmp_path / NAME, "0.0.1")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # this machine's extra indexes
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    st = ensure_peer(NAME, tmp_path, install=True)
    assert not st.ok
    assert st.message.startswith("skipped: install failed (")
    assert f"No matching distribution found for {PACKAGES[NAME]}" in st.message
    assert str(tmp_path / f"{NAME}-install.log") in st.message
    assert _dist_infos(tmp_path / NAME) == ["sglang_router-0.0.1.dist-info"]  # pip did nothing
