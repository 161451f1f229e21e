"""API keys without a restart: the key file is reloaded when it changes (and on
``POST /admin/keys/reload``), atomically, keeping the old keys when the file is refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from redis.asyncio import Redis

from cachecore.index.redis import redis_client
from cachecore.replica.settings import ReplicaSettings
from cachecore.testing import PATIENT_TIMEOUT_S, RedisServer
from gateway.auth import (
    KeyFileError,
    KeyReload,
    KeyStore,
    KeyStoreUnavailable,
    check_admin,
    hash_key,
    load_key_file,
)
from tests.test_gateway_support import Stack, stack

MSGS: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]


def key_text(keys: dict[str, str]) -> str:
    return "keys:\n" + "".join(
        f"  - {{sha256: {hash_key(k)}, tenant: {t}}}\n" for k, t in keys.items()
    )


def replace_keys(path: Path, keys: dict[str, str]) -> None:
    """The file replaced atomically: written beside it, renamed over it."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(key_text(keys))
    os.replace(tmp, path)


async def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.02)


async def tenant_of(st: Stack, api_key: str) -> str:
    """The tenant the gateway resolves ``api_key`` to (the explain endpoint, as the client)."""
    async with st.http() as h:
        r = await h.post(
            "/admin/route/explain",
            json={"model": st.model, "messages": MSGS},
            headers={**st.admin_headers(), "authorization": f"Bearer {api_key}"},
        )
    assert r.status_code == 200, r.text
    tenant: str = r.json()["tenant"]
    return tenant


async def metric(st: Stack, line_start: str) -> float:
    async with st.http() as h:
        text = (await h.get("/metrics", headers=st.admin_headers())).text
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {line_start} in /metrics")


# ---------------------------------------------------------------- the store alone


async def test_a_reload_adds_removes_and_retenants_in_one_swap(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "a", "sk-b": "b", "sk-c": "c"})
    store = KeyStore(key_file=f)
    assert await store.tenant_for("Bearer sk-a") == "a"
    replace_keys(f, {"sk-b": "c", "sk-c": "c", "sk-d": "d"})
    assert store.reload_file() == KeyReload(keys=3, added=1, removed=1, retenanted=1)
    assert await store.tenant_for("Bearer sk-a") is None
    assert await store.tenant_for("Bearer sk-b") == "c"
    assert await store.tenant_for("Bearer sk-d") == "d"
    assert (store.reloads, store.last_error) == (1, None)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "the file is empty"),
        (b"keys:\n  - {sha256: 0123\n", "while parsing"),
        (b"keys:\n  - {sha256: 0123", "the last line has no end"),
        (b"keys:\n  - {sha256: nothex, tenant: a}\n", "not a SHA-256 hex digest"),
        (b"keys: []\n", "no keys"),
        (b"\xff\xfe\x00binary", "can't decode"),
    ],
)
async def test_a_refused_reload_keeps_the_old_keys(
    tmp_path: Path, content: bytes, reason: str
) -> None:
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "a"})
    store = KeyStore(key_file=f)
    f.write_bytes(content)  # in place, as a careless writer (or a torn write) leaves it
    with pytest.raises(KeyFileError, match=reason):
        store.reload_file()
    assert await store.tenant_for("Bearer sk-a") == "a"
    assert store.last_error is not None and str(f) in store.last_error
    assert store.reloads == 0


async def test_a_deleted_key_file_keeps_the_old_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "a"})
    store = KeyStore(key_file=f)
    f.unlink()
    assert store.poll_file() is None  # noticed; applied only once it keeps still
    with pytest.raises(KeyFileError, match="No such file"):
        store.poll_file()
    assert store.poll_file() is None  # refused once, not at every look
    assert await store.tenant_for("Bearer sk-a") == "a"


