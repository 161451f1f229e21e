"""Attack 1: timing probes (the prefix cache as a side channel).

Design (issue 7, binding): tenant A ("victim") caches N distinct prompts; tenant B
("attacker") sends each of A's system prompts once (with its own question) and N fresh
controls of the same token lengths, interleaved in random order, one request at a time
(a repeat would hit B's own cache). A two-sample Kolmogorov-Smirnov test on B's TTFTs must
NOT tell probes from controls (p > 0.01), while the same probe inside tenant A must
(p < 0.001). A positive control runs the probe across tenants with scoping disabled
(``debug_unsafe_shared_scope``) at the smallest effect the engine can produce: a shared
prefix of exactly one block (16 tokens; a shorter share never hits a block-granular prefix
cache). N is the smallest sample size whose simulated power reaches the target for that
effect (one block's prefill time at the replica's profile and time scale) under the TTFT
noise measured by a pilot of cold requests.

A second instrument times the gateway's own request path (``Gateway.prepare``, no network):
an idealised, noise-free attacker looking for gateway-side caches (the tokenization segment
cache) with long system prompts, with the same three arms.

A p-value at the "must not distinguish" bound can happen by chance (1% of runs under the
null): such a result is replicated once with fresh prompts, and the attack counts as
successful only if the replication distinguishes too (false alarm <= 1e-4; a real one-block
leak, detected with power >= 0.99 at p < 0.001, is detected twice at p <= 0.01 with
probability >= 0.98). A positive control that misses is also retried once before the run is
declared without power.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import numpy as np
from scipy.stats import ks_2samp

from cachecore.engine.latency import get_profile
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
)

VICTIM, ATTACKER = "victim", "attacker"


@dataclass(frozen=True)
class TimingConfig:
    profile: str = "8b-h100"
    time_scale: float = 2.0  # one block = 16 x 0.25 ms x 2 = 8 ms of prefill
    block_size: int = 16
    alpha_detect: float = 0.001  # probes that must distinguish
    alpha_null: float = 0.01  # probes that must not
    power: float = 0.99
    n_min: int = 10  # a floor: one outlier must not decide a test
    n_max: int = 60
    pilot: int = 16
    warmup: int = 4
    power_sims: int = 400
    victim_words: int = 64  # cross/same-tenant probes: A's system prompt
    user_words: int = 8
    pc_words: int = 24  # positive control: system prompt sharing exactly one block
    seed_concurrency: int = 8
    gateway_path_words: int = 1500
    gateway_path_n: int = 30
    seed: int = 0
    # Misconfigure the defended arms (scoping off) to show the suite catches a leak.
    unsafe_shared_scope: bool = False


# ------------------------------------------------------------------------------ power


def ks_test(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(D, p) of ``scipy.stats.ks_2samp``; scipy falls back from the exact p-value to the
    asymptotic one for extreme D at larger n (and warns): either is far below any alpha."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        res = ks_2samp(x, y)
    return float(res.statistic), float(res.pvalue)


def ks_critical_k(n: int, alpha: float) -> int:
    """The smallest k such that two samples of n with KS statistic D = k/n give a
    two-sided exact p-value below ``alpha`` (n + 1 if no D can)."""
    a = np.arange(n, dtype=float)
    for k in range(1, n + 1):
        b = a + k - 0.5  # D(a, b) = k / n exactly
        if ks_test(a.tolist(), b.tolist())[1] < alpha:
            return k
    return n + 1


def ks_statistics(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Row-wise two-sample KS statistics of equal-size samples (shape: sims x n)."""
    n = x.shape[1]
    both = np.concatenate([x, y], axis=1)
    order = np.argsort(both, axis=1, kind="stable")
    steps = np.where(order < n, 1.0 / n, -1.0 / n)
    return np.asarray(np.abs(np.cumsum(steps, axis=1)).max(axis=1))


def smoothed_residuals(noise: Sequence[float]) -> tuple[np.ndarray, float]:
    """Residuals around the median and a Silverman kernel bandwidth, for a smoothed
    bootstrap (no artificial ties from resampling a small pilot)."""
    arr = np.asarray(noise, dtype=float)
    res = arr - np.median(arr)
    sd = float(res.std(ddof=1)) if len(res) > 1 else 0.0
    iqr = float(np.subtract(*np.percentile(res, [75, 25])))
    spread = min(sd, iqr / 1.349) if iqr > 0 else sd
    h = 0.9 * spread * len(res) ** (-0.2)
    return res, h


