"""Expected-latency cost model: the one scoring code shared by the gateway and the simulator.

The cost of sending a request to a replica is the time to its first token there, in ms::

    cost = overhead
         + prefill_ms_per_token * (queued_prefill_tokens + own_uncached_tokens)
         + load_ms_per_token    * own_loaded_tokens          (hits on CPU/disk/remote tiers)
         + decode_ms_per_running * running                   (decode steps interleaved)
         + saturation_ms        * over_capacity              (must wait for a free slot)

Every term is linear in its coefficient, so the coefficients start from the policy and are
refitted online from observed TTFT by :class:`OnlineFit` (bounded recursive least squares).

The router ranks replicas by that TTFT plus one term that is not the request's own latency::

    stall = stall_weight * (own_prefill_ms + overhead * [queued_requests < 2]) * running

A prefill chunk runs in the same engine steps as the replica's decodes, so each of its
``running`` requests waits for this request's prefill (vLLM's chunked prefill; the simulated
engine's step model). Routing on its own TTFT alone, a long miss lands on a replica full of
decoding requests as readily as on an idle one (it barely slows its own first token) and
stalls all of them; the term charges it part of that. A step that carries any prefill also
pays the step overhead, once: a prefill sent where the next step would carry none makes it
pay that for every running request, one that joins a prefill waiting for that step adds
nothing. Of a replica's requests before their first token, one is most likely in the step
under way (a request joins at the next step), so only a second one is known to wait for the
next: with fewer, the overhead is charged. (Short misses spread one per replica kept every
replica's decodes paying it near saturation: docs/benchmarks.md, "Short non-repeating
requests near saturation".) A full hit still computes its last token in a step of its
own, so it pays the overhead part too. ``stall_weight`` is not fitted (the stall is a cost
to other requests, which no TTFT observation measures); ``overhead`` is the fitted TTFT
intercept, which also holds the gateway-to-engine round trip, so the overhead part follows
what the fit learns (small where a real engine's step overhead is). ``queued_requests`` is
what this gateway dispatched: with several gateways the others' queued requests are not
counted, the overhead is charged more often than a shared step would warrant (D25).

The engine's hit cap: vLLM never serves the last prompt token from cache (it needs logits),
so at most ``(prompt_len - 1) // block_size`` full blocks hit. Every prediction applies it.

Pure code: no I/O, no clock, no asyncio, so a virtual-time simulator calls exactly this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import getitem, mul

from cachecore.index.base import PrefixMatch
from cachecore.lifecycle import Tier

FEATURES: tuple[str, ...] = ("overhead", "prefill", "load", "decode", "saturation")
"""Names of the cost features, in the order of :attr:`Coefficients.as_vector`."""


@dataclass(frozen=True, slots=True)
class Coefficients:
    """Cost coefficients (ms, ms per token, ms per running request, ms per request over
    capacity). ``tier_load_factor`` scales ``load_ms_per_token`` for slower tiers."""

    overhead_ms: float = 30.0
    prefill_ms_per_token: float = 0.25
    load_ms_per_token: float = 0.01
    decode_ms_per_running: float = 0.5
    saturation_ms: float = 200.0
    pending_weight: float = 0.8
    stall_weight: float = 0.15  # not fitted (see the module docstring)
    recompute_weight: float = 1.0  # not fitted; applied by the router (gateway.routing)
    tier_load_factor: Mapping[Tier, float] = field(
        default_factory=lambda: {Tier.CPU: 1.0, Tier.DISK: 4.0, Tier.REMOTE: 10.0}
    )

    def as_vector(self) -> list[float]:
        return [
            self.overhead_ms,
            self.prefill_ms_per_token,
            self.load_ms_per_token,
            self.decode_ms_per_running,
            self.saturation_ms,
        ]

    def with_vector(self, v: Sequence[float]) -> Coefficients:
        if len(v) != len(FEATURES):
            raise ValueError(f"expected {len(FEATURES)} coefficients, got {len(v)}")
        # every field by name (what dataclasses.replace does, at a third of its cost: the
        # online fit makes one per request); test_with_vector_keeps_every_other_field
        return type(self)(
            overhead_ms=float(v[0]),
            prefill_ms_per_token=float(v[1]),
            load_ms_per_token=float(v[2]),
            decode_ms_per_running=float(v[3]),
            saturation_ms=float(v[4]),
            pending_weight=self.pending_weight,
            stall_weight=self.stall_weight,
            recompute_weight=self.recompute_weight,
            tier_load_factor=self.tier_load_factor,
        )


@dataclass(slots=True)  # built per replica per request: not frozen (3x cheaper); read-only
class LoadView:
    """What the router knows of one replica's load at decision time.

    ``queued_prefill_tokens`` / ``queued_requests``: dispatched (by every gateway) and not
    yet at their first token, i.e. prefill work ahead of a new request; ``running``:
    requests past their first token (decoding); ``capacity``: the engine's max concurrent
    sequences. ``waiting`` is the engine's own queue length (it may include traffic that
    no gateway dispatched); ``kv_usage`` in 0..1.
    """

    queued_prefill_tokens: float = 0.0
    queued_requests: int = 0
    running: int = 0
    waiting: int = 0
    capacity: int = 256
    kv_usage: float = 0.0
    # how late (ms, past a grace) the oldest request still waiting for its first token is
    # against its predicted TTFT: a replica that stopped making progress (a wedged engine
    # whose HTTP still answers) shows here long before any timeout; a new request waits
    # at least that long. 0 where nobody measures it (the simulator).
    overdue_ms: float = 0.0

    @property
    def requests(self) -> int:
        """Requests on the replica (queued or running), the load measure of load-only routers."""
        return max(self.queued_requests, self.waiting) + self.running


@dataclass(slots=True)  # not frozen: built per replica per request (frozen init is 3x slower)
class HitPrediction:
    """How much of a prompt a replica is predicted to serve from cache, in tokens."""

    prompt_tokens: int
    gpu_tokens: int  # cached on GPU
    loaded_tokens: int  # cached on a slower tier (loaded, not recomputed)
    loaded_weighted: float  # loaded tokens scaled by their tier's load factor
    pending_tokens: int  # beyond the stored prefix, covered only by pending entries
    pending_weight: float

    @property
    def stored_tokens(self) -> int:
        return self.gpu_tokens + self.loaded_tokens

    @property
    def predicted_cached_tokens(self) -> int:
        """What the engine should report as ``cached_tokens``: the stored prefix, plus the
        pending part when the policy trusts pending entries (weight >= 0.5)."""
        extra = self.pending_tokens if self.pending_weight >= 0.5 else 0
        return self.stored_tokens + extra

    @property
    def uncached_tokens(self) -> float:
        """Expected tokens to prefill: pending-only blocks count as hits with their weight."""
        return self.prompt_tokens - self.stored_tokens - self.pending_weight * self.pending_tokens


def hit_cap_blocks(prompt_tokens: int, block_size: int) -> int:
    """The engine's cap on full-block hits: the last prompt token is always computed.
    What the gateway keys (the engine stores these blocks, whatever it drops on a hit)."""
    if prompt_tokens <= 0:
        return 0
    return (prompt_tokens - 1) // block_size


def hit_blocks(matched: int, prompt_tokens: int, block_size: int, drop: int = 0) -> int:
    """Blocks an engine serves from cache for a ``matched``-block prefix: capped as
    :func:`hit_cap_blocks`, then ``drop`` blocks fewer (vLLM with EAGLE/EAGLE3/MTP drafting
    recomputes the last matched block: ``models.<pool>.hit_drop_blocks``)."""
    return max(0, min(matched, hit_cap_blocks(prompt_tokens, block_size)) - drop)


def predict_hit(
    match: PrefixMatch,
    prompt_tokens: int,
    block_size: int,
    coeffs: Coefficients,
    drop: int = 0,
) -> HitPrediction:
    """Apply the hit cap (and the engine's ``drop``, :func:`hit_blocks`) and the tier split
    to an index match.

    Blocks ``[0, gpu)`` hit on GPU; blocks ``[gpu, stored)`` are on slower tiers and each
    is charged at the fastest tier whose own prefix covers it (REMOTE when none does);
    blocks ``[stored, pending)`` are only pending.
    """
    cap = hit_cap_blocks(prompt_tokens, block_size)
    tb = match.tier_blocks
    gpu = min(tb.get(Tier.GPU, 0), cap)
    stored = max(gpu, min(match.stored_blocks, cap))
    pending = max(stored, min(match.pending_blocks, cap))
    if drop:
        # the engine drops the last blocks of whatever prefix it finds: of the stored one,
        # or of the pending one once those blocks are stored
        stored = max(0, stored - drop)
        pending = max(stored, pending - drop)
        gpu = min(gpu, stored)
    loaded_weighted = 0.0
    if stored > gpu:  # the uncommon case: hits beyond the GPU prefix
        covered = gpu
        factors = coeffs.tier_load_factor
        for tier in (Tier.CPU, Tier.DISK, Tier.REMOTE):
            if covered >= stored:
                break
            reach = stored if tier is Tier.REMOTE else min(tb.get(tier, 0), stored)
            if reach > covered:
                loaded_weighted += (reach - covered) * factors.get(tier, 10.0)
                covered = reach
    return HitPrediction(
        prompt_tokens,
        gpu * block_size,
        (stored - gpu) * block_size,
        loaded_weighted * block_size,
        (pending - stored) * block_size,
        coeffs.pending_weight,
    )


def features(uncached_tokens: float, loaded_weighted: float, load: LoadView) -> list[float]:
    """The cost features, in :data:`FEATURES` order."""
    ahead = max(load.queued_requests, load.waiting)
    over = max(0, load.running + ahead + 1 - load.capacity)
    return [
        1.0,
        load.queued_prefill_tokens + max(0.0, uncached_tokens),
        loaded_weighted,
        float(load.running),
        float(over),
    ]


def dot(coeffs: Sequence[float], x: Sequence[float]) -> float:
    return math.fsum(c * v for c, v in zip(coeffs, x, strict=True))


@dataclass(slots=True)  # not frozen, as HitPrediction; treat as immutable
class CostBreakdown:
    """One replica's cost, split into the parts an operator reads in route/explain.
    ``cost_ms`` is the predicted TTFT plus ``stall_ms``."""

    cost_ms: float
    queue_ms: float  # wait caused by work already on the replica
    prefill_ms: float  # this request's own uncached prefill
    load_ms: float  # this request's hits on slower tiers
    hit: HitPrediction
    stall_ms: float = 0.0  # weighted decode stall this prefill imposes on running requests

    @property
    def ttft_ms(self) -> float:
        """The predicted time to first token (what the online fit compares with)."""
        return self.cost_ms - self.stall_ms


def cost(
    match: PrefixMatch,
    prompt_tokens: int,
    block_size: int,
    load: LoadView,
    coeffs: Coefficients,
    drop: int = 0,
) -> CostBreakdown:
    """Routing cost (ms) of a request on a replica: see the module docstring. Its
    ``ttft_ms`` equals ``dot(coeffs.as_vector(), features(...))`` plus the load's
    ``overdue_ms`` (a test holds it to that; the fit learns the model, the lateness is
    measured); written out because the router calls it for every replica of every
    request."""
    return cost_of_hit(predict_hit(match, prompt_tokens, block_size, coeffs, drop), load, coeffs)


def cost_of_hit(hit: HitPrediction, load: LoadView, coeffs: Coefficients) -> CostBreakdown:
    """:func:`cost` for an already predicted hit (replicas without any match share one)."""
    ((cost_ms, queue_ms, prefill_ms, load_ms, stall_ms),) = cost_terms(hit, (load,), coeffs)
    return CostBreakdown(cost_ms, queue_ms, prefill_ms, load_ms, hit, stall_ms)


def cost_terms(
    hit: HitPrediction, loads: Iterable[LoadView], coeffs: Coefficients
) -> list[tuple[float, float, float, float, float]]:
    """``(cost_ms, queue_ms, prefill_ms, load_ms, stall_ms)`` of :func:`cost_of_hit` for
    one hit on each load, in order: the router's no-match replicas in one call, with the
    terms that depend only on the hit worked out once (the same floats, operation by
    operation, as one call per load)."""
    uncached: float = hit.prompt_tokens - hit.gpu_tokens - hit.loaded_tokens
    uncached -= hit.pending_weight * hit.pending_tokens
    if uncached < 0.0:
        uncached = 0.0
    pt = coeffs.prefill_ms_per_token
    per_running = coeffs.decode_ms_per_running
    saturation = coeffs.saturation_ms
    overhead = coeffs.overhead_ms
    own_prefill = pt * uncached
    load_ms = coeffs.load_ms_per_token * hit.loaded_weighted
    stall_per_running = coeffs.stall_weight * own_prefill
    # with no prefill waiting for the next step, this one adds the step overhead to it
    stall_alone = coeffs.stall_weight * (own_prefill + overhead)
    out: list[tuple[float, float, float, float, float]] = []
    for load in loads:
        running = load.running
        ahead = load.queued_requests if load.queued_requests > load.waiting else load.waiting
        over = running + ahead + 1 - load.capacity
        queue_ms = pt * load.queued_prefill_tokens + per_running * running
        queue_ms += load.overdue_ms
        if over > 0:
            queue_ms += saturation * over
        stall = stall_per_running if load.queued_requests > 1 else stall_alone
        stall_ms = stall * running
        out.append(
            (
                overhead + queue_ms + own_prefill + load_ms + stall_ms,
                queue_ms,
                own_prefill,
                load_ms,
                stall_ms,
            )
        )
    return out


class OnlineFit:
    """Bounded, stable recursive least squares for the cost coefficients.

    Model: ``ttft_ms ~ theta . x`` with ``x`` from :func:`features`. Stability measures:

    * features are scaled by fixed magnitudes so the covariance is well conditioned;
    * exponential forgetting (``forgetting``) tracks drift, and the covariance trace is
      capped so it cannot blow up when the inputs stop exciting some direction;
    * samples whose residual exceeds ``outlier_sigmas`` running standard deviations are
      skipped (a GC pause must not move the model);
    * every coefficient is clamped to ``[prior / bound, prior * bound]`` after each update
      (``bound`` >= 1), so a fit can sharpen the policy's values but never invert them;
    * a sample observed ``implausible`` (100) times faster than the box's lowest
      prediction (``lo . x``: features and coefficients are never negative) is skipped,
      warm or not: no coefficients the fit may take come near it, so its features are a
      misbehaving engine's report (a running count or a prompt length of 1e18), not a
      load. Taken before the fit was warm, one such sample pinned the coefficients to the
      box's edges for thousands of samples and made the residual variance so large that
      no outlier was rejected after it. Honest samples stay far inside the factor (a load
      view that overstated the queue: at most 16x in the simulator's mooncake run); a
      sample far slower than predicted is measured by the gateway's own clock (queueing
      the model does not see), left to the outlier rule.

    Invariant: ``coefficients()`` always lies inside the clamp box around the prior.
    """

    _SCALES = (1.0, 1e-3, 1e-3, 1.0 / 16.0, 1.0)

    def __init__(
        self,
        prior: Coefficients,
        bound: float = 4.0,
        forgetting: float = 0.995,
        min_samples: int = 20,
        outlier_sigmas: float = 6.0,
        max_trace: float = 1e4,
        implausible: float = 100.0,
    ) -> None:
        if bound < 1.0:
            raise ValueError("bound must be >= 1")
        if not 0.5 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0.5, 1]")
        self.prior = prior
        self.bound = bound
        self.forgetting = forgetting
        self.min_samples = min_samples
        self.outlier_sigmas = outlier_sigmas
        self.max_trace = max_trace
        self.implausible = implausible
        n = len(FEATURES)
        prior_v = prior.as_vector()
        # theta in scaled space: theta_s[i] = theta[i] / scale[i]
        self._theta = [prior_v[i] / self._SCALES[i] for i in range(n)]
        self._lo = [min(v / bound, v * bound) / self._SCALES[i] for i, v in enumerate(prior_v)]
        self._hi = [max(v / bound, v * bound) / self._SCALES[i] for i, v in enumerate(prior_v)]
        self._p = [[(100.0 if i == j else 0.0) for j in range(n)] for i in range(n)]
        self.samples = 0
        self.skipped = 0
        self._resid_var = 0.0
        self._cached: Coefficients | None = None  # coefficients() between two updates

    def coefficients(self) -> Coefficients:
        """The fitted coefficients once enough samples arrived, else the prior."""
        if self.samples < self.min_samples:
            return self.prior
        if self._cached is None:
            scales = self._SCALES
            vec = [t * s for t, s in zip(self._theta, scales, strict=True)]
            self._cached = self.prior.with_vector(vec)
        return self._cached

    def predict(self, x: Sequence[float]) -> float:
        return dot(self.coefficients().as_vector(), x)

    def update(self, x: Sequence[float], observed_ms: float) -> bool:
        """Feed one observation. Returns False if it was rejected (non-finite or outlier)."""
        n = len(FEATURES)
        if len(x) < n:  # map() below would silently drop the missing features
            raise ValueError(f"{len(x)} features for a fit of {n}")
        if not math.isfinite(observed_ms) or observed_ms < 0 or not all(map(math.isfinite, x)):
            self.skipped += 1
            return False
        # the same float operations in the same order as the textbook loops, with the
        # dot products in C (map) and the rows hoisted: bit-identical results, fewer bytecodes
        z = list(map(mul, x, self._SCALES))  # the first n features, as x[i] for i < n
        lo, hi = self._lo, self._hi
        if self.implausible * observed_ms < math.fsum(map(mul, lo, z)):
            self.skipped += 1  # load no coefficients could make this fast (class docstring)
            return False
        theta = self._theta
        resid = observed_ms - math.fsum(map(mul, theta, z))
        warmed = self.samples >= self.min_samples and self._resid_var > 0
        if warmed and abs(resid) > self.outlier_sigmas * math.sqrt(self._resid_var):
            self.skipped += 1
            # still let the variance grow slowly, so a real regime change is accepted
            self._resid_var *= 1.05
            return False
        lam = self.forgetting
        p = self._p
        pz = [math.fsum(map(mul, row, z)) for row in p]
        denom = lam + math.fsum(map(mul, z, pz))
        gain = [v / denom for v in pz]
        for i in range(n):
            theta[i] = min(hi[i], max(lo[i], theta[i] + gain[i] * resid))
        for i in range(n):
            row, g = p[i], gain[i]
            for j in range(n):
                row[j] = (row[j] - g * pz[j]) / lam
        trace = sum(map(getitem, p, range(n)))
        if trace > self.max_trace:
            f = self.max_trace / trace
            for row in p:
                for j in range(n):
                    row[j] *= f
        self._resid_var = (
            resid * resid if self.samples == 0 else 0.98 * self._resid_var + 0.02 * resid * resid
        )
        self.samples += 1
        self._cached = None
        return True
