"""The peer routers of ``kvgate bench routers``: vllm-router and sglang-router from PyPI, each
in its own venv under ``.peers/`` (gitignored), and the built-in tokenizer exported as an HF
directory they can load (docs/peers.md has the same commands by hand).

:func:`ensure_peers` is idempotent (a working install of the pinned version is kept; another
version is replaced) and never raises: a failed install is reported as a :class:`PeerStatus`
with the reason, and the benchmark skips that peer. :func:`router_command` builds the
command line of one peer system and :func:`running_router` runs it until the block ends.
"""

from __future__ import annotations

import contextlib
import os
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


def installed_version(name: str, venv: Path) -> str | None:
    """The version of distribution ``name`` in ``venv`` (None: no venv or not installed)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    code = "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))"
    try:
        done = subprocess.run(
            [str(python), "-c", code, name],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


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


def ensure_peer(name: str, peers_dir: Path = PEERS_DIR, install: bool = True) -> PeerStatus:
    """A working venv for peer ``name`` with the pinned version: kept if it already has it,
    else (with ``install``) ``python3.11 -m venv .peers/NAME && .peers/NAME/bin/pip install
    NAME==VERSION``. A venv made before the pin (or by hand) may hold another release, whose
    flags and routing docs/peers.md did not verify: it is reinstalled, never run."""
    venv = peers_dir / name
    probe = _probe_cmd(name, venv)
    want = pinned_version(name)
    have = installed_version(name, venv)
    if have == want and _works(probe):
        return PeerStatus(name, True, f"installed ({name} {have})", venv)
    if not install:
        why = f"not installed under {venv}"
        if have is not None and have != want:
            why = f"{venv} holds {name} {have}, not the pinned {want} (docs/peers.md)"
        return PeerStatus(name, False, f"skipped: {why} (--no-install)", venv)
    peers_dir.mkdir(parents=True, exist_ok=True)
    log = peers_dir / f"{name}-install.log"
    steps = [
        [_python311(), "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "--quiet", PACKAGES[name]],
    ]
    for cmd in steps:
        ok, why = _run_logged(cmd, log)
        if not ok:
            return PeerStatus(name, False, f"skipped: install failed ({why}); log {log}", venv)
    have = installed_version(name, venv)
    if have != want:
        why = f"installed {PACKAGES[name]} but the venv reports {have}"
        return PeerStatus(name, False, f"skipped: {why}; log {log}", venv)
    if not _works(probe):
        return PeerStatus(name, False, f"skipped: installed but `{probe[0]}` does not run", venv)
    return PeerStatus(name, True, f"installed now ({name} {have})", venv)


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
