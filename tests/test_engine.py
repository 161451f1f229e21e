"""Scheduler and engine-core behaviour (vLLM v1 semantics), in virtual time."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterable

import pytest

from cachecore.engine import (
    PROFILES,
    EngineConfig,
    EngineCore,
    EngineRequest,
    HashAlgo,
    LatencyProfile,
    RequestOutput,
    RequestRejectedError,
    StepResult,
    WireHashFormat,
)
from cachecore.engine.hashing import int_hash
from cachecore.keys import tokens_to_bytes
from cachecore.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

VOCAB = tuple(range(1000, 1500))
FLAT = LatencyProfile("flat", 0.01, 0.001, 0.005, max_num_seqs=8)


def engine(**kw: object) -> EngineCore:
    kw.setdefault("profile", FLAT)
    kw.setdefault("hash_seed", 1)
    return EngineCore(EngineConfig(**kw), VOCAB)  # type: ignore[arg-type]


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def run(
    core: EngineCore, now: float = 0.0, max_steps: int = 10_000
) -> tuple[list[StepResult], float]:
    steps = []
    for _ in range(max_steps):
        if not core.has_work():
            break
        res = core.step(now)
        now += res.duration_s
        steps.append(res)
    assert not core.has_work(), "engine did not drain"
    return steps, now


def outputs(steps: Iterable[StepResult]) -> dict[str, list[RequestOutput]]:
    out: dict[str, list[RequestOutput]] = {}
    for s in steps:
        for o in s.outputs:
            out.setdefault(o.request_id, []).append(o)
    return out


def events(steps: Iterable[StepResult]) -> list[KVEvent]:
    return [e for s in steps for e in s.events]


def stored(evs: Iterable[KVEvent]) -> list[BlockStored]:
    return [e for e in evs if isinstance(e, BlockStored)]


# ------------------------------------------------------------------ prefill and hits


def test_chunked_prefill_respects_the_token_budget() -> None:
    core = engine(block_size=4, max_num_batched_tokens=64)
    core.add_request(EngineRequest("a", toks(200), max_tokens=2), 0.0)
    steps, _ = run(core)
    assert [s.num_prefill_tokens for s in steps[:4]] == [64, 64, 64, 8]
    # nothing is sampled until the last chunk; then one token per step
    assert [len(s.outputs) for s in steps] == [0, 0, 0, 1, 1]
    assert outputs(steps)["a"][0].first_token
    # each chunk's full blocks are stored in the step that computes them, one batch per step
    assert [len(s.events) for s in steps[:4]] == [1, 1, 1, 1]
    assert [len(stored(s.events)[0].block_hashes) for s in steps[:4]] == [16, 16, 16, 2]


def test_prefix_hit_is_capped_at_prompt_len_minus_one() -> None:
    core = engine(block_size=16)
    core.add_request(EngineRequest("a", toks(64), max_tokens=1), 0.0)
    run(core)
    core.add_request(EngineRequest("b", toks(64), max_tokens=1), 0.0)  # block-aligned, cached
    core.add_request(EngineRequest("c", toks(70), max_tokens=1), 0.0)
    steps, _ = run(core)
    got = {o.request_id: o.num_cached_tokens for o in steps[0].outputs}
    assert got == {"b": 48, "c": 64}  # b recomputes its last full block
    assert steps[0].num_prefill_tokens == 16 + 6


def test_cached_tokens_counted_at_first_scheduling_and_in_prefix_stats() -> None:
    core = engine(block_size=16)
    core.add_request(EngineRequest("a", toks(100), max_tokens=1), 0.0)
    run(core)
    core.add_request(EngineRequest("b", toks(80) + toks(20, 9000), max_tokens=3), 0.0)
    steps, _ = run(core)
    outs = outputs(steps)["b"]
    assert {o.num_cached_tokens for o in outs} == {80}
    st = core.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (200, 80)


def test_prompt_bytes_from_the_caller_change_nothing() -> None:
    """A caller's prompt_bytes (the simulator's) give the steps and events the engine's own
    conversion gives; bytes of the wrong length are refused."""
    results = []
    for given in (False, True):
        core = engine(block_size=4)
        for i, salt in enumerate(("kvg1:s1", "kvg1:s1", "kvg1:s2")):
            prompt = toks(37, 10 * i)
            data = tokens_to_bytes(prompt) if given else None
            req = EngineRequest(f"r{i}", prompt, 9, salt, prompt_bytes=data)
            core.add_request(req, 0.0)
        steps, _ = run(core)
        results.append((events(steps), outputs(steps)))
    assert results[0] == results[1]
    with pytest.raises(ValueError, match="prompt_bytes"):
        engine().add_request(EngineRequest("x", toks(4), prompt_bytes=b"\x00" * 12), 0.0)


def test_salt_and_lora_enter_the_extra_keys_and_isolate() -> None:
    core = engine(block_size=4, lora_names=("ad1",))
    prompt = toks(12)
    core.add_request(EngineRequest("a", prompt, max_tokens=1, cache_salt="kvg1:s1"), 0.0)
    steps, _ = run(core)
    (ev,) = stored(events(steps))
    assert ev.extra_keys == [("kvg1:s1",), None, None]
    assert ev.lora_name is None and ev.medium == "GPU" and ev.token_ids == prompt[:12]
    core.add_request(EngineRequest("b", prompt, max_tokens=1, cache_salt="kvg1:s2"), 0.0)
    core.add_request(EngineRequest("c", prompt, max_tokens=1), 0.0)
    core.add_request(
        EngineRequest("d", prompt, max_tokens=1, cache_salt="kvg1:s1", lora_name="ad1"), 0.0
    )
    steps, _ = run(core)
    assert {o.request_id: o.num_cached_tokens for o in steps[0].outputs} == {
        "b": 0,
        "c": 0,
        "d": 0,
    }
    by_salt = {next(iter(e.extra_keys or [None])): e for e in stored(events(steps))}
    lora_ev = by_salt[("ad1", "kvg1:s1")]
    assert lora_ev.extra_keys == [("ad1", "kvg1:s1"), ("ad1",), ("ad1",)]
    assert lora_ev.lora_name == "ad1" and lora_ev.lora_id == 1
    first_hashes = {e.block_hashes[0] for e in stored(events(steps))}
    assert len(first_hashes) == 3  # no two scopes share block 0
    # same salt again: shares
    core.add_request(EngineRequest("e", [*prompt, 7], max_tokens=1, cache_salt="kvg1:s2"), 0.0)
    steps, _ = run(core)
    assert steps[0].outputs[0].num_cached_tokens == 12


def test_decode_fills_blocks_and_stores_them() -> None:
    core = engine(block_size=4)
    core.add_request(EngineRequest("a", toks(10), max_tokens=11), 0.0)
    steps, _ = run(core)
    out_ids = [t for o in outputs(steps)["a"] for t in o.new_token_ids]
    assert len(out_ids) == 11
    evs = stored(events(steps))
    # prompt: 2 full blocks; KV is computed for 10 + 11 - 1 = 20 tokens -> 5 full blocks
    assert sum(len(e.block_hashes) for e in evs) == 5
    all_ids = toks(10) + out_ids
    assert [t for e in evs for t in e.token_ids] == all_ids[:20]
    # chained: each decode block's parent is the previous block
    chain = [h for e in evs for h in e.block_hashes]
    for e in evs[1:]:
        assert e.parent_block_hash == chain[chain.index(e.block_hashes[0]) - 1]


def test_outputs_are_deterministic_words_from_the_vocabulary() -> None:
    a, b = engine(), engine(hash_seed=2)
    for core in (a, b):
        core.add_request(EngineRequest("x", toks(30), max_tokens=20), 0.0)
        core.add_request(EngineRequest("y", toks(31), max_tokens=20), 0.0)
    ra = outputs(run(a)[0])
    rb = outputs(run(b)[0])
    seq = {k: [t for o in v for t in o.new_token_ids] for k, v in ra.items()}
    assert seq == {k: [t for o in v for t in o.new_token_ids] for k, v in rb.items()}
    assert seq["x"] != seq["y"]
    assert all(t in VOCAB for t in seq["x"])


# ------------------------------------------------------------------ batching and preemption


def test_fcfs_and_max_num_seqs() -> None:
    core = engine(block_size=4, max_num_seqs=2)
    for i in range(4):
        core.add_request(EngineRequest(f"r{i}", toks(8, 100 * i), max_tokens=3), 0.0)
    res = core.step(0.0)
    assert [o.request_id for o in res.outputs] == ["r0", "r1"]
    assert core.stats().num_running == 2 and core.stats().num_waiting == 2
    steps, _ = run(core)
    firsts = [o.request_id for s in steps for o in s.outputs if o.first_token]
    assert firsts == ["r2", "r3"]


def test_preempts_the_newest_and_recomputes_it() -> None:
    # 10 blocks of 4 tokens; two requests of 8 prompt + 12 output tokens need 5 blocks each
    # at the end (19 computed tokens), 4 while prefilling: they cannot both finish together.
    core = engine(block_size=4, num_blocks=9, max_model_len=36)
    core.add_request(EngineRequest("old", toks(8), max_tokens=12), 0.0)
    core.add_request(EngineRequest("new", toks(8, 500), max_tokens=12), 0.0)
    steps, _ = run(core)
    preempted = [p for s in steps for p in s.preempted]
    assert preempted and set(preempted) == {"new"}
    assert core.stats().num_preemptions == len(preempted)
    outs = outputs(steps)
    assert outs["old"][-1].num_preemptions == 0 and outs["new"][-1].num_preemptions >= 1
    # the recomputed request produced the same tokens as an unpressured run
    ref = engine(block_size=4, num_blocks=64)
    ref.add_request(EngineRequest("new", toks(8, 500), max_tokens=12), 0.0)
    ref_ids = [t for o in outputs(run(ref)[0])["new"] for t in o.new_token_ids]
    assert [t for o in outs["new"] for t in o.new_token_ids] == ref_ids
    # first-scheduling cached_tokens survive the preemption
    assert {o.num_cached_tokens for o in outs["new"]} == {0}
    core.pool.check_invariants()


def test_preemption_stops_admission_in_that_step() -> None:
    core = engine(block_size=4, num_blocks=9, max_model_len=36)
    core.add_request(EngineRequest("old", toks(8), max_tokens=12), 0.0)
    core.add_request(EngineRequest("new", toks(8, 500), max_tokens=12), 0.0)
    now = 0.0
    for _ in range(100):
        res = core.step(now)
        now += res.duration_s
        if res.preempted:
            assert "new" not in {o.request_id for o in res.outputs}
            break
    else:
        pytest.fail("no preemption happened")


def test_abort_frees_blocks_and_keeps_them_cached() -> None:
    core = engine(block_size=4)
    core.add_request(EngineRequest("a", toks(16), max_tokens=50), 0.0)
    core.step(0.0)
    assert core.pool.num_used_blocks == 4  # the first output token's slot comes next step
    core.step(0.1)
    assert core.pool.num_used_blocks == 5
    assert core.abort("a") and not core.abort("a")
    assert core.pool.num_used_blocks == 0 and core.pool.num_cached_blocks == 4
    assert not core.has_work()
    core.pool.check_invariants()


def test_reset_prefix_cache_only_when_idle() -> None:
    core = engine(block_size=4)
    core.add_request(EngineRequest("a", toks(16), max_tokens=3), 0.0)
    core.step(0.0)
    assert not core.reset_prefix_cache()
    run(core, 1.0)
    assert core.reset_prefix_cache()
    assert core.take_events() == [AllBlocksCleared()]
    assert core.pool.num_cached_blocks == 0


def test_rejections() -> None:
    core = engine(block_size=4, num_blocks=8, lora_names=("ad1",))
    assert core.max_model_len == 32  # capped to the pool
    for bad in (
        EngineRequest("e", []),
        EngineRequest("m", toks(4), max_tokens=0),
        EngineRequest("l", toks(30), max_tokens=3),
        EngineRequest("s", toks(4), cache_salt=""),
        EngineRequest("u", toks(4), lora_name="nope"),
    ):
        with pytest.raises(RequestRejectedError):
            core.add_request(bad, 0.0)
    core.add_request(EngineRequest("d", toks(4)), 0.0)
    with pytest.raises(RequestRejectedError):
        core.add_request(EngineRequest("d", toks(4)), 0.0)


def test_concurrent_identical_prompts_cache_duplicate_blocks() -> None:
    """vLLM does not de-duplicate: the same block computed twice is stored twice and each
    copy is removed on its own."""
    core = engine(block_size=4, num_blocks=12)
    core.add_request(EngineRequest("a", toks(8), max_tokens=9), 0.0)
    core.add_request(EngineRequest("b", toks(8), max_tokens=9), 0.0)
    steps, _ = run(core)
    hashes = [h for e in stored(events(steps)) for h in e.block_hashes]
    dup = {h for h in hashes if hashes.count(h) > 1}
    # b hits block 0, recomputes block 1 (the cap), and both decode identical blocks
    assert len(dup) >= 3
    assert core.pool.num_cached_blocks == len(hashes)
    steps = []
    for i in range(2):  # enough new content to evict everything
        core.add_request(EngineRequest(f"c{i}", toks(44, 700 + 100 * i), max_tokens=1), 0.0)
        steps += run(core)[0]
    removed = Counter(
        h for e in events(steps) if isinstance(e, BlockRemoved) for h in e.block_hashes
    )
    assert Counter({h: removed[h] for h in hashes}) == Counter(hashes)


# ------------------------------------------------------------------ hashing


def test_hashes_depend_on_seed_and_algorithm_and_wire_format() -> None:
    def block_hashes(**kw: object) -> list[object]:
        core = engine(block_size=4, **kw)
        core.add_request(EngineRequest("a", toks(8), max_tokens=1), 0.0)
        return [h for e in stored(events(run(core)[0])) for h in e.block_hashes]

    base = block_hashes(hash_seed=5)
    assert base == block_hashes(hash_seed=5)
    assert base != block_hashes(hash_seed=6)
    assert base != block_hashes(hash_seed=None)
    assert base != block_hashes(hash_seed=5, hash_algo=HashAlgo.XXHASH)
    raw = block_hashes(hash_seed=5, wire_hash_format=WireHashFormat.BYTES)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in raw)
    assert [int_hash(h) for h in raw if isinstance(h, bytes)] == base
    xx = block_hashes(hash_algo=HashAlgo.XXHASH, wire_hash_format=WireHashFormat.BYTES)
    assert all(isinstance(h, bytes) and len(h) == 16 for h in xx)


# ------------------------------------------------------------------ latency


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("prompt", [300, 2048, 6000])
def test_single_request_ttft_matches_the_profile(name: str, prompt: int) -> None:
    prof = PROFILES[name]
    core = EngineCore(EngineConfig(profile=prof, hash_seed=0), VOCAB)
    core.add_request(EngineRequest("a", toks(prompt), max_tokens=4), 0.0)
    now, ttft, token_times = 0.0, None, []
    while core.has_work():
        res = core.step(now)
        now += res.duration_s
        for o in res.outputs:
            token_times.append(now)
            if o.first_token:
                ttft = now
    expected = prof.prefill_overhead_s + prompt * prof.prefill_per_token_s
    assert ttft is not None and abs(ttft - expected) <= 0.05 * expected
    itls = [b - a for a, b in itertools.pairwise(token_times)]
    assert all(abs(x - prof.inter_token_latency_s) < 1e-9 for x in itls)


def test_cached_prefix_makes_ttft_cheap() -> None:
    prof = PROFILES["8b-h100"]
    core = EngineCore(EngineConfig(profile=prof, hash_seed=0), VOCAB)
    core.add_request(EngineRequest("a", toks(2048) + toks(32, 9000), max_tokens=1), 0.0)
    t1 = run(core)[1]
    core.add_request(EngineRequest("b", toks(2048) + toks(32, 8000), max_tokens=1), 0.0)
    t2 = run(core)[1]
    assert t2 == pytest.approx(prof.ttft_alone(2080, 2048))
    assert t1 / t2 > 3


def test_ttft_alone_matches_the_engine_over_several_chunks() -> None:
    """A prompt longer than one step's token budget is prefilled in chunks, one step
    overhead each: ttft_alone (the benchmark's TTFT floor) says what the engine does."""
    prof = PROFILES["8b-h100"].with_overrides(max_num_batched_tokens=1024)
    for prompt in (1000, 1024, 1025, 3000):
        core = EngineCore(EngineConfig(profile=prof, hash_seed=0), VOCAB)
        core.add_request(EngineRequest("a", toks(prompt), max_tokens=1), 0.0)
        assert run(core)[1] == pytest.approx(prof.ttft_alone(prompt))
    assert prof.ttft_alone(3000) == pytest.approx(3 * 0.030 + 3000 * 250e-6)
    assert prof.ttft_alone(100, 100) == 0.0


def test_decode_slows_with_batch_size() -> None:
    prof = PROFILES["8b-h100-fast"]
    assert prof.decode_time(1) == pytest.approx(prof.inter_token_latency_s)
    assert prof.decode_time(prof.max_num_seqs) == pytest.approx(
        prof.inter_token_latency_s * prof.decode_load_factor
    )
    assert prof.step_time(0, 0) == 0.0
    assert prof.step_time(100, 10) == pytest.approx(prof.prefill_time(100) + prof.decode_time(10))


# ------------------------------------------------------------------ fast forward


def _signature(core: EngineCore) -> list[tuple[object, ...]]:
    return sorted(
        (b.block_hash, b.parent_block_hash, tuple(b.token_ids), b.ref_cnt, b.block_id)
        for b in core.cached_blocks()
    )


@pytest.mark.parametrize("seed", range(20))
def test_fast_forward_equals_single_steps(seed: int) -> None:
    """Same tokens, events (order included), cache content, finishes and total time."""
    rng = random.Random(seed)
    kw = {
        "block_size": rng.choice([2, 4, 16]),
        "num_blocks": rng.choice([24, 40, 200]),
        "max_num_seqs": rng.choice([2, 4, 8]),
        "max_model_len": 48,
    }
    workload = [
        (
            rng.uniform(0, 0.5),
            f"r{i}",
            toks(rng.randint(2, 24), rng.choice([0, 0, 300, 600])),
            rng.randint(1, 20),
        )
        for i in range(rng.randint(3, 10))
    ]
    workload.sort()

    def drive(
        ff: bool,
    ) -> tuple[list[tuple[str, list[int]]], list[KVEvent], float, EngineCore, int]:
        core = engine(**kw)
        now, pending = 0.0, list(workload)
        toks_out: list[tuple[str, list[int]]] = []
        evs: list[KVEvent] = []
        calls = 0
        for _ in range(10_000):
            while pending and pending[0][0] <= now:
                _, rid, prompt, mt = pending.pop(0)
                core.add_request(EngineRequest(rid, prompt, max_tokens=mt), now)
            if not core.has_work():
                if not pending:
                    break
                now = pending[0][0]
                continue
            if ff:
                horizon = pending[0][0] - now if pending else None
                res = core.fast_forward(now, 50, max_duration_s=horizon)
            else:
                res = core.step(now)
            calls += 1
            now += res.duration_s
            toks_out.extend((o.request_id, o.new_token_ids) for o in res.outputs)
            evs.extend(res.events)
            core.pool.check_invariants()
        return toks_out, evs, now, core, calls

    a_toks, a_evs, a_end, a_core, a_calls = drive(False)
    b_toks, b_evs, b_end, b_core, b_calls = drive(True)

    def per_request(seq: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rid, t in seq:
            out.setdefault(rid, []).extend(t)
        return out

    assert per_request(a_toks) == per_request(b_toks)
    assert a_evs == b_evs
    assert _signature(a_core) == _signature(b_core)
    assert b_end == pytest.approx(a_end)
    assert a_core.stats().num_steps == b_core.stats().num_steps
    assert a_core.stats().num_preemptions == b_core.stats().num_preemptions
    assert b_calls <= a_calls


def test_fast_forward_takes_many_steps_at_once() -> None:
    core = engine(block_size=16, max_num_seqs=4)
    for i in range(4):
        core.add_request(EngineRequest(f"r{i}", toks(40, 100 * i), max_tokens=200), 0.0)
    core.step(0.0)
    res = core.fast_forward(1.0, 1000)
    assert res.num_steps == 199 and all(o.finished for o in res.outputs)
    assert res.duration_s == pytest.approx(199 * core.latency.decode_time(4))
    assert not core.has_work()


def _admission_scenario(reserve: bool) -> tuple[EngineCore, int | None]:
    """R1 (600-token prompt, 300 decode steps) fills most of 100 blocks; R2's 1,200-token
    prompt arrives after R1's prefill: its first 256-token chunk fits, its whole sequence
    does not."""
    core = engine(
        block_size=16, num_blocks=100, max_num_batched_tokens=256, max_model_len=1600,
        reserve_full_sequence=reserve,
    )  # fmt: skip
    core.add_request(EngineRequest("R1", toks(600), max_tokens=300), 0.0)
    now = 0.0
    for _ in range(3):  # R1's prefill: 256 + 256 + 88 tokens
        now += core.step(now).duration_s
    core.add_request(EngineRequest("R2", toks(1200, 5000), max_tokens=4), now)
    admitted = None
    for k in range(1, 1000):  # bounded: ~305 steps
        if not core.has_work():
            break
        now += core.step(now).duration_s
        r2 = core.get_request("R2")
        if admitted is None and r2 is not None and r2.first_scheduled_time is not None:
            admitted = k
    assert not core.has_work()
    return core, admitted


def test_a_request_is_admitted_only_when_its_whole_sequence_fits() -> None:
    """vLLM's scheduler_reserve_full_isl (on by default): R2 waits for R1 to finish, with
    no preemption and no prefill computed twice. Admitting on the first chunk alone let R2
    in, then preempted it part-way (its chunks recomputed, R1's decode slowed)."""
    core, admitted = _admission_scenario(True)
    st = core.stats()
    assert st.num_preemptions == 0 and st.num_prompt_tokens_computed == 1800
    assert admitted is not None and admitted >= 299  # after R1's 300 decode steps
    old, early = _admission_scenario(False)  # the first-chunk rule, for contrast
    assert early == 1 and old.stats().num_preemptions >= 1
    assert old.stats().num_prompt_tokens_computed > 1800


def test_prefix_cache_counters_leave_out_readmissions_after_preemption() -> None:
    """vLLM counts a preempted request's re-admission apart (preempted_queries / hits), not
    in vllm:prefix_cache_queries / hits."""
    core = engine(block_size=4, num_blocks=12, max_num_batched_tokens=64)
    core.add_request(EngineRequest("R1", toks(16), max_tokens=20), 0.0)
    core.add_request(EngineRequest("R2", toks(16, 100), max_tokens=20), 0.0)
    run(core)
    st = core.stats()
    assert st.num_preemptions >= 1
    assert st.prefix_cache_queries == 32 and st.prefix_cache_hits == 0


def test_prompt_bytes_of_another_prompt_are_refused() -> None:
    """EngineRequest.prompt_bytes is trusted input checked at constant cost (length, first
    and last id): bytes of another prompt would cache blocks under hashes they do not hold
    and serve a later prompt KV it never computed (review of ff513cb)."""
    e = _review_engine()
    a, b = [*range(8), 99], [*range(100, 108), 99]
    with pytest.raises(ValueError, match="prompt_bytes"):
        e.add_request(EngineRequest("a", a, 2, prompt_bytes=tokens_to_bytes(b)), 0.0)
    with pytest.raises(ValueError, match="prompt_bytes"):
        e.add_request(EngineRequest("a", a, 2, prompt_bytes=tokens_to_bytes(a)[:-4]), 0.0)
    e.add_request(EngineRequest("a", a, 2, prompt_bytes=tokens_to_bytes(a)), 0.0)
    assert e.has_work()


def test_a_salt_that_is_no_string_is_refused() -> None:
    """1 == True == 1.0: the engine's per-(adapter, salt) cache of encodings would let such
    salts share blocks although they hash differently; vLLM takes strings only."""
    e = _review_engine()
    for bad in (1, True, 1.0, b"s"):
        with pytest.raises(RequestRejectedError, match="cache_salt"):
            e.add_request(EngineRequest("x", list(range(9)), 1, cache_salt=bad), 0.0)  # type: ignore[arg-type]


def _review_engine() -> EngineCore:
    flat = LatencyProfile("flat", 0.01, 0.001, 0.005, max_num_seqs=8)
    return EngineCore(
        EngineConfig(profile=flat, hash_seed=1, block_size=4, num_blocks=64), range(1000, 1100)
    )
