"""What every attack shares: result rows, tenants with API keys, a real gateway in the
current event loop, one request with its TTFT, the engine's blocks as index keys, and a
man-in-the-middle relay on a replica's KV-event stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx
import zmq
import zmq.asyncio
from pydantic import SecretStr

from cachecore.agent.expect import ReplicaNotIdleError, dump_when_idle
from cachecore.index.base import PrefixIndex
from cachecore.kvevents import salt_from_extra_keys
from cachecore.loadstate import LoadStore
from cachecore.testing import free_port
from cachecore.tokenizer import WordVocabulary, builtin_tokenizer
from gateway.auth import KeyStore, hash_key
from gateway.core import AgentHook, Gateway
from gateway.routing import Strategy
from gateway.serve import build_gateway, serve_in_loop
from gateway.settings import GatewaySettings
from loadtest.replay import RequestResult, send_one
from loadtest.workloads import WorkItem
from policies.schema import parse_policy_text

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    HELD = "held"  # the defence held (and, where there is one, the positive control fired)
    BROKEN = "BROKEN"  # the attack succeeded
    NO_POWER = "NO POWER"  # the positive control did not fire: the probe proves nothing
    # one part of a defence measured alone, for comparison: no claim is made for it, so it
    # neither holds nor breaks (the claimed defence has its own row)
    ABLATION = "ablation"


@dataclass
class AttackResult:
    """One row of the ``kvgate attack`` table."""

    attack: str
    trials: str
    outcome: Outcome
    figures: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        return self.outcome is Outcome.HELD


def format_table(rows: Sequence[AttackResult]) -> str:
    lines = ["| attack | trials | outcome | figures |", "|---|---|---|---|"]
    for r in rows:
        figures = r.figures.replace("|", "/")
        lines.append(f"| {r.attack} | {r.trials} | {r.outcome.value} | {figures} |")
    return "\n".join(lines)


def fmt_p(p: float) -> str:
    if math.isnan(p):
        return "nan"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


# ---------------------------------------------------------------------------- prompts

VOCAB: WordVocabulary = builtin_tokenizer().word_vocabulary


class Words:
    """Random single-token words (exact token counts) from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def list(self, n: int) -> list[str]:
        words = VOCAB.words
        return [words[self.rng.randrange(len(words))] for _ in range(n)]

    def text(self, n: int) -> str:
        return join_words(self.list(n))


def join_words(words: Sequence[str]) -> str:
    return "".join(" " + w for w in words)


def chat_messages(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# ---------------------------------------------------------------------------- tenants


@dataclass(frozen=True)
class Tenants:
    """Tenant name -> API key (random per run; only hashes reach the gateway)."""

    keys: Mapping[str, str]

    @classmethod
    def make(cls, *names: str) -> Tenants:
        return cls({n: f"sk-{n}-{secrets.token_urlsafe(16)}" for n in names})

    def key_store(self) -> KeyStore:
        return KeyStore({hash_key(k): t for t, k in self.keys.items()})

    def headers(self, tenant: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[tenant]}"}


@dataclass
class GatewayHandle:
    gw: Gateway
    url: str
    tenants: Tenants
    admin_key: str

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"x-admin-key": self.admin_key}


@contextlib.asynccontextmanager
async def running_gateway(
    replicas: Sequence[str],
    tenants: Tenants,
    *,
    policy: str | None = None,
    debug_shared_scope: bool = False,
    index: PrefixIndex | None = None,
    load_store: LoadStore | None = None,
    agent_hook: AgentHook | None = None,
    strategy: Strategy | None = None,
    seed: int = 0,
    salt_secret: str | None = None,
) -> AsyncIterator[GatewayHandle]:
    """The real gateway (``build_gateway`` + uvicorn) in the current event loop, with the
    tenants' keys, a random salt secret and admin key, and the given policy text."""
    admin = secrets.token_urlsafe(16)
    settings = GatewaySettings(
        replicas=list(replicas),
        port=free_port(),
        salt_secrets=[SecretStr(salt_secret or secrets.token_hex(32))],
        admin_key=SecretStr(admin),
        seed=seed,
        debug_unsafe_shared_scope=debug_shared_scope,
        policy_poll_s=3600.0,  # the attacks reload policies explicitly
    )
    pol = parse_policy_text(policy) if policy is not None else None
    gw = build_gateway(
        settings,
        policy=pol,
        index=index,
        load_store=load_store,
        agent_hook=agent_hook,
        key_store=tenants.key_store(),
        strategy=strategy,
    )
    async with serve_in_loop(gw) as url:
        yield GatewayHandle(gw, url, tenants, admin)


