"""An hf pool's tokenizer is loaded when its policy is, off the event loop, or the policy
is refused.

Before, the policy check read the first 256 bytes of tokenizer.json only: a file cut short
(a download interrupted, a disk full during a copy) was accepted, and the gateway opened
it at the pool's first request, on the event loop: every request of the pool then failed
with a 500, each parsing the file again. Now the tokenizers of a policy's hf pools are
loaded on a worker thread before it is applied (start-up, the file watcher and POST
/admin/policy alike); one that does not load refuses the policy, the old one stays; the
loaded tokenizer is the one requests use.

Real pieces: a gateway serving on loopback with a fake engine (tests/test_upstream_faults'
FakeReplica, a raw asyncio server), the built-in tokenizer exported as an HF model dir
(what ``kvgate tokenizer --export`` writes). ``_FromDirSpy`` wraps the real
``HFTokenizer.from_dir`` to count its calls and their threads (and, for the slow-volume
case, to sleep in it: a named fault injection)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from cachecore.chatformat import ContentFormatOption
from cachecore.testing import free_port
from cachecore.tokenizer import HFTokenizer, export_builtin
from gateway.core import Gateway
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from policies.schema import PolicyError, parse_policy_text
from tests.test_upstream_faults import MODEL, FakeReplica, completion

pytestmark = pytest.mark.timeout(60)

BASE = "routing: {strategy: random}\n"
ADMIN = "a" * 32


def _hf_policy(directory: Path) -> str:
    pool = f"{{tokenizer: hf, tokenizer_dir: '{directory}'}}"
    return BASE + f"models: {{pools: {{{MODEL}: {pool}}}}}\n"


def _exported(directory: Path) -> Path:
    directory.mkdir()
    export_builtin(directory)
    return directory


def _truncated(directory: Path) -> Path:
    """An exported dir whose tokenizer.json was cut short (it still opens a JSON object)."""
    _exported(directory)
    tok = directory / "tokenizer.json"
    data = tok.read_bytes()
    tok.write_bytes(data[: len(data) // 2])
    return directory


class _FromDirSpy:
    """The real ``HFTokenizer.from_dir``, counting its calls and the threads they ran on;
    ``delay_s`` sleeps first (a slow volume: the fault injected)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.real = HFTokenizer.from_dir
        self.delay_s = delay_s
        self.threads: list[int] = []

    def __call__(
        self, directory: Path, name: str | None = None, content_format: ContentFormatOption = "auto"
    ) -> HFTokenizer:
        self.threads.append(threading.get_ident())
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.real(directory, name, content_format)


@contextlib.asynccontextmanager
async def _gateway(policy_file: Path) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    engine = FakeReplica()
    await engine.start()
    gs = GatewaySettings(
        port=free_port(),
        open_access=True,
        salt_secrets=[SecretStr("s" * 32)],
        seed=7,
        admin_key=SecretStr(ADMIN),
        policy=policy_file,
        replicas=[engine.url],
        replica_allowlist=[engine.url],
    )
    gw = build_gateway(gs)
    try:
        async with (
            serve_in_loop(gw) as url,
            httpx.AsyncClient(base_url=url, timeout=10, headers={"x-admin-key": ADMIN}) as h,
        ):
            yield gw, h
    finally:
        await engine.stop()


async def _served(h: httpx.AsyncClient, tag: str) -> None:
    r = await h.post("/v1/completions", json=completion(f"{tag} some words to route"))
    assert r.status_code == 200, r.text


async def test_a_truncated_tokenizer_is_refused_at_reload_and_the_old_policy_kept(
    tmp_path: Path,
) -> None:
    """Before: the POST was answered "reloaded" and every request of the pool then 500."""
    bad = _truncated(tmp_path / "bad")
    parse_policy_text(_hf_policy(bad))  # the schema's check alone accepts it
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    async with _gateway(f) as (gw, h):
        before = gw.policy
        await _served(h, "before")
        r = await h.post("/admin/policy", content=_hf_policy(bad))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_policy"
        assert str(bad / "tokenizer.json") in err["message"]
        assert f"models.pools.{MODEL}.tokenizer_dir" in err["fields"]
        assert gw.policy is before
        # the file watcher's (and an empty POST's) reload of the same policy
        f.write_text(_hf_policy(bad))
        with pytest.raises(PolicyError, match="does not load") as exc:
            await gw.policies.reload()
        assert str(f) in str(exc.value)
        assert gw.policy is before and gw.policies.last_error is not None
        await _served(h, "after")  # still served, by the old policy's tokenizer


async def test_a_good_tokenizer_is_loaded_once_off_the_loop_before_it_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the reload loaded nothing, the first request parsed the file on the loop."""
    good = _exported(tmp_path / "good")
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    spy = _FromDirSpy()
    monkeypatch.setattr(HFTokenizer, "from_dir", spy)
    async with _gateway(f) as (gw, h):
        r = await h.post("/admin/policy", content=_hf_policy(good))
        assert r.status_code == 200, r.text
        assert gw.policy.models.pool(MODEL).tokenizer == "hf"
        assert len(spy.threads) == 1, "loaded as the policy was applied"
        assert spy.threads[0] != threading.get_ident(), "on a worker thread"
        await _served(h, "first")
        await _served(h, "second")
        assert len(spy.threads) == 1, "no second parse at the first request"
        r = await h.post("/admin/policy", content=_hf_policy(good) + "# same dir\n")
        assert r.status_code == 200 and len(spy.threads) == 1  # unchanged files: kept
        (good / "chat_template.jinja").write_text((good / "chat_template.jinja").read_text())
        r = await h.post("/admin/policy", content=_hf_policy(good))
        assert r.status_code == 200 and len(spy.threads) == 2  # rewritten: read again


async def test_a_slow_tokenizer_load_does_not_stall_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load that waits 1 s (a slow volume) during a reload and the pool's first
    requests: a 50 ms ticker keeps ticking (before: the first request stalled it 1 s).
    The parse itself holds the GIL (``tokenizers``) and is not covered by this."""
    good = _exported(tmp_path / "good")
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    monkeypatch.setattr(HFTokenizer, "from_dir", _FromDirSpy(delay_s=1.0))
    async with _gateway(f) as (_gw, h):
        gaps: list[float] = []
        stop = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.05)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        r = await h.post("/admin/policy", content=_hf_policy(good))
        assert r.status_code == 200, r.text
        await _served(h, "first")
        stop.set()
        await ticker
        assert len(gaps) >= 10  # it ticked through the load
        assert max(gaps) < 0.5, gaps  # a busy host's jitter, not the 1 s load


async def test_a_truncated_tokenizer_fails_the_start(tmp_path: Path) -> None:
    """Refused at start-up as any invalid policy is, naming the file and the problem."""
    bad = _truncated(tmp_path / "bad")
    f = tmp_path / "p.yaml"
    f.write_text(_hf_policy(bad))
    gs = GatewaySettings(
        port=free_port(), open_access=True, salt_secrets=[SecretStr("s" * 32)], policy=f
    )
    gw = Gateway(gs)  # the schema's check passes: the file opens a JSON object
    try:
        with pytest.raises(PolicyError, match="does not load") as exc:
            await gw.start()
        assert str(f) in str(exc.value) and str(bad / "tokenizer.json") in str(exc.value)
    finally:
        await gw.stop()