async def test_the_watcher_waits_for_the_file_to_keep_still(tmp_path: Path) -> None:
    """A writer rewriting the file in place in two steps: the half read between them
    (here a tenant name cut short, "acme" for "acme-prod") is never applied."""
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "a"})
    store = KeyStore(key_file=f)
    assert store.poll_file() is None  # unchanged
    full = key_text({"sk-a": "a", "sk-p": "acme-prod"})
    with f.open("w") as w:
        w.write(full[: full.index("acme") + 4])
        w.flush()
        assert store.poll_file() is None  # changed since the last look: not yet
        w.write(full[full.index("acme") + 4 :])
    assert store.poll_file() is None  # changed again
    assert store.poll_file() == KeyReload(keys=2, added=1, removed=0, retenanted=0)
    assert await store.tenant_for("Bearer sk-p") == "acme-prod"
    assert store.poll_file() is None  # applied once


# ---------------------------------------------------------------- a real gateway


async def test_a_revoked_key_gets_401_at_its_next_request_while_streams_finish(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys.yaml"
    replace_keys(keys, {"sk-a": "a", "sk-b": "b"})
    async with stack(
        count=1, replica=ReplicaSettings(time_scale=1.0), api_keys_file=keys, api_keys_poll_s=0.05
    ) as st:
        assert await metric(st, "kvgate_api_keys") == 2
        stream = await st.client("sk-a").chat.completions.create(
            model=st.model, messages=MSGS, max_tokens=150, stream=True
        )
        chunks = stream.__aiter__()
        await chunks.__anext__()  # sk-a's request is in flight
        replace_keys(keys, {"sk-b": "c", "sk-d": "d"})
        await wait_until(lambda: st.gw.key_store.reloads == 1)
        assert st.gw.in_flight == 1  # the reload landed while the stream was open
        rest = [c async for c in chunks]
        assert rest and rest[-1].choices[-1].finish_reason is not None
        with pytest.raises(openai.AuthenticationError) as e401:
            await st.client("sk-a").chat.completions.create(
                model=st.model, messages=MSGS, max_tokens=1
            )
        assert e401.value.status_code == 401 and e401.value.code == "invalid_api_key"
        assert await tenant_of(st, "sk-b") == "c"
        assert await tenant_of(st, "sk-d") == "d"
        assert await metric(st, 'kvgate_api_key_reloads_total{outcome="ok"}') == 1
        assert await metric(st, "kvgate_api_keys") == 2

        # truncated in place and left empty: refused, logged, counted; the keys stay
        with caplog.at_level(logging.ERROR, logger="gateway.auth"):
            keys.write_text("")
            await wait_until(lambda: st.gw.key_store.last_error is not None)
        assert "the file is empty" in (st.gw.key_store.last_error or "")
        assert any(
            r.getMessage() == "api key file reload refused; keeping the old keys"
            for r in caplog.records
        )
        assert await metric(st, 'kvgate_api_key_reloads_total{outcome="invalid"}') == 1
        assert await tenant_of(st, "sk-b") == "c"
        replace_keys(keys, {"sk-b": "b"})  # the rewrite that follows is applied
        await wait_until(lambda: st.gw.key_store.reloads == 2)
        assert await tenant_of(st, "sk-b") == "b"


async def test_admin_keys_reload_needs_the_admin_key_and_says_what_changed(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.yaml"
    replace_keys(keys, {"sk-a": "a"})
    async with stack(count=1, api_keys_file=keys, api_keys_poll_s=3600.0) as st:
        replace_keys(keys, {"sk-b": "b"})
        async with st.http() as h:
            r = await h.post("/admin/keys/reload")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_key"
            r = await h.post("/admin/keys/reload", headers={"authorization": "Bearer sk-a"})
            assert r.status_code == 401
            assert await st.gw.key_store.tenant_for("Bearer sk-a") == "a"
            r = await h.post("/admin/keys/reload", headers=st.admin_headers())
            assert r.status_code == 200, r.text
            assert r.json() == {
                "status": "reloaded", "keys": 1, "added": 1, "removed": 1, "retenanted": 0
            }  # fmt: skip
            assert await st.gw.key_store.tenant_for("Bearer sk-a") is None
            keys.write_text("keys: [")
            r = await h.post("/admin/keys/reload", headers=st.admin_headers())
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_api_keys"
            assert str(keys) in r.json()["error"]["message"]
            assert await st.gw.key_store.tenant_for("Bearer sk-b") == "b"
            r = await h.get("/admin/keys", headers=st.admin_headers())
            assert r.json()["keys"] == 1 and r.json()["reloads"] == 1
            assert str(keys) in r.json()["last_error"]
        assert await metric(st, 'kvgate_api_key_reloads_total{outcome="invalid"}') == 1


async def test_admin_keys_reload_without_a_key_file_says_so() -> None:
    """A 400 naming the flag; not a refused file (no ERROR line, no
    kvgate_api_key_reloads_total{outcome="invalid"}, which operators alert on)."""
    async with stack(count=1) as st, st.http() as h:
        r = await h.post("/admin/keys/reload", headers=st.admin_headers())
        invalid = st.gw.metrics.api_key_reloads.labels("invalid")._value.get()
    assert r.status_code == 400
    assert "without an API key file (--api-keys)" in r.json()["error"]["message"]
    assert invalid == 0


# ---------------------------------------------------------------- Redis keys, Redis down


async def test_redis_keys_fail_closed_once_redis_has_been_unreachable_past_the_bound(
    redis_own: RedisServer,
) -> None:
    """A key Redis confirmed stays valid while Redis cannot be asked for at most
    ``stale_s`` after that confirmation; then (and for a key it never confirmed) the
    lookup fails closed. It was valid for as long as Redis stayed away."""
    # a stopped Redis refuses at once: the timeouts only bound the lookups while it is up.
    # The 3 s bound leaves a busy host room to stop Redis and look up within it (with 1 s,
    # all that had ~0.8 s)
    client = redis_client(redis_own.url, socket_timeout_s=5.0, connect_timeout_s=5.0)
    try:
        await client.hset("kvg:apikeys", mapping={hash_key("sk-r"): "acme"})
        store = KeyStore(redis=client, cache_ttl_s=0.1, stale_s=3.0)
        assert await store.tenant_for("Bearer sk-r") == "acme"
        confirmed = time.monotonic()
        assert await store.tenant_for("Bearer sk-unknown") is None
        redis_own.stop()
        await asyncio.sleep(0.2)  # past the cache TTL: Redis is asked, and cannot answer
        assert await store.tenant_for("Bearer sk-r") == "acme"  # within the bound
        assert await store.tenant_for("Bearer sk-unknown") is None  # its answer too
        with pytest.raises(KeyStoreUnavailable):
            await store.tenant_for("Bearer sk-never-seen")
        await asyncio.sleep(max(0.0, confirmed + 3.05 - time.monotonic()))
        with pytest.raises(KeyStoreUnavailable):
            await store.tenant_for("Bearer sk-r")
        assert store.redis_errors >= 1
        redis_own.start()  # back (empty: a restart loses the hash)
        await client.hset("kvg:apikeys", mapping={hash_key("sk-r"): "acme"})
        deadline = time.monotonic() + 5.0  # asked again after a pause of at most 1 s
        while time.monotonic() < deadline:
            with contextlib.suppress(KeyStoreUnavailable):
                if await store.tenant_for("Bearer sk-r") == "acme":
                    break
            await asyncio.sleep(0.05)
        assert await store.tenant_for("Bearer sk-r") == "acme"
    finally:
        await client.aclose()


async def test_a_key_that_cannot_be_checked_gets_503_not_401(redis_own: RedisServer) -> None:
    """Through the gateway, with the Redis it shares for keys, index and load stopped
    mid-test: a key Redis confirmed works within KVGATE_API_KEYS_STALE_S, then gets a
    retryable 503 (a 401 would tell the client its valid key is wrong); so does a key Redis
    never answered for."""
    seed = redis_client(
        redis_own.url, socket_timeout_s=PATIENT_TIMEOUT_S, connect_timeout_s=PATIENT_TIMEOUT_S
    )
    await seed.hset("kvg:apikeys", mapping={hash_key("sk-r"): "acme"})
    await seed.aclose()
    async with (
        stack(
            count=1,
            redis_url=redis_own.url,
            api_keys_redis=True,
            open_access=False,
            api_keys_cache_ttl_s=0.1,
            api_keys_stale_s=3.0,  # room for stopping Redis and two requests on a busy host
        ) as st,
        st.http() as h,
    ):
        body = {"model": st.model, "messages": MSGS, "max_tokens": 1}
        auth = {"authorization": "Bearer sk-r"}
        assert (await h.post("/v1/chat/completions", json=body, headers=auth)).status_code == 200
        confirmed = time.monotonic()
        redis_own.stop()
        await asyncio.sleep(0.2)  # past the TTL
        r = await h.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        r = await h.post(
            "/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-other"}
        )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "api_key_store_unavailable"
        await asyncio.sleep(max(0.0, confirmed + 3.1 - time.monotonic()))
        r = await h.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "api_key_store_unavailable"
        assert (await h.get("/v1/models", headers=auth)).status_code == 503


async def test_unknown_keys_do_not_flush_the_answers_that_stand_in_for_redis(
    redis_own: RedisServer,
) -> None:
    """Anyone can send made-up keys, each a cached "no": 10,001 of them emptied the whole
    cache, and with Redis then unreachable every client's key got a 503."""
    # a generous timeout: one of 10,002 lookups stalling 0.25 s on a busy CI host failed
    # closed (rightly) and read as this defect; a stopped Redis refuses at once anyway
    client = redis_client(redis_own.url, socket_timeout_s=5.0, connect_timeout_s=5.0)
    try:
        await client.hset("kvg:apikeys", mapping={hash_key("sk-r"): "acme"})
        store = KeyStore(redis=client, cache_ttl_s=0.0, stale_s=60.0)
        assert await store.tenant_for("Bearer sk-r") == "acme"
        for i in range(10_002):
            assert await store.tenant_for(f"Bearer made-up-{i}") is None
        redis_own.stop()
        assert await store.tenant_for("Bearer sk-r") == "acme"
    finally:
        await client.aclose()


# ---------------------------------------------------------------- key file parsing

A = hash_key("sk-a")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        # one key, two tenants: which one the key got was the file order's accident
        (f"keys:\n  - {{sha256: {A}, tenant: acme}}\n  - {{sha256: {A}, tenant: beta}}\n",
         "listed twice"),
        (f"{A}: acme\n{A}: beta\n", "listed twice"),
        (f"{A}: acme\n{A.upper()}: beta\n", "listed twice"),
        # a second `keys:` list silently replaced the first (its keys all revoked)
        (f"keys:\n  - {{sha256: {A}, tenant: acme}}\nkeys: []\n", "listed twice"),
        # mapping entries beside `keys:` were ignored without a word
        (f"keys:\n  - {{sha256: {A}, tenant: acme}}\n{hash_key('sk-b')}: beta\n",
         "one form"),
    ],
)  # fmt: skip
def test_an_ambiguous_key_file_is_refused(tmp_path: Path, text: str, reason: str) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(text)
    with pytest.raises(KeyFileError, match=reason):
        load_key_file(f)


