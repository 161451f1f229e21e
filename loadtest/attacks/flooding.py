"""Attack 6: cache flooding by one tenant.

Victim tenants reuse a few long system prompts; a flooding tenant sends unique long prompts
as fast as the gateway lets it, to flush everyone's prefixes out of the engines' caches
(vLLM has no per-tenant quota: whatever reaches an engine competes for its LRU). The
victims' engine-reported token hit rate is measured without the flood, with the flood and
the gateway's defence, and with the flood and no defence (the contrast). The defence holds
when the victims' hit rate under the flood stays within ``bound`` (absolute) of their
no-flood hit rate.

The defence acts on what reaches the engines, as policy limits every tenant gets:
``uncached_tokens_per_s`` (a token bucket charged with each request's predicted uncached
prefill, so cache hits are cheap and unique long prompts run out) and
``cold_replica_count`` (a tenant's cold requests are confined to a stable subset of the
replicas, so one tenant can flush at most that share of the fleet's cache).

Real components: simulated replicas with small KV caches, embedded agents, the real gateway,
open-loop replay (``loadtest.replay``) of the ``cache-flood`` workload
(``loadtest.workloads.cache_flood``). Every run starts from the same state: the engines'
caches flushed and a gateway of its own (a fresh index and router, the same seed).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from cachecore.agent.embedded import start_embedded_agents
from cachecore.agent.expect import expected_keys
from cachecore.keys import BlockKey
from cachecore.replica.fleet import Fleet, run_fleet
from cachecore.replica.settings import ReplicaSettings
from loadtest.attacks.common import (
    AttackResult,
    GatewayHandle,
    Outcome,
    Tenants,
    engine_dump,
    running_gateway,
    until,
)
from loadtest.replay import replay
from loadtest.workloads import TextSource, Workload, cache_flood

VICTIMS = ("acme", "globex")
FLOODER = "mallory"


@dataclass(frozen=True)
class FloodConfig:
    replicas: int = 4
    num_blocks: int = 256  # 4,096 tokens per replica: the flood fills it in 4 requests
    time_scale: float = 0.05
    profile: str = "8b-h100-fast"
    duration_s: float = 3.0
    prefixes_per_tenant: int = 3
    prefix_tokens: int = 512
    victim_rate: float = 24.0  # enough victim requests that one miss moves the rate ~1 pt
    flood_rate: float = 40.0
    flood_tokens: int = 1024
    uncached_tokens_per_s: int = 2048  # two floods/s: a 4,096-token cache turns over in 2 s
    uncached_tokens_burst: int = 4096
    cold_replica_count: int = 2
    bound: float = 0.10  # victims' hit rate may drop at most this much (absolute)
    seed: int = 0

    defences: tuple[str, ...] = ("budget+confine",)  # full runs add "budget", "confine"
    claimed: str = "budget+confine"  # the defence the bound is stated for (docs/security.md)

    def policy(self, defence: str) -> str:
        """The policy of one defence: limits for every tenant (any tenant may flood)."""
        limits = []
        if "budget" in defence:
            limits += [
                f"uncached_tokens_per_s: {self.uncached_tokens_per_s}",
                f"uncached_tokens_burst: {self.uncached_tokens_burst}",
            ]
        if "confine" in defence:
            limits.append(f"cold_replica_count: {self.cold_replica_count}")
        return "default_tenant:\n  limits: {" + ", ".join(limits) + "}\n"


UNDEFENDED = "default_tenant: {limits: {}}\n"


@dataclass
class FloodRun:
    label: str
    victim_hit_rate: float
    victim_requests: int
    victim_errors: int
    flood_sent: int = 0
    flood_admitted: int = 0
    flood_replicas: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0


async def _flush(fleet: Fleet, http: httpx.AsyncClient) -> None:
    """Empty every engine cache (before a run's gateway starts)."""
    for url in fleet.urls:
        for _ in range(100):  # bounded: 5 s until no request holds blocks
            if (await http.post(f"{url}/flush_cache")).status_code == 200:
                break
            await asyncio.sleep(0.05)


async def _indexed(g: GatewayHandle, http: httpx.AsyncClient, model: str) -> bool:
    """Until the gateway's index holds exactly the blocks every engine caches (10 s at most):
    a run's agents start with its gateway, so the warm-up must be in the index before the
    measured requests are routed, or they are routed as misses."""
    index = g.gw.index
    assert index is not None
    for spec in g.gw.specs:
        want = expected_keys(await engine_dump(http, spec.url), model)

        async def caught_up(rid: str = spec.id, want: set[BlockKey] = want) -> bool:
            return set((await index.primary.replica_blocks(rid)).keys()) == want

        if not await until(caught_up, 10.0):
            return False
    return True


async def _run(
    g: GatewayHandle, fleet: Fleet, http: httpx.AsyncClient, w: Workload, label: str
) -> FloodRun:
    model = fleet.endpoints[0].model
    keys = dict(g.tenants.keys)
    warm = Workload("warmup", tuple(w.meta["warmup"]), tenants=VICTIMS)
    await replay(warm, g.url, model, keys, stream=False, client=http)
    if not await _indexed(g, http, model):
        raise RuntimeError(f"{label}: the index did not match the engines after the warm-up")
    t0 = time.perf_counter()
    rep = await replay(w, g.url, model, keys, stream=False, client=http)
    victim = [r for r in rep.results if r.item.tenant in VICTIMS]
    ok = [r for r in victim if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    flood = [r for r in rep.results if r.item.tenant == FLOODER]
    admitted = [r for r in flood if r.ok]
    return FloodRun(
        label,
        cached / prompt if prompt else 0.0,
        len(victim),
        len(victim) - len(ok),
        len(flood),
        len(admitted),
        Counter(r.replica for r in admitted if r.replica),
        time.perf_counter() - t0,
    )


@dataclass
class FloodReport:
    runs: list[FloodRun]
    wall_s: float


async def measure(cfg: FloodConfig) -> FloodReport:
    t0 = time.perf_counter()
    text = TextSource()
    tenants = Tenants.make(*VICTIMS, FLOODER)
    settings = ReplicaSettings(
        time_scale=cfg.time_scale, num_blocks=cfg.num_blocks, profile=cfg.profile
    )

    def workload(flood: bool, seed: int) -> Workload:
        return cache_flood(
            text,
            duration_s=cfg.duration_s,
            victims=VICTIMS,
            prefixes_per_tenant=cfg.prefixes_per_tenant,
            prefix_tokens=cfg.prefix_tokens,
            victim_rate=cfg.victim_rate,
            flood_tenant=FLOODER,
            flood_rate=cfg.flood_rate,
            flood_tokens=cfg.flood_tokens,
            flood=flood,
            seed=seed,
        )

    runs: list[FloodRun] = []
    async with (
        run_fleet(settings, count=cfg.replicas) as fleet,
        httpx.AsyncClient(timeout=60) as http,
    ):
        specs = [f"{e.url}={e.events_endpoint},{e.replay_endpoint}" for e in fleet.endpoints]
        plan = [
            ("no flood", False, UNDEFENDED),
            *((f"flood, {d}", True, cfg.policy(d)) for d in cfg.defences),
            ("flood, no defence", True, UNDEFENDED),
        ]
        for label, flood, policy in plan:
            await _flush(fleet, http)
            # a gateway of its own per run (same seed, fresh index and router): the router
            # remembers where each tenant's cold data went (D14's scope trees), so after
            # the confined run the undefended flood went mostly to the two replicas the
            # confinement had spared (102/102/18/18 of 240) and the victims kept their
            # hits on the other two (docs/benchmarks.md, "Twenty-sixth session")
            async with running_gateway(
                specs,
                tenants,
                policy=policy,
                seed=cfg.seed,
                agent_hook=start_embedded_agents,
            ) as g:
                # one seed for every run: the same victims' requests with and without the
                # flood, the same flood under each defence and none (a paired comparison;
                # a seed per run made the undefended contrast a draw of its own workload)
                runs.append(await _run(g, fleet, http, workload(flood, cfg.seed), label))
    return FloodReport(runs, time.perf_counter() - t0)


def results(rep: FloodReport, cfg: FloodConfig) -> list[AttackResult]:
    base, open_ = rep.runs[0], rep.runs[-1]
    drop_open = base.victim_hit_rate - open_.victim_hit_rate
    rows = []
    for defence, run in zip(cfg.defences, rep.runs[1:-1], strict=True):
        drop = base.victim_hit_rate - run.victim_hit_rate
        ok = drop <= cfg.bound and run.victim_errors == 0
        note = ""
        if defence != cfg.claimed:
            outcome = Outcome.ABLATION  # reported beside the claim, never judged
            note = f"; within the bound: {'yes' if ok else 'no'}"
        elif not ok:
            outcome = Outcome.BROKEN
        elif drop_open <= cfg.bound:  # the undefended flood must hurt, or this proves nothing
            outcome = Outcome.NO_POWER
        else:
            outcome = Outcome.HELD
        rows.append(
            AttackResult(
                f"6 cache flooding by {FLOODER}, defence {defence}",
                f"{cfg.duration_s:g} s runs: {base.victim_requests} victim + "
                f"{run.flood_sent} flood req",
                outcome,
                f"victims' hit rate: no flood {base.victim_hit_rate:.1%}; flood + defence "
                f"{run.victim_hit_rate:.1%} (drop {drop * 100:+.1f} pt, bound "
                f"{cfg.bound * 100:.0f} pt; {run.flood_admitted}/{run.flood_sent} floods "
                f"admitted, on {len(run.flood_replicas)} of {cfg.replicas} replicas); "
                f"contrast, no defence: {open_.victim_hit_rate:.1%} "
                f"(drop {drop_open * 100:+.1f} pt; floods on {len(open_.flood_replicas)} of "
                f"{cfg.replicas} replicas, at most {max(open_.flood_replicas.values(), default=0)} "
                f"on one){note}",
                {"runs": [r.__dict__ for r in rep.runs]},
            )
        )
    return rows


async def run_flooding(cfg: FloodConfig | None = None) -> tuple[list[AttackResult], FloodReport]:
    cfg = cfg or FloodConfig()
    rep = await measure(cfg)
    return results(rep, cfg), rep
