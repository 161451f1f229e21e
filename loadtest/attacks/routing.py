"""Attack 2: the routing probe (does B's routing depend on A's prompts?).

Tenant A sends N distinct prompts through the gateway; each lands on some replica (its
"home", read from ``x-kvgate-replica``), and the embedded agents index it there from the
engine's real KV events. Tenant B then sends, one at a time and interleaved in random
order, each of A's prompts with its own question and a fresh control of the same shape, and
reads which replica served it. Under isolation B's probes land on A's home replica exactly
as often as B's controls land on that same (unrelated) replica: about 1/R. Fisher's exact
test on the 2x2 table (probe/control x on-home/elsewhere) must not tell them apart
(p > 0.01); with scoping disabled (``debug_unsafe_shared_scope``) and a shared prefix of only
one block, it must (p < 0.001). N is the smallest count whose exact power reaches the target
when a leaking router sends >= 90% of probes home and controls land home at 1/R.

As a second, direct check, the gateway's own decision for each of B's probes (admin
explain) must show no matched block on any replica.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from scipy.stats import binom, fisher_exact, hypergeom

from cachecore.agent.embedded import start_embedded_agents
from cachecore.replica.fleet import run_fleet
from cachecore.replica.settings import ReplicaSettings
from cachecore.tokenizer import builtin_tokenizer
from loadtest.attacks.common import (
    AttackResult,
    GatewayHandle,
    Outcome,
    Tenants,
    Words,
    chat_messages,
    fmt_p,
    join_words,
    running_gateway,
    send,
    until,
)
from loadtest.attacks.timing import OneBlockShape, Shape, SystemPromptShape, one_block_shape

VICTIM, ATTACKER = "victim", "attacker"


@dataclass(frozen=True)
class RoutingConfig:
    replicas: int = 4
    time_scale: float = 0.05
    alpha_detect: float = 0.001
    alpha_null: float = 0.01
    power: float = 0.99
    leak_rate: float = 0.9  # a leaking router sends at least this share of probes home
    n_min: int = 10
    n_max: int = 60
    victim_words: int = 96
    user_words: int = 8
    pc_words: int = 24
    seed: int = 0
    unsafe_shared_scope: bool = False  # misconfigure the defended arm (suite self-test)


def fisher_p(probe_home: int, control_home: int, n: int) -> float:
    table = [[probe_home, n - probe_home], [control_home, n - control_home]]
    return float(fisher_exact(table).pvalue)


def fisher_p_table(n: int) -> np.ndarray:
    """``P[k1, k0]``: the two-sided Fisher exact p-value of the table
    ``[[k1, n - k1], [k0, n - k0]]`` for every k1, k0 in 0..n, computed as scipy does (sum
    of the hypergeometric probabilities not above the observed one, relative tolerance
    1e-7), one margin at a time (vectorised; ``fisher_exact`` per table is ~0.5 ms)."""
    out = np.ones((n + 1, n + 1))
    for total in range(2 * n + 1):
        lo, hi = max(0, total - n), min(n, total)
        k1 = np.arange(lo, hi + 1)
        pmf = hypergeom.pmf(k1, 2 * n, total, n)
        p = np.array([pmf[pmf <= v * (1 + 1e-7)].sum() for v in pmf])
        out[k1, total - k1] = np.minimum(1.0, p)
    return out


def fisher_power(n: int, p1: float, p0: float, alpha: float) -> float:
    """Exact power of the two-sided Fisher test at ``alpha``: probes home ~ Bin(n, p1),
    controls home ~ Bin(n, p0)."""
    k = np.arange(n + 1)
    weights = np.outer(binom.pmf(k, n, p1), binom.pmf(k, n, p0))
    return float(weights[fisher_p_table(n) < alpha].sum())


def plan_routing_n(cfg: RoutingConfig) -> tuple[int, float]:
    p0 = 1.0 / cfg.replicas
    for n in range(cfg.n_min, cfg.n_max + 1):
        pw = fisher_power(n, cfg.leak_rate, p0, cfg.alpha_detect)
        if pw >= cfg.power:
            return n, pw
    return cfg.n_max, fisher_power(cfg.n_max, cfg.leak_rate, p0, cfg.alpha_detect)


@dataclass
class RoutingSample:
    n: int = 0
    probe_home: int = 0
    control_home: int = 0
    matched_blocks: int = 0  # what the gateway's decisions for B's probes matched (explain)
    homes: list[str] = field(default_factory=list)

    @property
    def p(self) -> float:
        return fisher_p(self.probe_home, self.control_home, self.n) if self.n else math.nan


async def _probe(
    g: GatewayHandle,
    http: httpx.AsyncClient,
    model: str,
    shape: Shape,
    n: int,
    seed: int,
) -> RoutingSample:
    words, rng = Words(seed), random.Random(seed)
    tok = builtin_tokenizer()
    gw = g.gw
    index = gw.index
    assert index is not None
    out = RoutingSample(n=n)
    victims = [shape.victim(words) for _ in range(n)]
    indexable = 0
    before = (await index.primary.stats()).stored_entries
    for v in victims:
        messages = chat_messages(join_words(v.system), v.user)
        r = await send(http, g.url, g.tenants.headers(VICTIM), model, messages=messages)
        if not r.ok or r.replica is None:
            raise RuntimeError(f"victim request failed: {r.status} {r.error}")
        out.homes.append(r.replica)
        indexable += len(tok.encode_chat(messages)) // 16

    async def indexed() -> bool:
        return (await index.primary.stats()).stored_entries >= before + indexable

    if not await until(indexed, 10.0):
        raise RuntimeError("the agents did not index the victim's prompts within 10 s")
    for v, home in zip(victims, out.homes, strict=True):
        pair = [("probe", shape.probe(v, words)), ("control", shape.control(words))]
        rng.shuffle(pair)
        for kind, messages in pair:
            if kind == "probe":
                body = {"model": model, "messages": messages, "max_tokens": 1}
                d = await gw.prepare("chat", ATTACKER, body, {}, "explain", explain_only=True)
                out.matched_blocks += sum(s.matched_blocks for s in d.decision.scores)
            r = await send(http, g.url, g.tenants.headers(ATTACKER), model, messages=messages)
            if not r.ok:
                raise RuntimeError(f"attacker request failed: {r.status} {r.error}")
            if r.replica == home:
                if kind == "probe":
                    out.probe_home += 1
                else:
                    out.control_home += 1
    return out


@dataclass
class RoutingReport:
    n: int
    power: float
    cross: list[RoutingSample]
    positive: list[RoutingSample]
    wall_s: float


async def measure(cfg: RoutingConfig) -> RoutingReport:
    t0 = time.perf_counter()
    n, power = plan_routing_n(cfg)
    tenants = Tenants.make(VICTIM, ATTACKER)
    full: Shape = SystemPromptShape(cfg.victim_words, cfg.user_words, repeats=1)
    pc: OneBlockShape = one_block_shape(cfg.pc_words, cfg.user_words, 16)
    settings = ReplicaSettings(time_scale=cfg.time_scale)
    async with (
        run_fleet(settings, count=cfg.replicas) as fleet,
        httpx.AsyncClient(timeout=60) as http,
    ):
        model = fleet.endpoints[0].model
        specs = [f"{e.url}={e.events_endpoint},{e.replay_endpoint}" for e in fleet.endpoints]
        cross: list[RoutingSample] = []
        async with running_gateway(
            specs, tenants, seed=cfg.seed, agent_hook=start_embedded_agents,
            debug_shared_scope=cfg.unsafe_shared_scope,
        ) as g:  # fmt: skip
            cross.append(await _probe(g, http, model, full, n, cfg.seed))
            if cross[0].p <= cfg.alpha_null:  # replicate once before calling it a leak
                cross.append(await _probe(g, http, model, full, n, cfg.seed + 100))
        positive: list[RoutingSample] = []
        async with running_gateway(
            specs, tenants, seed=cfg.seed, agent_hook=start_embedded_agents,
            debug_shared_scope=True,
        ) as g:  # fmt: skip
            positive.append(await _probe(g, http, model, pc, n, cfg.seed + 1))
            if not positive[0].p < cfg.alpha_detect:
                positive.append(await _probe(g, http, model, pc, n, cfg.seed + 101))
    return RoutingReport(n, power, cross, positive, time.perf_counter() - t0)


def _ps(samples: Sequence[RoutingSample]) -> str:
    return " then ".join(fmt_p(s.p) for s in samples)


def results(rep: RoutingReport, cfg: RoutingConfig) -> list[AttackResult]:
    c, pc = rep.cross[-1], rep.positive[-1]
    broken = all(s.p <= cfg.alpha_null for s in rep.cross) or any(
        s.matched_blocks > 0 for s in rep.cross
    )
    trials = f"2x{rep.n} (N by power calc), {cfg.replicas} replicas"
    return [
        AttackResult(
            "2 routing: B's replica for A's prefixes vs random",
            trials,
            Outcome.BROKEN if broken else Outcome.HELD,
            f"on A's replica: probes {c.probe_home}/{c.n}, controls {c.control_home}/{c.n}; "
            f"Fisher p={_ps(rep.cross)} (must be > {cfg.alpha_null:g}); "
            f"matched blocks in B's decisions {sum(s.matched_blocks for s in rep.cross)}",
            {"power": rep.power},
        ),
        AttackResult(
            "2 routing: positive control, scoping off, 1 shared block",
            trials,
            Outcome.HELD if pc.p < cfg.alpha_detect else Outcome.NO_POWER,
            f"on A's replica: probes {pc.probe_home}/{pc.n}, controls {pc.control_home}/{pc.n}; "
            f"Fisher p={_ps(rep.positive)} (must be < {cfg.alpha_detect:g}); "
            f"exact power {rep.power:.3f} at a {cfg.leak_rate:.0%} leak",
        ),
    ]


async def run_routing(cfg: RoutingConfig | None = None) -> tuple[list[AttackResult], RoutingReport]:
    cfg = cfg or RoutingConfig()
    rep = await measure(cfg)
    return results(rep, cfg), rep
