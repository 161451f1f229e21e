"""Review R3: engines that drop the last matched block of every prefix hit.

vLLM with EAGLE, EAGLE3 or MTP speculative decoding (``SpeculativeConfig.use_eagle()``)
pops the last block of the longest cache hit, after the ``prompt_len - 1`` cap, so the
drafter gets that block's hidden states (``FullAttentionManager.find_longest_cache_hit``).
Its ``cached_tokens`` is one block below what its KV events (rightly) put in the index.
The simulated engine does the same with ``drop_last_hit_block``; the gateway models it by
``models.<pool>.hit_drop_blocks``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import pytest
from pydantic import ValidationError

from cachecore.engine import EngineConfig, EngineCore, EngineRequest
from cachecore.index.base import PrefixMatch
from cachecore.lifecycle import Tier
from cachecore.replica.settings import ReplicaSettings
from cachecore.scoring import Coefficients, LoadView, hit_blocks, predict_hit
from gateway.routing import Candidate, Router, RouteRequest, RoutingParams, Strategy
from policies.schema import ModelPool, Policy, parse_policy_text
from tests.test_gateway_faults import checked
from tests.test_gateway_support import stack

pytestmark = pytest.mark.timeout(120)

C = Coefficients()


# ---------------------------------------------------------------------- the model
@pytest.mark.parametrize(
    ("matched", "prompt", "drop", "want"),
    [
        (2, 51, 0, 2),  # the reviewer's prompt: 2 shared blocks, a 19-token tail
        (2, 51, 1, 1),
        (5, 51, 1, 2),  # capped at (51 - 1) // 16 = 3 first, then one dropped
        (1, 51, 1, 0),
        (0, 51, 1, 0),
        (3, 48, 1, 1),  # block-aligned prompt: cap 2, then the drop
        (3, 51, 2, 1),
    ],
)
def test_hit_blocks_caps_then_drops(matched: int, prompt: int, drop: int, want: int) -> None:
    assert hit_blocks(matched, prompt, 16, drop) == want


def _match(gpu: int, stored: int, pending: int) -> PrefixMatch:
    tiers = {Tier.GPU: gpu} if stored == gpu else {Tier.GPU: gpu, Tier.CPU: stored}
    return PrefixMatch(tiers, stored, pending)


def test_predict_hit_drops_the_last_block_of_the_prefix_it_predicts() -> None:
    bs, n = 16, 16 * 10 + 3
    assert predict_hit(_match(4, 4, 4), n, bs, C).predicted_cached_tokens == 4 * bs
    hit = predict_hit(_match(4, 4, 4), n, bs, C, drop=1)
    assert (hit.gpu_tokens, hit.loaded_tokens, hit.pending_tokens) == (3 * bs, 0, 0)
    assert hit.uncached_tokens == n - 3 * bs
    # a slower tier's tail: the dropped block is the last, the slower one
    hit = predict_hit(_match(2, 4, 4), n, bs, C, drop=1)
    assert (hit.gpu_tokens, hit.loaded_tokens) == (2 * bs, 1 * bs)
    # pending blocks: the engine drops the last of whichever prefix it finds
    hit = predict_hit(_match(3, 3, 6), n, bs, Coefficients(pending_weight=0.5), drop=1)
    assert (hit.stored_tokens, hit.pending_tokens) == (2 * bs, 3 * bs)
    assert hit.predicted_cached_tokens == 5 * bs  # = (6 - 1) blocks once they are stored
    # nothing left: no negative counts
    hit = predict_hit(_match(1, 1, 1), n, bs, C, drop=2)
    assert (hit.gpu_tokens, hit.loaded_tokens, hit.pending_tokens) == (0, 0, 0)


def test_the_router_predicts_with_the_requests_drop() -> None:
    bs, n = 16, 16 * 3 + 3
    cands = [Candidate("a", _load(), _match(2, 2, 2)), Candidate("b", _load())]
    router = Router(RoutingParams(strategy=Strategy.EXPECTED_LATENCY), random.Random(0))
    plain = router.decide(RouteRequest(n, bs), cands, C, commit=False)
    assert plain.replica == "a" and plain.predicted_cached_tokens == 2 * bs
    eagle = router.decide(RouteRequest(n, bs, hit_drop_blocks=1), cands, C, commit=False)
    assert eagle.predicted_cached_tokens == bs
    (score,) = [s for s in eagle.scores if s.replica == "a"]
    assert score.matched_blocks == 1


def _load() -> LoadView:
    return LoadView()


def test_hit_drop_blocks_is_a_validated_pool_field() -> None:
    assert ModelPool().hit_drop_blocks == 0
    pol = parse_policy_text("models: {default: {hit_drop_blocks: 1}}")
    assert pol.models.pool("any").hit_drop_blocks == 1
    with pytest.raises(ValidationError):
        ModelPool(hit_drop_blocks=-1)


# ---------------------------------------------------------------------- the engine
def _cached(core: EngineCore, rid: str, prompt: list[int]) -> int:
    """Run one request alone to its end: its num_cached_tokens."""
    core.add_request(EngineRequest(rid, prompt, max_tokens=1), 0.0)
    now, cached = 0.0, None
    for _ in range(1000):
        if not core.has_work():
            break
        res = core.step(now)
        now += res.duration_s
        cached = next((o.num_cached_tokens for o in res.outputs if o.first_token), cached)
    assert cached is not None and not core.has_work()
    return cached


@pytest.mark.parametrize("drop", [False, True])
def test_the_simulated_engine_drops_the_last_hit_block_as_vllm(drop: bool) -> None:
    core = EngineCore(EngineConfig(hash_seed=0, drop_last_hit_block=drop))
    bs = core.block_size
    rng = random.Random(1)
    shared = [rng.randrange(1000, 5000) for _ in range(3 * bs)]
    assert _cached(core, "a", [*shared, 1, 2, 3]) == 0
    assert _cached(core, "b", [*shared, 4, 5, 6]) == (2 if drop else 3) * bs
    # after the prompt_len - 1 cap: a block-aligned prompt's cap is 2 blocks, then the drop
    assert _cached(core, "c", shared) == (1 if drop else 2) * bs
    # a one-block hit is no hit at all
    assert _cached(core, "d", [*shared[:bs], 7, 7, 7]) == (0 if drop else bs)
    # the recomputed block is cached again, and every block still hits: the index is right
    assert _cached(core, "e", [*shared, 8, 9, 10]) == (2 if drop else 3) * bs
    assert core.kv.prefix_stats.hits == (5 if drop else 9) * bs  # vLLM counts after the drop


def test_replica_settings_pass_the_option_to_the_engine() -> None:
    assert not ReplicaSettings().engine_config().drop_last_hit_block
    assert ReplicaSettings(drop_last_hit_block=True).engine_config().drop_last_hit_block


# ---------------------------------------------------------------------- end to end
EAGLE = ReplicaSettings(time_scale=0.05, drop_last_hit_block=True)


async def _reviewers_scenario(policy: str) -> tuple[dict[str, int], bool, list[tuple[int, int]]]:
    """A 2-block system prompt, then 5 requests sharing it (the reviewer's repro): the claim
    checks, whether the replica was quarantined, and (predicted, cached_tokens) per request."""
    rng = random.Random(5)
    async with stack(count=1, replica=EAGLE, agents=True, policy=policy, expose_replica=True) as st:
        gw, c, rep = st.gw, st.client(), st.replica_id(0)
        bs = gw.policy.models.default.block_size
        shared = [rng.randrange(1000, 5000) for _ in range(2 * bs)]

        def tail() -> list[int]:
            return [rng.randrange(1000, 5000) for _ in range(bs + 3)]

        await c.completions.create(model=st.model, prompt=shared + tail(), max_tokens=1)
        await asyncio.sleep(0.5)  # the agent indexes the 3 stored blocks
        pairs = []
        for _ in range(5):
            raw = await c.completions.with_raw_response.create(
                model=st.model, prompt=shared + tail(), max_tokens=1
            )
            r = raw.parse()
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            cached = r.usage.prompt_tokens_details.cached_tokens or 0
            assert cached == bs  # 2 blocks held, 1 used: what vLLM does under EAGLE
            pairs.append((int(raw.headers["x-kvgate-predicted-cached-tokens"]), cached))
        got = await checked(gw, rep, 5, timeout_s=10.0)
        return dict(got), gw.quarantine.is_quarantined(rep), pairs


async def test_without_the_field_an_eagle_engine_is_taken_for_a_liar() -> None:
    # why the field exists: the index holds 2 blocks, the engine serves 1 (missing 0.5)
    got, quarantined, pairs = await _reviewers_scenario("quarantine: {settle_s: 0.3}")
    assert got.get("false", 0) >= 3, got
    assert quarantined
    assert pairs[0] == (32, 16)  # the first prediction, before the quarantine: a block high


async def test_with_hit_drop_blocks_an_eagle_engine_is_predicted_and_believed() -> None:
    policy = "quarantine: {settle_s: 0.3}\nmodels: {default: {hit_drop_blocks: 1}}"
    got, quarantined, pairs = await _reviewers_scenario(policy)
    # claims of 1 block are below min_claimed_blocks (2): none is judged, none is false
    assert got.get("false", 0) == 0, got
    assert not quarantined
    assert all(p == a for p, a in pairs), pairs


async def test_with_hit_drop_blocks_a_longer_prefix_is_checked_and_agrees() -> None:
    # 4 shared blocks: 3 claimed and served, so the checks run and agree; no precision error
    rng = random.Random(9)
    policy = "quarantine: {settle_s: 0.3}\nmodels: {default: {hit_drop_blocks: 1}}"
    async with stack(count=1, replica=EAGLE, agents=True, policy=policy, expose_replica=True) as st:
        gw, c, rep = st.gw, st.client(), st.replica_id(0)
        bs = gw.policy.models.default.block_size
        shared = [rng.randrange(1000, 5000) for _ in range(4 * bs)]

        def tail() -> list[int]:
            return [rng.randrange(1000, 5000) for _ in range(bs + 3)]

        await c.completions.create(model=st.model, prompt=shared + tail(), max_tokens=1)
        await asyncio.sleep(0.5)
        err0, _ = gw.metrics.precision
        for _ in range(4):
            raw = await c.completions.with_raw_response.create(
                model=st.model, prompt=shared + tail(), max_tokens=1
            )
            r = raw.parse()
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == 3 * bs
            assert int(raw.headers["x-kvgate-predicted-cached-tokens"]) == 3 * bs
        got = await checked(gw, rep, 4, timeout_s=10.0)
        assert got == {"agree": 4}, got
        assert gw.metrics.precision[0] == err0  # no error added by these requests
        assert not gw.quarantine.is_quarantined(rep)


# ---------------------------------------------------------------------- the simulator
def test_the_simulator_models_an_eagle_fleet_by_the_policy() -> None:
    from loadtest.simulate import FleetSimulator, SimConfig, scaled_workload
    from loadtest.workloads import TextSource
    from policies.schema import builtin_policy_path, load_policy

    text = TextSource()
    base = load_policy(builtin_policy_path("default"))
    pool = base.models.default.model_copy(update={"hit_drop_blocks": 1})
    field = base.model_copy(update={"models": base.models.model_copy(update={"default": pool})})
    cfg = SimConfig(replicas=4, num_blocks=2048)

    def pred_error(policy: Policy, drop: bool) -> float:
        w = scaled_workload("shared-prefix", 200, cfg.replicas, 10.0, 0, text)
        sim = FleetSimulator(replace(cfg, drop_last_hit_block=drop), policy, w)
        return float(asyncio.run(sim.run()).row()["pred_error"])

    plain = pred_error(base, False)  # the default fleet, as the policy models it
    unset, set_ = pred_error(base, True), pred_error(field, True)
    assert set_ <= plain < unset, (plain, set_, unset)


@pytest.mark.parametrize("strategy", [Strategy.EXPECTED_LATENCY, Strategy.PREFIX_AFFINITY])
def test_a_dropped_block_is_held_not_new_tree_growth(strategy: Strategy) -> None:
    """The engine computes the dropped block again but its replica held it: the trees
    (D14's scope tree, prefix_affinity's) grow by the prompt tokens the replica did not
    hold, 40 of 200 here with or without the drop (56 with it before: every hit on an
    EAGLE pool made its replica look a block fuller)."""
    from cachecore.index.base import PrefixMatch
    from cachecore.lifecycle import Tier

    for drop in (0, 1):
        router = Router(RoutingParams(strategy=strategy), random.Random(1))
        load = LoadView(0.0, 0, 0, 0, 256, 0.1)
        match = PrefixMatch({Tier.GPU: 10}, 10, 10)  # 160 tokens stored on r0
        cands = [Candidate("r0", load, match), Candidate("r1", load)]
        req = RouteRequest(prompt_tokens=200, block_size=16, scope_key="t", hit_drop_blocks=drop)
        d = router.decide(req, cands, Coefficients())
        assert d.replica == "r0" and d.predicted_cached_tokens == 160 - 16 * drop
        fx = d.effects
        assert fx is not None
        grown = fx.scope_tree[2] if fx.scope_tree is not None else fx.tree[1]  # type: ignore[index]
        assert grown == 40, (drop, grown)