def ks_power(
    noise: Sequence[float],
    effect_s: float,
    n: int,
    alpha: float,
    sims: int,
    rng: np.random.Generator,
) -> float:
    """Simulated power of the exact KS test at ``alpha`` with n per group, when one
    group's TTFT is shifted by ``effect_s`` and both carry the pilot's noise."""
    res, h = smoothed_residuals(noise)
    k = ks_critical_k(n, alpha)
    if k > n:
        return 0.0
    x = rng.choice(res, (sims, n)) + rng.normal(0.0, h, (sims, n))
    y = rng.choice(res, (sims, n)) + rng.normal(0.0, h, (sims, n)) - effect_s
    d = ks_statistics(x, y)
    return float(np.mean(d >= (k - 1e-9) / n))


@dataclass(frozen=True)
class PowerPlan:
    n: int
    power: float
    effect_s: float
    noise_iqr_s: float
    pilot: int
    alpha: float
    target: float

    def describe(self) -> str:
        return (
            f"N={self.n} per group: the smallest N whose simulated power (smoothed bootstrap of "
            f"{self.pilot} cold pilot TTFTs, IQR {self.noise_iqr_s * 1e3:.1f} ms) to reject at "
            f"p<{self.alpha:g} a one-block hit ({self.effect_s * 1e3:.1f} ms of prefill) "
            f"reaches {self.target:.2f} (got {self.power:.3f})"
        )


def plan_n(
    noise: Sequence[float],
    effect_s: float,
    alpha: float,
    target: float,
    n_min: int,
    n_max: int,
    sims: int,
    seed: int = 0,
) -> PowerPlan:
    """Power calculation: the smallest n in [n_min, n_max] reaching ``target``, or n_max
    with whatever power it has. A linear scan: the exact KS test's power is not monotone
    in n (the critical D = k/n moves in steps), so a bisection could overshoot."""
    rng = np.random.default_rng(seed)
    res = np.asarray(noise, dtype=float)
    iqr = float(np.subtract(*np.percentile(res, [75, 25])))
    power = 0.0
    for n in range(n_min, n_max + 1):
        power = ks_power(noise, effect_s, n, alpha, sims, rng)
        if power >= target:
            return PowerPlan(n, power, effect_s, iqr, len(res), alpha, target)
    return PowerPlan(n_max, power, effect_s, iqr, len(res), alpha, target)


# ------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class Victim:
    system: list[str]
    user: str


class Shape(Protocol):
    @property
    def repeats(self) -> int:
        """How often the victim sends each prompt before the probe."""
        ...

    def victim(self, w: Words) -> Victim: ...
    def probe(self, v: Victim, w: Words) -> list[dict[str, str]]: ...
    def control(self, w: Words) -> list[dict[str, str]]: ...


@dataclass(frozen=True)
class SystemPromptShape:
    """B sends A's whole system prompt with its own question (system prompt extraction).
    A sends it twice, as a system prompt is: a gateway cache that admits on second sight
    would then hold it."""

    system_words: int
    user_words: int
    repeats: int = 2

    def victim(self, w: Words) -> Victim:
        return Victim(w.list(self.system_words), w.text(self.user_words))

    def probe(self, v: Victim, w: Words) -> list[dict[str, str]]:
        return chat_messages(join_words(v.system), w.text(self.user_words))

    def control(self, w: Words) -> list[dict[str, str]]:
        return chat_messages(w.text(self.system_words), w.text(self.user_words))


@dataclass(frozen=True)
class OneBlockShape:
    """B's prompt shares exactly one full block (``block_size`` tokens, template included)
    with A's: the smallest hit a block-granular prefix cache can give."""

    system_words: int
    user_words: int
    shared_words: int
    repeats: int = 1

    def victim(self, w: Words) -> Victim:
        return Victim(w.list(self.system_words), w.text(self.user_words))

    def probe(self, v: Victim, w: Words) -> list[dict[str, str]]:
        own = w.list(self.system_words - self.shared_words)
        while own[0] == v.system[self.shared_words]:
            own = w.list(self.system_words - self.shared_words)
        system = join_words(v.system[: self.shared_words] + own)
        return chat_messages(system, w.text(self.user_words))

    def control(self, w: Words) -> list[dict[str, str]]:
        return chat_messages(w.text(self.system_words), w.text(self.user_words))


