"""A policy file refused for what lies outside it (an hf tokenizer not loadable yet) is
read again while the refusal lasts, and applied once the tokenizer is complete.

Before, the watcher reloaded the policy file only when the FILE changed: an operator who
pointed the policy at a new tokenizer.json while it was still being copied (or copied it
after the policy) saw the reload refused, and nothing more happened until the policy
file changed again or someone POSTed /admin/policy. Now such a refusal (a tokenizer_dir's
files, the tokenizers' load, the engines' block sizes) is retried after the poll interval,
then twice as long each time up to ``RETRY_CAP_S``, logged and counted again only when
its error changes; a refusal of the text itself (YAML, the schema) is not retried.

Real pieces: a gateway on loopback with a fake engine (as in test_h24_tok_reload), the
built-in tokenizer exported as an HF model dir and copied in parts; the store-level cases
use a real PolicyStore and its watcher on a tmp file."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

import gateway.policy_store as policy_store
from cachecore.chatformat import ContentFormatOption
from cachecore.testing import free_port
from cachecore.tokenizer import HFTokenizer, export_builtin
from gateway.core import Gateway
from gateway.policy_store import PolicyStore
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from gateway.tokenization import TokenizerPools
from policies.schema import Policy, load_policy, parse_policy_text
from tests.test_api_keys import wait_until
from tests.test_h24_tok_reload import ADMIN, BASE, _hf_policy, _served
from tests.test_upstream_faults import MODEL, FakeReplica

pytestmark = pytest.mark.timeout(60)

POLL_S = 0.05


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        str(getattr(r, "error", ""))
        for r in caplog.records
        if r.levelname == "ERROR" and r.getMessage().startswith("policy reload failed")
    ]


class _Copy:
    """A tokenizer dir being copied: every file but tokenizer.json, which is written in
    parts (``part``) from the exported original."""

    def __init__(self, tmp_path: Path) -> None:
        src = tmp_path / "src"
        src.mkdir()
        export_builtin(src)
        self.data = (src / "tokenizer.json").read_bytes()
        self.dir = tmp_path / "tok"
        shutil.copytree(src, self.dir, ignore=shutil.ignore_patterns("tokenizer.json"))

    def part(self, fraction: float) -> None:
        # each stage whole (renamed over): a look between a stage's truncation and its
        # write would see a third, empty stage and make the counts race
        tmp = self.dir.parent / "tokenizer.json.part"
        tmp.write_bytes(self.data[: int(len(self.data) * fraction)])
        os.replace(tmp, self.dir / "tokenizer.json")


class _Loads:
    """The real ``HFTokenizer.from_dir``, counting its calls."""

    def __init__(self) -> None:
        self.real = HFTokenizer.from_dir
        self.calls = 0

    def __call__(
        self, directory: Path, name: str | None = None, content_format: ContentFormatOption = "auto"
    ) -> HFTokenizer:
        self.calls += 1
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
        policy_poll_s=POLL_S,
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


def _invalid(gw: Gateway) -> float:
    value: float = gw.metrics.policy_reloads.labels("invalid")._value.get()
    return value


async def test_a_policy_refused_for_a_tokenizer_being_copied_applies_once_it_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: refused once, then the old policy for good (the wait for the apply timed
    out). Now: one refusal logged and counted while the copy goes on (its error moves to
    later lines: the same refusal), `last_error` shows it, and the policy applies on its
    own once the file is complete."""
    copy = _Copy(tmp_path)
    copy.part(1 / 3)  # opens a JSON object: the schema passes, the load does not
    loads = _Loads()
    monkeypatch.setattr(HFTokenizer, "from_dir", loads)
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    with caplog.at_level(logging.ERROR, logger="gateway.policy_store"):
        async with _gateway(f) as (gw, h):
            f.write_text(_hf_policy(copy.dir))
            await wait_until(lambda: gw.policies.last_error is not None)
            r = await h.get("/admin/policy")
            assert "does not load" in r.json()["last_error"]
            first = gw.policies.last_error
            copy.part(2 / 3)  # the copy goes on: refused at a later line
            await wait_until(lambda: gw.policies.last_error != first)
            assert loads.calls == 2
            assert _invalid(gw) == 1 and len(_refusals(caplog)) == 1
            assert gw.policy.models.pool(MODEL).tokenizer == "builtin"  # the old one stays
            copy.part(1.0)
            await wait_until(lambda: gw.policy.models.pool(MODEL).tokenizer == "hf")
            r = await h.get("/admin/policy")
            assert r.json()["last_error"] is None
            assert _invalid(gw) == 1 and len(_refusals(caplog)) == 1
            await _served(h, "after")


