"""``kvgate bench soak``: its checks detect what they claim to, its traffic mix is what it
says, and a short soak through the real stack (replicas, Redis, gateway, agents) passes."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections import Counter

from loadtest.soak import (
    ABANDON,
    BAD_JSON,
    BAD_KEY,
    ENGINE_RESTART,
    NO_MODEL,
    OK_JSON,
    OK_STREAM,
    REDIS_RESTART,
    ChaosEvent,
    Outcome,
    Sample,
    SoakReport,
    cut_by_restart,
    growth_verdict,
    metric_sum,
    metric_value,
    soak_schedule,
    verdicts,
)
from loadtest.workloads import TextSource


def test_growth_verdict_flags_a_leak_and_passes_a_cache_that_levels_off() -> None:
    leak = [100.0 + 0.5 * i for i in range(60)]  # +0.5 MiB per sample to the end
    ok, grew = growth_verdict(leak, 0.3, 4.0, 0.02)
    assert not ok and grew > 4.0
    # a bounded cache: fills during warm-up and the first half, then flat (with noise)
    fills = [100.0 + min(i, 30) * 0.8 + (0.3 if i % 2 else -0.3) for i in range(60)]
    assert growth_verdict(fills, 0.3, 4.0, 0.02)[0]
    assert growth_verdict([1.0, 2.0], 0.3, 0.0, 0.0) == (True, 0.0)  # too few samples


def test_metric_parsing_sums_label_sets() -> None:
    text = (
        "# HELP kvgate_prompt_tokens_total x\n"
        'kvgate_prompt_tokens_total{replica="r0"} 100.0\n'
        'kvgate_prompt_tokens_total{replica="r1"} 50.0\n'
        "kvgate_in_flight_requests 3.0\n"
    )
    assert metric_sum(text, "kvgate_prompt_tokens_total") == 150.0
    assert metric_value(text, "kvgate_in_flight_requests") == 3.0
    assert metric_value(text, "kvgate_missing") is None
    assert metric_sum(text, "kvgate_missing") == 0.0
    assert metric_sum(text, "kvgate_prompt_tokens_total", 'replica="r1"') == 50.0
    assert metric_sum(text, "kvgate_prompt_tokens_total", 'replica="r2"') == 0.0


def test_schedule_is_deterministic_sorted_and_mixes_every_kind() -> None:
    text = TextSource()
    a = soak_schedule(4.0, 8.0, 3, text)
    assert a == soak_schedule(4.0, 8.0, 3, text)
    assert all(x.t <= y.t for x, y in itertools.pairwise(a))
    assert a[0].t >= 0 and a[-1].t < 240.0
    assert 0.8 * 8.0 * 240 <= len(a) <= 1.25 * 8.0 * 240  # about the offered rate
    kinds = Counter(r.kind for r in a)
    assert set(kinds) == {OK_STREAM, OK_JSON, ABANDON, BAD_JSON, BAD_KEY, NO_MODEL}
    assert kinds[OK_STREAM] + kinds[OK_JSON] > 0.9 * len(a)
    assert {r.item.sensitive for r in a} == {None, "session", "request"}
    assert len({r.item.tenant for r in a}) == 4
    assert any(r.item.session and not r.item.sensitive for r in a)  # multi-turn sessions
    assert all(r.kind != ABANDON or r.item.api == "chat" for r in a)


def _report(**kw: object) -> SoakReport:
    samples = [
        Sample(float(i), 100.0, 40, 9, 160, 0, 2.0, 12, i, 0, 0.2, 0.8, 0.1 * i) for i in range(40)
    ]
    base: dict[str, object] = {
        "samples": samples,
        "outcomes": [Outcome(OK_STREAM, 1.0, 200), Outcome(BAD_KEY, 1.0, 401)],
        "baseline_fds": 36,
        "baseline_upstream": 4,
        "final_fds": 50,
        "final_upstream": 14,
        "max_idle_upstream": 128,
        "final_in_flight": 0,
        "replica_accounts": [
            {
                "id": "r0",
                "in_flight": 0,
                "own_queued_tokens": 0,
                "own_queued_requests": 0,
                "own_running": 0,
            },
        ],
        "exactness": {"r0": (10, 10, 0)},
        "reloads": 2,
        "reload_failures": 0,
        "wall_s": 40.0,
        "gateway_cpu_s": 4.0,
    }
    base.update(kw)
    return SoakReport(**base)  # type: ignore[arg-type]


def test_verdicts_pass_a_clean_run_and_fail_each_fault() -> None:
    assert all(ok for _, ok, _ in verdicts(_report(), 0.3))

    def failed(rep: SoakReport) -> set[str]:
        return {name for name, ok, _ in verdicts(rep, 0.3) if not ok}

    # a faulty request answered 200, a good one with 500, an error that is not OpenAI's
    assert failed(_report(outcomes=[Outcome(BAD_JSON, 1.0, 200)])) == {
        "every request got its right answer"
    }
    assert failed(_report(outcomes=[Outcome(OK_JSON, 1.0, 500)]))
    assert failed(_report(outcomes=[Outcome(BAD_KEY, 1.0, 401, None, "not an OpenAI error")]))
    dirty = [{"id": "r0", "in_flight": 0, "own_queued_tokens": 512, "own_queued_requests": 1,
              "own_running": 0}]  # fmt: skip
    assert failed(_report(replica_accounts=dirty)) == {"in-flight accounting back to zero"}
    assert failed(_report(final_in_flight=1)) == {"in-flight accounting back to zero"}
    assert failed(_report(exactness={"r0": (10, 12, 2)})) == {
        "Redis index == engines' cached blocks"
    }
    assert failed(_report(exactness={})) == {"Redis index == engines' cached blocks"}
    # a leaked client socket or file: other fds up; an upstream pool past its bound
    assert failed(_report(final_fds=50 + 9)) == {"open fds back to baseline"}
    assert failed(_report(final_fds=50 + 200, final_upstream=14 + 200)) == {
        "open fds back to baseline"
    }
    assert not failed(_report(final_fds=50 + 100, final_upstream=14 + 100))  # pool within
    assert failed(_report(reload_failures=1)) == {"policy reloads under load"}
    leaky = [
        Sample(float(i), 100.0 + i, 40, 9, 160 + 3 * i, 0, 2.0, 12, i, 0, 0.2, 0.8, 0.1 * i)
        for i in range(40)
    ]
    assert failed(_report(samples=leaky)) == {"gateway RSS levels off", "metric series bounded"}
    slower = [
        Sample(float(i), 100.0, 40, 9, 160, 0, 2.0, 12, i, 0, 0.2, 0.3 if i < 30 else 1.5, 0.1)
        for i in range(40)
    ]
    assert failed(_report(samples=slower)) == {"no TTFT drift"}


def test_only_clean_failures_during_their_engines_restart_are_tolerated() -> None:
    chaos = [ChaosEvent(10.0, ENGINE_RESTART, "r1"), ChaosEvent(30.0, REDIS_RESTART, None)]

    def failed(**kw: object) -> Outcome:
        base: dict[str, object] = {"kind": OK_STREAM, "t_done": 10.5, "status": 200,
                                   "error": "stream error: engine restarted", "t_start": 9.0,
                                   "replica": "r1", "clean_error": True}  # fmt: skip
        base.update(kw)
        return Outcome(**base)  # type: ignore[arg-type]

    assert cut_by_restart(failed(), chaos)
    assert cut_by_restart(failed(kind=OK_JSON, status=502, error=None), chaos)
    assert not cut_by_restart(failed(clean_error=False), chaos)  # garbage is never fine
    assert not cut_by_restart(failed(replica="r0"), chaos)  # another engine restarted
    assert not cut_by_restart(failed(t_start=20.0, t_done=21.0), chaos)  # long after it
    assert not cut_by_restart(failed(t_start=29.0, t_done=31.0), chaos)  # Redis: no excuse
    assert not cut_by_restart(Outcome(BAD_KEY, 10.5, 200, None, None, 9.0, "r1"), chaos)
    ok = Outcome(OK_STREAM, 10.5, 200, 0.1, None, 9.0, "r1")
    assert not cut_by_restart(ok, chaos)  # right answers need no excuse
    rep = _report(outcomes=[failed(), ok], chaos=chaos)
    assert all(ok for _, ok, _ in verdicts(rep, 0.3))
    rep = _report(outcomes=[failed(replica="r0"), ok], chaos=chaos)
    assert {n for n, ok, _ in verdicts(rep, 0.3) if not ok} == {
        "every request got its right answer"
    }


def test_a_short_soak_through_the_real_stack_passes() -> None:
    """Two replicas, a private redis-server, the gateway with embedded agents: 30 s of the
    mix. The checks that hold in any run must pass: right answers, accounting back to zero,
    index == engines, fds, reloads. RSS, series and TTFT drift need minutes to mean
    anything (the recorded 10-minute soak; their logic is tested above on synthetic runs),
    so a loaded CI machine must not fail this test on them."""
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "soak", "--minutes", "0.5", "--rate",
         "5", "--replicas", "2", "--sample-s", "2", "--reload-s", "10", "--drain-s", "60"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), out[-4000:]
    for check in (
        "every request got its right answer",
        "in-flight accounting back to zero",
        "Redis index == engines' cached blocks",
        "open fds back to baseline",
        "policy reloads under load",
    ):
        assert f"| {check} | pass |" in out, (check, out[-4000:])
    assert "| gateway RSS levels off |" in out and "| no TTFT drift |" in out