def one_block_shape(system_words: int, user_words: int, block_size: int) -> OneBlockShape:
    """Compute how many system words make the shared token prefix exactly one block."""
    tok = builtin_tokenizer()
    w = Words(12345)
    x, y = w.list(system_words), w.list(system_words)
    while x[0] == y[0]:
        y = w.list(system_words)
    user = w.text(user_words)
    a = tok.encode_chat(chat_messages(join_words(x), user))
    b = tok.encode_chat(chat_messages(join_words(y), user))
    head = _common_prefix(a, b)  # template tokens before the system content
    shared = block_size - head
    if not 0 < shared < system_words:
        raise ValueError(f"cannot share exactly one block: template head is {head} tokens")
    shape = OneBlockShape(system_words, user_words, shared)
    v = shape.victim(w)
    probe = tok.encode_chat(shape.probe(v, w))
    victim = tok.encode_chat(chat_messages(join_words(v.system), v.user))
    cp = _common_prefix(probe, victim)
    if cp != block_size:
        raise AssertionError(f"one-block shape shares {cp} tokens, not {block_size}")
    return shape


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ------------------------------------------------------------------------------ probes


@dataclass
class ProbeSample:
    """One probe's TTFTs (seconds) and engine-reported cached tokens."""

    probe: list[float] = field(default_factory=list)
    control: list[float] = field(default_factory=list)
    probe_cached: list[int] = field(default_factory=list)
    control_cached: list[int] = field(default_factory=list)
    errors: int = 0

    @property
    def p(self) -> float:
        if len(self.probe) < 2 or len(self.control) < 2:
            return math.nan
        return ks_test(self.probe, self.control)[1]

    @property
    def d(self) -> float:
        if len(self.probe) < 2 or len(self.control) < 2:
            return math.nan
        return ks_test(self.probe, self.control)[0]

    @property
    def median_diff_ms(self) -> float:
        if not self.probe or not self.control:
            return math.nan
        return float(np.median(self.control) - np.median(self.probe)) * 1e3


class TimingRig:
    """The client side of the timing attacks against one gateway."""

    def __init__(
        self, g: GatewayHandle, http: httpx.AsyncClient, model: str, cfg: TimingConfig, seed: int
    ) -> None:
        self.g = g
        self.http = http
        self.model = model
        self.cfg = cfg
        self.words = Words(seed)
        self.rng = random.Random(seed)

    async def ttft(self, tenant: str, messages: list[dict[str, str]]) -> tuple[float, int]:
        r = await send(
            self.http, self.g.url, self.g.tenants.headers(tenant), self.model, messages=messages
        )
        if not r.ok:
            raise RuntimeError(f"probe request failed: {r.status} {r.error}")
        return r.ttft_s, r.cached_tokens

    async def pilot(self, shape: Shape) -> list[float]:
        """Cold TTFTs of the probe's shape (after a few warm-up requests)."""
        out = []
        for i in range(self.cfg.warmup + self.cfg.pilot):
            t, _ = await self.ttft(ATTACKER, shape.control(self.words))
            if i >= self.cfg.warmup:
                out.append(t)
        return out

    async def seed_victims(self, victim: str, shape: Shape, n: int) -> list[Victim]:
        """The victim's own traffic (not measured): concurrent, each prompt ``repeats``
        times, every round awaited before the next."""
        victims = [shape.victim(self.words) for _ in range(n)]
        gate = asyncio.Semaphore(self.cfg.seed_concurrency)

        async def one(v: Victim) -> None:
            async with gate:
                await self.ttft(victim, chat_messages(join_words(v.system), v.user))

        for _ in range(shape.repeats):
            await asyncio.gather(*(one(v) for v in victims))
        return victims

    async def probe(self, victim: str, attacker: str, shape: Shape, n: int) -> ProbeSample:
        victims = await self.seed_victims(victim, shape, n)
        out = ProbeSample()
        for v in victims:
            pair = [("probe", shape.probe(v, self.words)), ("control", shape.control(self.words))]
            self.rng.shuffle(pair)
            for kind, messages in pair:
                t, cached = await self.ttft(attacker, messages)
                if kind == "probe":
                    out.probe.append(t)
                    out.probe_cached.append(cached)
                else:
                    out.control.append(t)
                    out.control_cached.append(cached)
        return out

    async def gateway_path(self, victim: str, attacker: str, n: int) -> ProbeSample:
        """Time ``Gateway.prepare`` (tokenize, keys, lookup, route; nothing sent) for the
        attacker's probes of the victim's long system prompts against fresh controls."""
        gw = self.g.gw
        shape = SystemPromptShape(self.cfg.gateway_path_words, self.cfg.user_words)
        victims = [shape.victim(self.words) for _ in range(n)]

        async def prepare(tenant: str, messages: list[dict[str, str]]) -> float:
            body = {"model": self.model, "messages": messages, "max_tokens": 1}
            t0 = time.perf_counter()
            await gw.prepare("chat", tenant, body, {}, "attack", explain_only=True)
            return time.perf_counter() - t0

        for _ in range(shape.repeats):
            for v in victims:
                await prepare(victim, chat_messages(join_words(v.system), v.user))
        for _ in range(4):  # warm-up
            await prepare(attacker, shape.control(self.words))
        out = ProbeSample()
        for v in victims:
            pair = [("probe", shape.probe(v, self.words)), ("control", shape.control(self.words))]
            self.rng.shuffle(pair)
            for kind, messages in pair:
                t = await prepare(attacker, messages)
                (out.probe if kind == "probe" else out.control).append(t)
        return out