# ---------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int
    replica: str | None
    error: str | None
    predicted_cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


async def send(
    client: httpx.AsyncClient,
    url: str,
    headers: Mapping[str, str],
    model: str,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    prompt: str | None = None,
    max_tokens: int = 1,
    stream: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> Reply:
    """One chat (``messages``) or completion (``prompt``) request, measured as a client
    sees it: TTFT = time to the first content chunk (``loadtest.replay.send_one``)."""
    item = WorkItem(
        t=0.0,
        api="chat" if messages is not None else "completions",
        max_tokens=max_tokens,
        prompt=prompt,
        messages=tuple(dict(m) for m in messages) if messages is not None else None,
    )
    body = item.body(model, stream)
    body.update(extra or {})
    res = RequestResult(0, item, 0.0)
    await send_one(client, url, model, item, res, headers, stream, body=body)
    return Reply(
        res.status,
        res.ttft_s if res.ttft_s is not None else math.nan,
        res.cached_tokens,
        res.prompt_tokens,
        res.replica,
        res.error,
        res.predicted_cached_tokens,
    )


async def until(
    pred: Callable[[], bool | Awaitable[bool]], timeout_s: float, step_s: float = 0.02
) -> bool:
    """Poll ``pred`` until true or ``timeout_s`` passed (bounded in time and count)."""
    deadline = time.monotonic() + timeout_s
    for _ in range(int(timeout_s / step_s) + 2):
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step_s)
    return False


# ---------------------------------------------------------------------------- engine truth


async def engine_dump(client: httpx.AsyncClient, url: str, timeout_s: float = 10.0) -> Any:
    """The replica's ``/debug/blocks`` once it is idle (no step in flight, nothing queued),
    so the dump reflects every event batch it has published; past ``timeout_s``, the dump
    as it is (the attack then reports what it sees)."""
    try:
        return await dump_when_idle(client, url, timeout_s)
    except ReplicaNotIdleError:
        return (await client.get(f"{url}/debug/blocks")).json()


def engine_salts(dump: Mapping[str, Any]) -> set[str]:
    """Every cache_salt the engine holds blocks under (block 0 extra keys)."""
    out = set()
    for b in dump["blocks"]:
        if b["parent_block_hash"] is None:
            s = salt_from_extra_keys(tuple(b["extra_keys"]) if b["extra_keys"] else None)
            if s is not None:
                out.add(s)
    return out


# ---------------------------------------------------------------------------- event relay


class EventRelay:
    """A man-in-the-middle on one engine's KV-event stream, i.e. an attacker who can publish
    on the node's event network: every engine message is forwarded from the engine's PUB to
    this relay's PUB (which the agent subscribes to), the last ``keep`` are recorded, and
    :meth:`inject` puts arbitrary frames on the wire between them."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str, keep: int = 4096) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.recorded: deque[list[bytes]] = deque(maxlen=keep)
        self.forwarded = 0
        self.injected = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> EventRelay:
        self.pub.bind(self.endpoint)
        self.sub.connect(self.upstream)
        self._task = asyncio.create_task(self._forward(), name="event-relay")
        await asyncio.sleep(0.1)  # ZMQ's slow joiner: let the subscription reach the PUB
        return self

    async def _forward(self) -> None:
        while True:
            frames = await self.sub.recv_multipart()
            self.recorded.append(list(frames))
            await self.pub.send_multipart(frames)
            self.forwarded += 1

    async def inject(self, frames: Sequence[bytes]) -> None:
        await self.pub.send_multipart(list(frames))
        self.injected += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.sub.close(linger=0)
        self.pub.close(linger=0)