def test_a_key_listed_twice_for_one_tenant_is_taken(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(f"{A}: acme\n{A.upper()}: acme\n")
    assert load_key_file(f) == {A: "acme"}


@pytest.mark.parametrize("tenant", ["no", "on", "1234", "null", "1.5"])
def test_a_tenant_name_yaml_reads_as_no_string_says_to_quote_it(
    tmp_path: Path, tenant: str
) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text(f"{A}: {tenant}\n")
    with pytest.raises(KeyFileError, match="quote it"):
        load_key_file(f)
    f.write_text(f"{A}: '{tenant}'\n")
    assert load_key_file(f) == {A: tenant}


def test_an_admin_key_with_a_space_opens_the_admin_api_as_sent() -> None:
    """Review: an admin key with a space in it (a passphrase) was taken for a scheme and a
    token when sent as it is in x-admin-key, and refused; only `Bearer <key>` opened."""
    key = "correct horse battery staple"
    assert check_admin(key, key)
    assert check_admin(f"Bearer {key}", key)
    assert not check_admin("correct horse", key)
    assert not check_admin(f"Bearer {key} x", key)


async def test_a_reload_refuses_a_file_cut_mid_line(tmp_path: Path) -> None:
    """A write caught mid-line can end in a tenant name cut short that is another tenant's
    name ("acme" of "acme-prod"): the key would move into that tenant's cache scope until
    the next look. A file a writer has finished ends its last line (or its JSON)."""
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "acme"})
    store = KeyStore(key_file=f)
    full = f"{hash_key('sk-a')}: acme\n{hash_key('sk-p')}: acme-prod\n"
    f.write_text(full[: full.rindex("acme") + 4])  # "... tenant: acme" of "acme-prod"
    with pytest.raises(KeyFileError, match="last line"):
        store.reload_file()
    assert await store.tenant_for("Bearer sk-p") is None
    f.write_text(full)
    assert store.reload_file().keys == 2
    f.write_text(f'{{"{hash_key("sk-j")}": "json"}}')  # JSON needs no final newline
    assert store.reload_file().keys == 1