# ------------------------------------------------------------------------------ the attack


@dataclass
class PathArms:
    """One gateway-path instrument's three arms (each a probe and maybe its replication)."""

    cross: list[ProbeSample]
    same: list[ProbeSample]
    positive: list[ProbeSample]


@dataclass
class TimingReport:
    plan: PowerPlan
    cross: list[ProbeSample]
    same: list[ProbeSample]
    positive: list[ProbeSample]
    path: PathArms  # the gateway's own tokenizer (its segment cache)
    engine_path: PathArms  # a pool tokenized by the engine (the replica's render cache)
    wall_s: float


ENGINE_RENDER_POLICY = "models: {default: {tokenizer: engine_render}}"


async def _null_probe(run: Probe, alpha: float) -> list[ProbeSample]:
    first = await run()
    if not first.p <= alpha:
        return [first]
    return [first, await run()]  # a replication with fresh prompts


async def _detect_probe(run: Probe, alpha: float) -> list[ProbeSample]:
    first = await run()
    if first.p < alpha:
        return [first]
    return [first, await run()]


class Probe(Protocol):
    async def __call__(self) -> ProbeSample: ...


async def measure(cfg: TimingConfig) -> TimingReport:
    t0 = time.perf_counter()
    profile = get_profile(cfg.profile)
    effect = cfg.block_size * profile.prefill_per_token_s * cfg.time_scale
    tenants = Tenants.make(VICTIM, ATTACKER)
    replica = ReplicaSettings(
        profile=cfg.profile, time_scale=cfg.time_scale, block_size=cfg.block_size
    )
    full = SystemPromptShape(cfg.victim_words, cfg.user_words)
    pc = one_block_shape(cfg.pc_words, cfg.user_words, cfg.block_size)
    async with run_fleet(replica, count=1) as fleet, httpx.AsyncClient(timeout=60) as http:
        model = fleet.endpoints[0].model
        async with running_gateway(
            fleet.urls, tenants, seed=cfg.seed, debug_shared_scope=cfg.unsafe_shared_scope
        ) as g:
            rig = TimingRig(g, http, model, cfg, cfg.seed)
            noise = await rig.pilot(pc)
            plan = plan_n(
                noise, effect, cfg.alpha_detect, cfg.power, cfg.n_min, cfg.n_max,
                cfg.power_sims, cfg.seed,
            )  # fmt: skip
            n = plan.n

            async def cross() -> ProbeSample:
                return await rig.probe(VICTIM, ATTACKER, full, n)

            async def same() -> ProbeSample:
                return await rig.probe(VICTIM, VICTIM, full, n)

            r_cross = await _null_probe(cross, cfg.alpha_null)
            r_same = await _detect_probe(same, cfg.alpha_detect)
        path = await _path_arms(fleet.urls, tenants, http, model, cfg, None, 1)
        # the same instrument when the engine tokenizes: the replica's render cache is then
        # on the request path, so it must be scoped like the gateway's (by the salt)
        engine = await _path_arms(fleet.urls, tenants, http, model, cfg, ENGINE_RENDER_POLICY, 3)
        async with running_gateway(fleet.urls, tenants, debug_shared_scope=True) as g:
            rig = TimingRig(g, http, model, cfg, cfg.seed + 5)

            async def positive() -> ProbeSample:
                return await rig.probe(VICTIM, ATTACKER, pc, n)

            r_pos = await _detect_probe(positive, cfg.alpha_detect)
    return TimingReport(
        plan, r_cross, r_same, r_pos, path, engine, time.perf_counter() - t0
    )  # fmt: skip


