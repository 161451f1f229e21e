"""loadtest.peers.ensure_peer keeps only a venv holding the verified set of a peer: the
pinned release (docs/peers.md's versions) and the exact dependency versions in
loadtest/peer-constraints/<peer>.txt. A venv made before the pins, by hand, or on a day PyPI
had newer dependencies may hold another release of the router or of fastapi/uvicorn/...,
that starts and answers `--help` alike; it must be brought to the set, or skipped with the
reason, never run. The venvs here are real (``python -m venv``); the distributions in them
are stand-ins with the peer's names, versions and module (dist-info directories, or wheels
built here and installed by pip from a local directory), so no test reaches PyPI."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loadtest.peers import (
    PACKAGES,
    constraints_file,
    ensure_peer,
    installed_distributions,
    lock,
    pinned_version,
    read_constraints,
)

NAME = "sglang-router"
PINNED = pinned_version(NAME)
VERIFIED = read_constraints(constraints_file(NAME))  # the committed set


def _dist_infos(venv: Path) -> list[str]:
    return sorted(p.name for p in venv.glob("lib/python3*/site-packages/sglang_router-*"))


def _stand_in_venv(venv: Path, dists: dict[str, str]) -> None:
    """A venv (without pip) whose ``sglang_router.launch_router`` imports (the harness's
    probe) and whose metadata lists ``dists`` (name -> version)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "sglang_router").mkdir()
    (site / "sglang_router" / "__init__.py").write_text("")
    (site / "sglang_router" / "launch_router.py").write_text("")
    for dist, version in dists.items():
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")


def test_the_committed_sets_pin_the_routers_the_harness_installs() -> None:
    for name in PACKAGES:
        verified = read_constraints(constraints_file(name))
        assert verified[name] == pinned_version(name), name
        assert {"fastapi", "uvicorn", "pydantic"} <= verified.keys(), name  # deps, not only it
        assert not {"pip", "setuptools", "kvgate"} & verified.keys(), name


def test_the_verified_set_is_kept(tmp_path: Path) -> None:
    _stand_in_venv(tmp_path / NAME, VERIFIED)
    st = ensure_peer(NAME, tmp_path, install=False)
    assert st.ok, st.message
    assert st.message == f"installed ({NAME} {PINNED}, verified set)"


def test_the_pinned_router_alone_is_not_the_verified_set(tmp_path: Path) -> None:
    """Before the constraint files, a venv holding the pinned router was kept whatever
    its dependencies were."""
    _stand_in_venv(tmp_path / NAME, {NAME: PINNED})
    st = ensure_peer(NAME, tmp_path, install=False)
    assert not st.ok
    assert "differs from the verified set" in st.message
    missing = sorted(VERIFIED.keys() - {NAME})
    assert f"{missing[0]} missing (verified {VERIFIED[missing[0]]})" in st.message
    assert f" and {len(missing) - 4} more (--no-install)" in st.message


def test_a_dependency_at_another_release_is_not_run_without_install(tmp_path: Path) -> None:
    """fastapi came in at whatever PyPI had that day: 0.166.0 is not the verified one."""
    _stand_in_venv(tmp_path / NAME, {**VERIFIED, "fastapi": "0.166.0", "rich": "14.0.0"})
    st = ensure_peer(NAME, tmp_path, install=False)
    assert not st.ok
    assert st.message == (
        f"skipped: {tmp_path / NAME} differs from the verified set {constraints_file(NAME)}: "
        f"fastapi 0.166.0 (verified {VERIFIED['fastapi']}), rich 14.0.0 (not in the verified "
        "set) (--no-install)"
    )


def test_another_release_is_not_run_without_install(tmp_path: Path) -> None:
    _stand_in_venv(tmp_path / NAME, {**VERIFIED, NAME: "0.0.1"})
    st = ensure_peer(NAME, tmp_path, install=False)
    assert not st.ok
    assert st.message.startswith("skipped: ")
    assert f"holds {NAME} 0.0.1, not the pinned {PINNED}" in st.message


def test_a_set_that_does_not_pin_the_router_skips_the_peer(tmp_path: Path) -> None:
    """A constraints file left at another router release than PACKAGES': pip would refuse
    the pair; the peer is skipped with the command that writes the set, before any pip."""
    (tmp_path / "c").mkdir()
    constraints_file(NAME, tmp_path / "c").write_text(f"{NAME}==0.0.1\nfastapi==0.165.0\n")
    st = ensure_peer(NAME, tmp_path, install=True, constraints_dir=tmp_path / "c")
    assert not st.ok
    assert f"pins {NAME} 0.0.1, not {PINNED}" in st.message
    assert f"python -m loadtest.peers lock {NAME} --upgrade" in st.message
    assert not (tmp_path / NAME).exists()