async def test_an_unanswering_redis_is_not_asked_again_by_every_request(
    redis_own: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis partitioned away (here: a peer on its port that takes connections and never
    answers): every request past the TTL waited out the 0.25 s socket timeout, then logged
    a WARNING. Now one lookup fails, and Redis is asked again only after a pause; the
    cached answers stand in (within the bound) without the wait."""
    client = redis_client(redis_own.url, socket_timeout_s=0.25, connect_timeout_s=0.25)
    try:
        await client.hset("kvg:apikeys", mapping={hash_key("sk-r"): "acme"})
        store = KeyStore(redis=client, cache_ttl_s=0.0, stale_s=60.0)
        assert await store.tenant_for("Bearer sk-r") == "acme"
        redis_own.stop()
        with socket.socket() as hole, caplog.at_level(logging.WARNING, logger="gateway.auth"):
            hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hole.bind(("127.0.0.1", redis_own.port))
            hole.listen(64)
            assert isinstance(client, Redis)  # standalone: one pool
            await client.connection_pool.disconnect()  # the next command connects anew
            t0 = time.monotonic()
            for _ in range(20):
                assert await store.tenant_for("Bearer sk-r") == "acme"
            elapsed = time.monotonic() - t0
        assert elapsed < 1.5, elapsed  # was 20 x 0.25 s
        assert store.redis_errors == 1
        assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    finally:
        await client.aclose()


async def test_a_deeply_nested_key_file_is_refused_not_a_crash(tmp_path: Path) -> None:
    """Review: 5,000 nested brackets made PyYAML overflow the stack: a RecursionError that
    ended the file watcher for good (no later reload), and a 500 from the admin reload."""
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "a"})
    store = KeyStore(key_file=f)
    f.write_text("k: " + "[" * 5000 + "1" + "]" * 5000 + "\n")
    with pytest.raises(KeyFileError, match="nested too deeply"):
        store.reload_file()
    assert await store.tenant_for("Bearer sk-a") == "a"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (
            b"keys:\n  - {sha256: sk-live-0123456789abcdef0123456789, tenant: acme}\n",
            "entry 1 (tenant 'acme') is not a SHA-256 hex digest",
        ),
        (b"sk-live-0123456789abcdef0123456789: acme\n", "entry 1 (tenant 'acme')"),
        # YAML's own errors: PyYAML quotes the offending line
        (
            b"sk-live-0123456789abcdef0123456789: acme: prod\n",
            "mapping values are not allowed here at line 1, column 41",
        ),
        (
            b"keys:\n  - {sha256: sk-live-0123456789abcdef0123456789, tenant: acme\n",
            "while parsing a flow mapping",
        ),
        (
            b"sk-live-0123456789abcdef0123456789: a\nsk-live-0123456789abcdef0123456789: b\n",
            "a key is listed twice, for different tenants at line 2",
        ),
    ],
)
async def test_a_plain_key_in_the_file_is_never_echoed(
    tmp_path: Path, content: bytes, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator who pastes the key itself where its digest belongs: the refusal says
    where, and the key reaches neither the log nor /admin/keys (nor does PyYAML's snippet
    of the line, which held it)."""
    f = tmp_path / "keys.yaml"
    replace_keys(f, {"sk-a": "a"})
    store = KeyStore(key_file=f)
    f.write_bytes(content)
    with caplog.at_level("DEBUG"), pytest.raises(KeyFileError) as err:
        store.reload_file()
    said = [str(err.value), str(store.last_error), caplog.text]
    assert reason in said[0], said[0]
    assert not any("sk-live" in s or "0123456789abcdef" in s for s in said), said
