"""Attack 4: salt spoofing (a client-supplied ``cache_salt`` must have no effect).

vLLM partitions its prefix cache by ``cache_salt`` (block 0's extra key), so whoever sets the
salt chooses whose cache a request may hit. Here the attacker (tenant B) knows the victim's
real salt, which is the worst case (in practice it is an HMAC of the scope under a server
secret and never leaves the gateway; the attack reads it from the engine's own block dump),
and sends A's cached system prompts through the gateway with that salt. Every one must miss
(engine-reported ``cached_tokens`` 0, and the gateway predicts 0).

The positive control sends the same spoof straight to the engine, bypassing the gateway,
afterwards: it must hit on every prompt, which proves the victim's blocks were there to be
stolen and the salt alone would have unlocked them.

Besides, with fresh prompts: attacker-chosen salts (free text, the ephemeral-scope prefix,
an oversized string, non-string JSON values) must neither fail the request nor put any
block under a salt the gateway did not mint; and the victim's own requests carrying random
salts must still hit the victim's cache (the salt did not partition it either).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from cachecore.agent.embedded import start_embedded_agents
from cachecore.keys import EPHEMERAL_SALT_PREFIX
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import ReplicaSettings
from loadtest.attacks.common import (
    AttackResult,
    Outcome,
    Tenants,
    Words,
    chat_messages,
    engine_dump,
    engine_salts,
    running_gateway,
    send,
)

VICTIM, ATTACKER = "victim", "attacker"


@dataclass(frozen=True)
class SpoofConfig:
    time_scale: float = 0.05
    prompts: int = 8
    system_words: int = 96
    user_words: int = 8
    seed: int = 0
    unsafe_shared_scope: bool = False  # misconfigure the gateway (suite self-test)


def odd_salts() -> list[tuple[str, Any]]:
    """Client salts an attacker may try, each with a label."""
    return [
        ("free text", "attacker-chosen-salt"),
        ("ephemeral prefix", EPHEMERAL_SALT_PREFIX + secrets.token_hex(32)),
        ("kvgate prefix", "kvg1:" + secrets.token_hex(32)),
        ("4 KiB string", "x" * 4096),
        ("integer", 12345),
        ("list", ["a", "b"]),
        ("object", {"salt": "a"}),
        ("null", None),
        ("empty", ""),
    ]


@dataclass
class SpoofReport:
    victim_salts: set[str]
    minted_salts: set[str]
    gateway_cached: list[int] = field(default_factory=list)
    gateway_predicted: list[int] = field(default_factory=list)
    gateway_errors: list[str] = field(default_factory=list)
    direct_cached: list[int] = field(default_factory=list)
    direct_shared_tokens: list[int] = field(default_factory=list)
    odd_status: dict[str, int] = field(default_factory=dict)
    odd_cached: dict[str, int] = field(default_factory=dict)
    foreign_salts: set[str] = field(default_factory=set)
    victim_salted_cached: list[int] = field(default_factory=list)
    wall_s: float = 0.0


async def measure(cfg: SpoofConfig) -> SpoofReport:
    t0 = time.perf_counter()
    tenants = Tenants.make(VICTIM, ATTACKER)
    words = Words(cfg.seed)
    settings = ReplicaSettings(time_scale=cfg.time_scale)
    async with run_fleet(settings, count=1) as fleet, httpx.AsyncClient(timeout=60) as http:
        ep = fleet.endpoints[0]
        model = ep.model
        spec = f"{ep.url}={ep.events_endpoint},{ep.replay_endpoint}"
        async with running_gateway(
            [spec], tenants, seed=cfg.seed, agent_hook=start_embedded_agents,
            debug_shared_scope=cfg.unsafe_shared_scope,
        ) as g:  # fmt: skip
            a_hdr, b_hdr = tenants.headers(VICTIM), tenants.headers(ATTACKER)
            systems = [words.text(cfg.system_words) for _ in range(cfg.prompts)]
            for s in systems:  # the victim's traffic: one replica, so it is all cached there
                r = await send(
                    http, g.url, a_hdr, model, messages=chat_messages(s, words.text(cfg.user_words))
                )
                if not r.ok:
                    raise RuntimeError(f"victim request failed: {r.status} {r.error}")
            victim_salts = engine_salts(await engine_dump(http, ep.url))
            if len(victim_salts) != 1:
                raise RuntimeError(f"expected one victim salt on the engine, saw {victim_salts}")
            salt_a = next(iter(victim_salts))
            r = await send(  # the attacker's own scope, for the set of salts the gateway mints
                http, g.url, b_hdr, model,
                messages=chat_messages(words.text(cfg.system_words), words.text(cfg.user_words)),
            )  # fmt: skip
            minted = engine_salts(await engine_dump(http, ep.url))
            rep = SpoofReport(victim_salts, minted)

            questions = [words.text(cfg.user_words) for _ in systems]
            for s, q in zip(systems, questions, strict=True):
                r = await send(
                    http, g.url, b_hdr, model, messages=chat_messages(s, q),
                    extra={"cache_salt": salt_a},
                )  # fmt: skip
                if not r.ok:
                    rep.gateway_errors.append(f"{r.status} {r.error}")
                rep.gateway_cached.append(r.cached_tokens)
                rep.gateway_predicted.append(r.predicted_cached_tokens or 0)

            for label, salt in odd_salts():
                fresh = chat_messages(words.text(cfg.system_words), words.text(cfg.user_words))
                r = await send(
                    http, g.url, b_hdr, model, messages=fresh, extra={"cache_salt": salt}
                )
                rep.odd_status[label] = r.status
                rep.odd_cached[label] = r.cached_tokens

            for s in systems:  # the victim's own reuse must ignore a client salt too
                r = await send(
                    http, g.url, a_hdr, model,
                    messages=chat_messages(s, words.text(cfg.user_words)),
                    extra={"cache_salt": secrets.token_hex(16)},
                )  # fmt: skip
                rep.victim_salted_cached.append(r.cached_tokens if r.ok else -1)

            rep.foreign_salts = engine_salts(await engine_dump(http, ep.url)) - minted

            # Positive control, last: the same spoof without the gateway must hit.
            for s, q in zip(systems, questions, strict=True):
                r = await send(
                    http, ep.url, {}, model, messages=chat_messages(s, q),
                    extra={"cache_salt": salt_a},
                )  # fmt: skip
                rep.direct_cached.append(r.cached_tokens if r.ok else -1)
    rep.wall_s = time.perf_counter() - t0
    return rep


def results(rep: SpoofReport, cfg: SpoofConfig) -> list[AttackResult]:
    n = cfg.prompts
    stolen = sum(1 for c in rep.gateway_cached if c > 0)
    predicted = sum(1 for c in rep.gateway_predicted if c > 0)
    odd_failed = {k: v for k, v in rep.odd_status.items() if v != 200}
    odd_hits = {k: v for k, v in rep.odd_cached.items() if v > 0}
    victim_hits = sum(1 for c in rep.victim_salted_cached if c > 0)
    direct_hits = sum(1 for c in rep.direct_cached if c > 0)
    broken = (
        stolen > 0
        or predicted > 0
        or bool(rep.gateway_errors)
        or bool(odd_failed)
        or bool(odd_hits)
        or bool(rep.foreign_salts)
        or victim_hits < n
    )
    if broken:
        outcome = Outcome.BROKEN
    elif direct_hits < n:
        outcome = Outcome.NO_POWER
    else:
        outcome = Outcome.HELD
    figures = (
        f"B with A's real salt via gateway: {stolen}/{n} hits, cached tokens "
        f"{sum(rep.gateway_cached)}, predicted {sum(rep.gateway_predicted)}; "
        f"same spoof direct to the engine (control): {direct_hits}/{n} hits, "
        f"{min(rep.direct_cached, default=0)}-{max(rep.direct_cached, default=0)} cached tokens; "
        f"{len(rep.odd_status)} odd salts: {len(rep.odd_status) - len(odd_failed)} served 200, "
        f"{len(odd_hits)} hit, {len(rep.foreign_salts)} client salts reached the engine; "
        f"A with random salts still hits its cache {victim_hits}/{n}"
    )
    if odd_failed:
        figures += f"; failed: {odd_failed}"
    return [
        AttackResult(
            "4 salt spoofing: client cache_salt (incl. A's real one)",
            f"{n} spoofs + {n} controls + {len(rep.odd_status)} odd + {n} own",
            outcome,
            figures,
            {"gateway_errors": rep.gateway_errors},
        )
    ]


async def run_spoofing(cfg: SpoofConfig | None = None) -> tuple[list[AttackResult], SpoofReport]:
    cfg = cfg or SpoofConfig()
    rep = await measure(cfg)
    return results(rep, cfg), rep