async def test_a_policy_copied_before_its_tokenizer_dir_applies_once_the_dir_is_there(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The tokenizer dir does not exist yet (the schema refuses the policy), then its
    tokenizer.json is cut short (the load refuses it: a new error, logged), then whole."""
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    store = PolicyStore(f)

    async def load(pol: Policy) -> list[tuple[str, str]]:
        directory = pol.models.pool(MODEL).tokenizer_dir
        if directory is None:
            return []
        try:
            await asyncio.to_thread(HFTokenizer.from_dir, Path(directory))
        except Exception as exc:
            return [(f"models.pools.{MODEL}.tokenizer_dir", f"does not load: {exc}")]
        return []

    store.prepare = load
    results: list[tuple[bool, str]] = []
    store.start(POLL_S, lambda ok, err: results.append((ok, err)))
    copy_root = tmp_path / "later"
    copy_root.mkdir()
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.policy_store"):
            f.write_text(_hf_policy(copy_root / "tok"))
            await wait_until(lambda: len(results) == 1)
            assert "is not a directory" in results[0][1]
            copy = _Copy(copy_root)
            copy.part(0.5)
            await wait_until(lambda: len(results) == 2)
            assert "does not load" in results[1][1]
            copy.part(1.0)
            await wait_until(lambda: len(results) == 3)
    finally:
        await store.stop()
    assert [ok for ok, _ in results] == [False, False, True]
    assert len(_refusals(caplog)) == 2 and store.last_error is None
    assert store.policy.models.pool(MODEL).tokenizer == "hf"


async def test_a_refusal_of_the_text_itself_is_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """YAML that does not parse cannot heal by waiting: read once, then again only when
    the file changes (no read at every look)."""
    reads: list[Path] = []
    real = load_policy

    def counting(path: Path, allow_empty: bool = True) -> Policy:
        reads.append(path)
        return real(path, allow_empty=allow_empty)

    monkeypatch.setattr(policy_store, "load_policy", counting)
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    store = PolicyStore(f)
    results: list[tuple[bool, str]] = []
    store.start(POLL_S, lambda ok, err: results.append((ok, err)))
    try:
        f.write_text("routing: {strategy: [\n")
        await wait_until(lambda: len(results) == 1)
        n = len(reads)
        await asyncio.sleep(20 * POLL_S)
        assert len(reads) == n and len(results) == 1
    finally:
        await store.stop()


async def test_retries_back_off_to_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal that lasts is read again after the poll interval, then twice as long
    each time up to RETRY_CAP_S: not at every look, and never given up."""
    monkeypatch.setattr(policy_store, "RETRY_CAP_S", 8 * POLL_S, raising=False)
    f = tmp_path / "p.yaml"
    f.write_text(BASE)
    store = PolicyStore(f)
    at: list[float] = []

    async def never(_pol: Policy) -> list[tuple[str, str]]:
        at.append(asyncio.get_running_loop().time())
        return [("models.default.tokenizer_dir", "does not load")]

    store.prepare = never
    results: list[tuple[bool, str]] = []
    store.start(POLL_S, lambda ok, err: results.append((ok, err)))
    try:
        f.write_text(BASE + "# changed\n")
        await wait_until(lambda: len(at) >= 7, timeout_s=20.0)
    finally:
        await store.stop()
    gaps = [b - a for a, b in itertools.pairwise(at)]
    # 1, 2, 4, 8, 8, 8 poll intervals (each rounded up to a look; a busy host adds more)
    for gap, want in zip(gaps, [1, 2, 4, 8, 8, 8], strict=False):
        assert gap >= want * POLL_S * 0.9, gaps
    assert max(gaps) < 8 * POLL_S + 1.0, gaps  # capped
    assert len(results) == 1  # the same refusal: reported once


async def test_a_tokenizer_that_did_not_load_is_not_parsed_again_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher's retries of a policy whose tokenizer.json is corrupt and stays so
    parsed it again at each (the parse holds the GIL, ~65 ms/MB: a stall every 30 s for
    as long as the refusal lasted). The refusal is now remembered for those files; a
    file still being copied (new size, new mtime) is parsed again."""
    copy = _Copy(tmp_path)
    copy.part(0.5)
    loads = _Loads()
    monkeypatch.setattr(HFTokenizer, "from_dir", loads)
    models = parse_policy_text(_hf_policy(copy.dir)).models
    async with httpx.AsyncClient() as client:
        pools = TokenizerPools(client, lambda _m, _t: None)
        first = await pools.load_hf(models)
        assert first and "does not load" in first[0][1]
        assert await pools.load_hf(models) == first
        assert loads.calls == 1
        copy.part(0.75)  # the copy goes on
        again = await pools.load_hf(models)
        assert again and again != first and loads.calls == 2
        copy.part(1.0)
        assert await pools.load_hf(models) == [] and loads.calls == 3