def test_another_release_is_reinstalled_and_a_failed_install_skips_the_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With install: pip is asked for the pinned release under the verified set; here pip
    has no index (as on a machine without PyPI), so the install fails and the peer is
    skipped with pip's own reason and the log's path."""
    _stand_in_venv(tmp_path / NAME, {NAME: "0.0.1"})
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # this machine's extra indexes
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    st = ensure_peer(NAME, tmp_path, install=True)
    assert not st.ok
    assert st.message.startswith("skipped: install failed (")
    assert f"-c {constraints_file(NAME)} {PACKAGES[NAME]}" in st.message
    assert f"Cannot install {PACKAGES[NAME]}" in st.message  # pip's words under -c
    assert str(tmp_path / f"{NAME}-install.log") in st.message
    assert _dist_infos(tmp_path / NAME) == ["sglang_router-0.0.1.dist-info"]  # pip did nothing


# ------------------------------------------------- real pip installs from local wheels


def _wheel(dest: Path, dist: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A pure-Python wheel of ``dist`` (the router's holds ``sglang_router.launch_router``)."""
    stem = dist.replace("-", "_")
    info = f"{stem}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{info}/METADATA": meta,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files.update({f"{stem}/__init__.py": "", f"{stem}/launch_router.py": ""})
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(dest / f"{stem}-{version}-py3-none-any.whl", "w") as zf:
        for f, text in files.items():
            zf.writestr(f, text)


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only wheels built here: the router (requiring ``standin-dep``), that dep
    at 1.0 (the verified release) and 2.0 (what "PyPI" has today), and an unrelated one."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, NAME, PINNED, requires=("standin-dep",))
    _wheel(wheels, "standin-dep", "1.0")
    _wheel(wheels, "standin-dep", "2.0")
    _wheel(wheels, "standin-extra", "1.0")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    return wheels


def test_a_venv_with_a_moved_dependency_is_brought_to_the_verified_set(
    tmp_path: Path, local_index: Path
) -> None:
    """A venv installed unpinned (standin-dep 2.0) plus a hand install: the pinned router
    is there, yet the harness reinstalls under the set (standin-dep back to 1.0) and
    removes what the set does not hold."""
    (tmp_path / "c").mkdir()
    verified = {NAME: PINNED, "standin-dep": "1.0"}
    constraints_file(NAME, tmp_path / "c").write_text(
        "".join(f"{d}=={v}\n" for d, v in verified.items())
    )
    venv = tmp_path / "peers" / NAME
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "--quiet"]
    subprocess.run([*pip, PACKAGES[NAME], "standin-extra"], check=True)
    assert installed_distributions(venv) == {
        **verified,
        "standin-dep": "2.0",
        "standin-extra": "1.0",
    }

    st = ensure_peer(NAME, tmp_path / "peers", install=False, constraints_dir=tmp_path / "c")
    assert not st.ok
    assert "standin-dep 2.0 (verified 1.0), standin-extra 1.0 (not in the verified set)" in (
        st.message
    )

    st = ensure_peer(NAME, tmp_path / "peers", install=True, constraints_dir=tmp_path / "c")
    assert st.ok, st.message
    assert st.message == f"installed now ({NAME} {PINNED}, verified set)"
    assert installed_distributions(venv) == verified
    st = ensure_peer(NAME, tmp_path / "peers", install=False, constraints_dir=tmp_path / "c")
    assert st.message == f"installed ({NAME} {PINNED}, verified set)"


def test_lock_upgrade_writes_the_set_pip_resolves_today(tmp_path: Path, local_index: Path) -> None:
    """How the pins move: `python -m loadtest.peers lock NAME --upgrade` makes the venv anew
    with the pinned router and today's dependencies (standin-dep 2.0; the hand-installed
    extra is gone) and writes them; the harness then keeps that venv."""
    peers, cdir = tmp_path / "peers", tmp_path / "c"
    venv = peers / NAME
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "standin-extra"], check=True)
    path = lock(NAME, peers, cdir, upgrade=True)
    assert path == constraints_file(NAME, cdir)
    assert read_constraints(path) == {NAME: PINNED, "standin-dep": "2.0"}
    assert path.read_text().startswith(f"# {NAME}'s verified set: `pip freeze` of .peers/{NAME}")
    assert ensure_peer(NAME, peers, install=False, constraints_dir=cdir).ok


def test_lock_refuses_a_venv_without_the_pinned_router(tmp_path: Path) -> None:
    _stand_in_venv(tmp_path / NAME, {NAME: "0.0.1"})
    with pytest.raises(RuntimeError, match=f"holds {NAME} 0.0.1, not the pinned {PINNED}"):
        lock(NAME, tmp_path, tmp_path / "c")
    assert not (tmp_path / "c").exists()
