"""The peer routers of ``kvgate bench routers``: vllm-router and sglang-router from PyPI, each
in its own venv under ``.peers/`` (gitignored), and the built-in tokenizer exported as an HF
directory they can load (docs/peers.md has the same commands by hand).

Each venv holds the verified set: the pinned router and the exact versions of its
dependencies in ``loadtest/peer-constraints/<peer>.txt`` (``pip freeze`` of the venvs the
comparison was made with; ``python -m loadtest.peers lock`` writes them). Without it a
router's dependencies came in at whatever PyPI had on the day of the install.

:func:`ensure_peers` is idempotent (a working venv holding exactly the verified set is kept;
any other is brought to it) and never raises: a failed install is reported as a
:class:`PeerStatus` with the reason, and the benchmark skips that peer.
:func:`router_command` builds the command line of one peer system and
:func:`running_router` runs it until the block ends.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachecore.replica.settings import ReplicaEndpoints
from cachecore.tokenizer import export_builtin

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / ".peers"
CONSTRAINTS_DIR = ROOT / "loadtest" / "peer-constraints"
INSTALL_TIMEOUT_S = 900.0
PROBE_TIMEOUT_S = 30.0
BLOCK_SIZE = 16
# The replicas must publish KV events under vLLM's default topic "" for vllm-router
# kv_aware: a static --kv-event-source subscribes with topic "" and then drops every frame
# whose topic frame is not exactly that (its src/config/mod.rs, src/kv_index/subscriber.rs).
EVENTS_TOPIC = ""

# peer name -> PyPI package (its venv is .peers/<name>)
# the versions docs/peers.md was verified with (their flags, event topics and routing): an
# unpinned install took whatever PyPI had that day, and a release that renamed a flag would
# have made a peer "misconfigured" in one run and not in the last
PACKAGES: dict[str, str] = {
    "vllm-router": "vllm-router==0.1.17",
    "sglang-router": "sglang-router==0.3.2",
}
# what `pip freeze` leaves out too: the venv's own tooling, not the router's dependencies
TOOLING = frozenset({"pip", "setuptools", "wheel", "distribute"})


@dataclass(frozen=True, slots=True)
class PeerStatus:
    name: str
    ok: bool
    message: str
    venv: Path


def _probe_cmd(name: str, venv: Path) -> list[str]:
    if name == "vllm-router":
        return [str(venv / "bin" / "vllm-router"), "--help"]
    return [str(venv / "bin" / "python"), "-c", "import sglang_router.launch_router"]


def _works(cmd: Sequence[str]) -> bool:
    if not Path(cmd[0]).exists():
        return False
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def pinned_version(name: str) -> str:
    return PACKAGES[name].partition("==")[2]


def constraints_file(name: str, constraints_dir: Path = CONSTRAINTS_DIR) -> Path:
    return constraints_dir / f"{name}.txt"


def _canonical(dist: str) -> str:
    """PEP 503 name: ``pydantic_core`` and ``Pydantic-Core`` are one distribution."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def read_constraints(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file (comments and blanks skipped)."""
    out: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.partition("#")[0].strip()
        if not line:
            continue
        dist, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{path}: {raw!r} is not NAME==VERSION")
        out[_canonical(dist.strip())] = version.strip()
    return out