async def _path_arms(
    urls: Sequence[str],
    tenants: Tenants,
    http: httpx.AsyncClient,
    model: str,
    cfg: TimingConfig,
    policy: str | None,
    seed_offset: int,
) -> PathArms:
    """The gateway-path probe across tenants and inside one (under ``cfg``'s scoping), then
    with scoping off (the positive control), each through its own gateway."""
    n = cfg.gateway_path_n
    async with running_gateway(
        urls, tenants, policy=policy, seed=cfg.seed,
        debug_shared_scope=cfg.unsafe_shared_scope,
    ) as g:  # fmt: skip
        rig = TimingRig(g, http, model, cfg, cfg.seed + seed_offset)

        async def cross() -> ProbeSample:
            return await rig.gateway_path(VICTIM, ATTACKER, n)

        async def same() -> ProbeSample:
            return await rig.gateway_path(VICTIM, VICTIM, n)

        r_cross = await _null_probe(cross, cfg.alpha_null)
        r_same = await _detect_probe(same, cfg.alpha_detect)
    async with running_gateway(urls, tenants, policy=policy, debug_shared_scope=True) as g:
        rig = TimingRig(g, http, model, cfg, cfg.seed + seed_offset + 1)

        async def positive() -> ProbeSample:
            return await rig.gateway_path(VICTIM, ATTACKER, n)

        r_pos = await _detect_probe(positive, cfg.alpha_detect)
    return PathArms(r_cross, r_same, r_pos)


def _ps(samples: Sequence[ProbeSample]) -> str:
    return " then ".join(fmt_p(s.p) for s in samples)


def results(rep: TimingReport, cfg: TimingConfig) -> list[AttackResult]:
    n = rep.plan.n
    trials = f"2x{n} (N by power calc)"
    cross, same, pos = rep.cross[-1], rep.same[-1], rep.positive[-1]
    cross_broken = all(s.p <= cfg.alpha_null for s in rep.cross)
    rows = [
        AttackResult(
            "1 timing: B probes A's cached prompts (engine TTFT)",
            trials,
            Outcome.BROKEN if cross_broken else Outcome.HELD,
            f"KS p={_ps(rep.cross)} (must be > {cfg.alpha_null:g}), D={cross.d:.2f}, "
            f"median control-probe {cross.median_diff_ms:+.1f} ms, "
            f"probe cached tokens {sum(cross.probe_cached)}",
            {"plan": rep.plan.describe()},
        ),
        AttackResult(
            "1 timing: same probe inside tenant A (power)",
            trials,
            Outcome.HELD if same.p < cfg.alpha_detect else Outcome.NO_POWER,
            f"KS p={_ps(rep.same)} (must be < {cfg.alpha_detect:g}), "
            f"median control-probe {same.median_diff_ms:+.1f} ms",
        ),
        AttackResult(
            "1 timing: positive control, scoping off, 1 shared block",
            trials,
            Outcome.HELD if pos.p < cfg.alpha_detect else Outcome.NO_POWER,
            f"KS p={_ps(rep.positive)} (must be < {cfg.alpha_detect:g}), "
            f"median control-probe {pos.median_diff_ms:+.1f} ms "
            f"(model {rep.plan.effect_s * 1e3:.1f} ms), "
            f"probe cached tokens {min(pos.probe_cached)}-{max(pos.probe_cached)}",
        ),
    ]
    words = cfg.gateway_path_words
    rows.append(_path_row(f"1 timing: gateway path, {words}-token system prompts", rep.path, cfg))
    rows.append(
        _path_row(
            f"1 timing: engine-tokenized path (engine_render), {words}-token system prompts",
            rep.engine_path,
            cfg,
        )
    )
    return rows


def _path_row(title: str, arms: PathArms, cfg: TimingConfig) -> AttackResult:
    pc, ps, pp = arms.cross[-1], arms.same[-1], arms.positive[-1]
    if all(s.p <= cfg.alpha_null for s in arms.cross):
        outcome = Outcome.BROKEN
    elif ps.p < cfg.alpha_detect and pp.p < cfg.alpha_detect:
        outcome = Outcome.HELD
    else:
        outcome = Outcome.NO_POWER
    return AttackResult(
        title,
        f"3 x 2x{cfg.gateway_path_n}",
        outcome,
        f"cross-tenant p={_ps(arms.cross)} ({pc.median_diff_ms * 1e3:+.0f} us); "
        f"same-tenant p={_ps(arms.same)} ({ps.median_diff_ms * 1e3:+.0f} us); "
        f"scoping off p={_ps(arms.positive)} ({pp.median_diff_ms * 1e3:+.0f} us)",
    )


async def run_timing(cfg: TimingConfig | None = None) -> tuple[list[AttackResult], TimingReport]:
    cfg = cfg or TimingConfig()
    rep = await measure(cfg)
    return results(rep, cfg), rep