def installed_distributions(venv: Path) -> dict[str, str] | None:
    """Every distribution in ``venv`` but its tooling (pip, setuptools), by canonical name
    (None: no venv, or its python does not run). One interpreter start, ~40 ms; isolated
    (``-I``), else the working directory's ``kvgate.egg-info`` is listed too."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = (
        "import importlib.metadata as m\n"
        "for d in m.distributions(): print(d.metadata['Name'], d.version, sep='==')"
    )
    try:
        done = subprocess.run(
            [str(python), "-I", "-c", code],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    out: dict[str, str] = {}
    for line in done.stdout.splitlines():
        dist, _, version = line.partition("==")
        if dist and _canonical(dist) not in TOOLING:
            out[_canonical(dist)] = version
    return out


def set_differences(want: dict[str, str], have: dict[str, str]) -> list[str]:
    """What ``have`` changes of ``want``, other releases first: ``fastapi 0.166.0 (verified
    0.165.0)``, ``rich 14.0 (not in the verified set)``, ``idna missing (verified 3.21)``."""
    both = sorted(d for d in want.keys() & have.keys() if have[d] != want[d])
    return [
        *(f"{d} {have[d]} (verified {want[d]})" for d in both),
        *(f"{d} {have[d]} (not in the verified set)" for d in sorted(have.keys() - want.keys())),
        *(f"{d} missing (verified {want[d]})" for d in sorted(want.keys() - have.keys())),
    ]


def _summary(diffs: Sequence[str], limit: int = 4) -> str:
    more = f" and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more


def _python311() -> str:
    return shutil.which("python3.11") or sys.executable


def _run_logged(cmd: Sequence[str], log: Path) -> tuple[bool, str]:
    try:
        with log.open("ab") as fh:
            done = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S, check=False
            )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{' '.join(cmd[:3])} ...: {exc}"
    if done.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return False, f"`{' '.join(cmd)}` exited {done.returncode}: {' / '.join(tail)}"
    return True, ""


def _verified_set(name: str, constraints_dir: Path) -> tuple[dict[str, str] | None, str]:
    """The verified set of peer ``name`` (None and why where its file is missing or does not
    pin the router at ``PACKAGES``' version: pip would refuse, or install an unverified set)."""
    path = constraints_file(name, constraints_dir)
    relock = f"python -m loadtest.peers lock {name}"
    try:
        want = read_constraints(path)
    except (OSError, ValueError) as exc:
        return None, f"no verified set: {exc} (`{relock}`, docs/peers.md)"
    if want.get(_canonical(name)) != pinned_version(name):
        why = f"{path} pins {name} {want.get(_canonical(name))}, not {pinned_version(name)}"
        return None, f"{why} (`{relock} --upgrade`, docs/peers.md)"
    return want, ""


def ensure_peer(
    name: str,
    peers_dir: Path = PEERS_DIR,
    install: bool = True,
    constraints_dir: Path = CONSTRAINTS_DIR,
) -> PeerStatus:
    """A working venv for peer ``name`` holding exactly its verified set (the pinned router
    and ``loadtest/peer-constraints/NAME.txt``): kept if it does (one ``importlib.metadata``
    listing and the probe per bench start), else (with ``install``) ``python3.11 -m venv
    .peers/NAME && .peers/NAME/bin/pip install -c FILE NAME==VERSION``, then what the set
    does not hold is uninstalled. A venv made before the pins, by hand, or by an older set
    may hold other releases, whose flags and routing docs/peers.md did not verify: it is
    brought to the set, never run as it is."""
    venv = peers_dir / name
    want, why = _verified_set(name, constraints_dir)
    if want is None:
        return PeerStatus(name, False, f"skipped: {why}", venv)
    probe = _probe_cmd(name, venv)
    pin = pinned_version(name)
    have = installed_distributions(venv)
    diffs = set_differences(want, have) if have is not None else []
    if have is not None and not diffs and _works(probe):
        return PeerStatus(name, True, f"installed ({name} {pin}, verified set)", venv)
    if not install:
        why = f"not installed under {venv}"
        router = (have or {}).get(_canonical(name))
        if router is not None and router != pin:
            why = f"{venv} holds {name} {router}, not the pinned {pin} (docs/peers.md)"
        elif router is not None and diffs:
            file = constraints_file(name, constraints_dir)
            why = f"{venv} differs from the verified set {file}: {_summary(diffs)}"
        elif router is not None:
            why = f"{venv} holds the verified set but `{probe[0]}` does not run"
        return PeerStatus(name, False, f"skipped: {why} (--no-install)", venv)
    peers_dir.mkdir(parents=True, exist_ok=True)
    log = peers_dir / f"{name}-install.log"
    pip = str(venv / "bin" / "pip")
    steps = [
        [_python311(), "-m", "venv", str(venv)],
        [
            pip,
            "install",
            "--quiet",
            "-c",
            str(constraints_file(name, constraints_dir)),
            PACKAGES[name],
        ],
    ]
    for cmd in steps:
        ok, why = _run_logged(cmd, log)
        if not ok:
            return PeerStatus(name, False, f"skipped: install failed ({why}); log {log}", venv)
    # pip leaves what the set does not hold (a dependency of an older release, a hand
    # install); the set is closed under the router's requirements, so none of it is needed
    extra = sorted((installed_distributions(venv) or {}).keys() - want.keys())
    if extra:
        ok, why = _run_logged([pip, "uninstall", "--quiet", "-y", *extra], log)
        if not ok:
            return PeerStatus(name, False, f"skipped: uninstall failed ({why}); log {log}", venv)
    have = installed_distributions(venv)
    diffs = set_differences(want, have) if have is not None else ["no python in the venv"]
    if diffs:
        why = f"installed {PACKAGES[name]} but the venv differs from its set: {_summary(diffs)}"
        return PeerStatus(name, False, f"skipped: {why}; log {log}", venv)
    if not _works(probe):
        return PeerStatus(name, False, f"skipped: installed but `{probe[0]}` does not run", venv)
    return PeerStatus(name, True, f"installed now ({name} {pin}, verified set)", venv)


def lock(
    name: str,
    peers_dir: Path = PEERS_DIR,
    constraints_dir: Path = CONSTRAINTS_DIR,
    upgrade: bool = False,
) -> Path:
    """Write peer ``name``'s verified set from ``.peers/NAME`` (what `pip freeze` would list
    there) to ``loadtest/peer-constraints/NAME.txt``. With ``upgrade``, the venv is first
    made anew with ``NAME==PIN`` and its dependencies as PyPI has them today (how the pins
    move: verify that venv, then commit the file). Raises RuntimeError where the venv does
    not hold the pinned router."""
    venv = peers_dir / name
    if upgrade:
        peers_dir.mkdir(parents=True, exist_ok=True)
        log = peers_dir / f"{name}-install.log"
        for cmd in (
            [_python311(), "-m", "venv", "--clear", str(venv)],
            [str(venv / "bin" / "pip"), "install", "--quiet", PACKAGES[name]],
        ):
            ok, why = _run_logged(cmd, log)
            if not ok:
                raise RuntimeError(f"{name}: {why}; log {log}")
    have = installed_distributions(venv)
    pin = pinned_version(name)
    if have is None or have.get(_canonical(name)) != pin:
        found = None if have is None else have.get(_canonical(name))
        raise RuntimeError(f"{venv} holds {name} {found}, not the pinned {pin}")
    python = subprocess.run(
        [str(venv / "bin" / "python"), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = constraints_file(name, constraints_dir)
    head = (
        f"# {name}'s verified set: `pip freeze` of .peers/{name} ({python}), without pip and\n"
        f"# setuptools. Written by `python -m loadtest.peers lock {name}`; move it with\n"
        "# `--upgrade` (docs/peers.md). A venv holding anything else is reinstalled.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + "".join(f"{d}=={v}\n" for d, v in sorted(have.items())))
    return path


def ensure_tokenizer(peers_dir: Path = PEERS_DIR) -> Path:
    """The built-in tokenizer as an HF dir (``kvgate tokenizer --export .peers/tokenizer``)."""
    out = peers_dir / "tokenizer"
    if not (out / "tokenizer.json").exists():
        export_builtin(out)
    return out


def ensure_peers(
    names: Sequence[str], peers_dir: Path = PEERS_DIR, install: bool = True
) -> dict[str, PeerStatus]:
    return {n: ensure_peer(n, peers_dir, install) for n in names}


# ------------------------------------------------------------------------ running them


def router_command(
    peer: str,
    policy: str,
    venv: Path,
    port: int,
    prometheus_port: int,
    endpoints: Sequence[ReplicaEndpoints],
    tokenizer_dir: Path,
    model: str,
) -> tuple[list[str], dict[str, str]]:
    """Command line and extra environment of one peer system (flags from docs/peers.md;
    each router gets its own Prometheus port, both default to 29000)."""
    urls = [e.url for e in endpoints]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
    common += ["--policy", policy, "--prometheus-port", str(prometheus_port)]
    if peer == "vllm-router":
        cmd = [str(venv / "bin" / "vllm-router"), *common]
        env: dict[str, str] = {}
        if policy == "kv_aware":
            for e in endpoints:
                cmd += ["--kv-event-source", f"{e.url}={e.events_endpoint}"]
                cmd += ["--kv-event-replay-source", f"{e.url}={e.replay_endpoint}"]
            cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
            env["VLLM_ROUTER_TOKENIZER"] = str(tokenizer_dir)
        return cmd, env
    if peer == "sglang-router":
        cmd = [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common]
        cmd += ["--model-path", str(tokenizer_dir), "--tokenizer-path", str(tokenizer_dir)]
        return cmd, {}
    raise ValueError(f"unknown peer {peer!r}")


@contextlib.contextmanager
def running_router(
    cmd: Sequence[str], env: dict[str, str], log_path: Path
) -> Iterator[subprocess.Popen[bytes]]:
    log = log_path.open("ab")
    proc = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def placement_lookups(metrics_text: str) -> dict[str, float]:
    """vllm-router kv_aware's index lookups by result (``hit``, ``miss``,
    ``index_unavailable``, ...) from its Prometheus text: all misses means its index never
    held the requests' blocks (the events did not reach it, see docs/peers.md)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "vllm_router_kv_placement_lookups_total":
                result = s.labels.get("result", "")
                out[result] = out.get(result, 0.0) + s.value
    return out


def wait_router_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Until ``GET /readiness`` answers 200 (both routers serve it once workers are up)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with code {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if http.get(f"{url}/readiness").status_code == 200:
                    return
            time.sleep(0.1)
    raise TimeoutError(f"router at {url} not ready after {timeout_s:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loadtest.peers lock [--upgrade] [NAME ...]`` (docs/peers.md)."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.peers")
    sub = parser.add_subparsers(dest="command", required=True)
    p_lock = sub.add_parser("lock", help="write the peers' verified sets from .peers/")
    p_lock.add_argument("names", nargs="*", metavar="NAME", help=f"of {', '.join(PACKAGES)}")
    p_lock.add_argument(
        "--upgrade",
        action="store_true",
        help="first reinstall each venv with today's dependencies of the pinned router",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - PACKAGES.keys())
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}; peers: {', '.join(PACKAGES)}")
    for name in args.names or list(PACKAGES):
        try:
            path = lock(name, upgrade=args.upgrade)
        except RuntimeError as exc:
            print(f"peer {name}: {exc}", file=sys.stderr)
            return 1
        print(f"peer {name}: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
