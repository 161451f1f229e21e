"""The isolation attack suite, run for real at its quick sizes, and shown able to fail: the
same attacks against a gateway with scoping disabled must report BROKEN. Plus the
statistics the probes rely on (KS critical values, power plans, Fisher power) and the
outcome rules."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.attack import _only, exit_code
from loadtest.attacks.common import AttackResult, Outcome
from loadtest.attacks.flooding import FloodConfig, FloodReport, FloodRun
from loadtest.attacks.flooding import results as flood_results
from loadtest.attacks.routing import RoutingConfig, fisher_p, fisher_power, plan_routing_n
from loadtest.attacks.timing import ks_critical_k, ks_power, ks_test, one_block_shape, plan_n


def _attack(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "attack.json"
    proc = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "attack", "--quick", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(out.read_text()), proc.stdout


def test_quick_suite_holds(tmp_path: Path) -> None:
    rc, report, stdout = _attack(tmp_path)
    rows = report["rows"]
    assert "| attack | trials | outcome | figures |" in stdout
    assert {int(r["attack"].split()[0]) for r in rows} == {1, 2, 3, 4, 5, 6}
    not_held = [(r["attack"], r["outcome"], r["figures"]) for r in rows if r["outcome"] != "held"]
    assert not not_held
    assert rc == 0 and report["exit_code"] == 0


def test_suite_catches_a_gateway_without_scoping(tmp_path: Path) -> None:
    rc, report, _ = _attack(tmp_path, "--only", "1,2,4", "--unsafe-shared-scope")
    by_name = {r["attack"]: r for r in report["rows"]}
    assert rc == 1
    broken = {name for name, r in by_name.items() if r["outcome"] == "BROKEN"}
    assert "1 timing: B probes A's cached prompts (engine TTFT)" in broken
    assert any(name.startswith("1 timing: gateway path") for name in broken)
    assert any(name.startswith("1 timing: engine-tokenized path") for name in broken)
    assert "2 routing: B's replica for A's prefixes vs random" in broken
    assert "4 salt spoofing: client cache_salt (incl. A's real one)" in broken
    # The positive controls still fire: the misconfiguration is what is detected.
    assert by_name["1 timing: positive control, scoping off, 1 shared block"]["outcome"] == "held"


# ------------------------------------------------------------------------- statistics


@pytest.mark.parametrize(("n", "alpha"), [(10, 0.001), (14, 0.001), (30, 0.01), (60, 0.001)])
def test_ks_critical_k_is_the_exact_threshold(n: int, alpha: float) -> None:
    k = ks_critical_k(n, alpha)
    base = np.arange(n, dtype=float)
    assert ks_test(base.tolist(), (base + k - 0.5).tolist())[1] < alpha
    assert ks_test(base.tolist(), (base + k - 1.5).tolist())[1] >= alpha


def test_ks_power_grows_with_effect_and_n() -> None:
    noise = list(np.random.default_rng(1).normal(0.1, 0.002, 32))
    rng = np.random.default_rng(0)
    assert ks_power(noise, 0.0, 20, 0.001, 400, rng) < 0.05
    small = ks_power(noise, 0.002, 14, 0.001, 400, rng)
    big = ks_power(noise, 0.008, 14, 0.001, 400, rng)
    more = ks_power(noise, 0.002, 40, 0.001, 400, rng)
    assert small < big and small < more and big > 0.95


def test_plan_n_is_the_smallest_sufficient_n() -> None:
    noise = list(np.random.default_rng(2).normal(0.1, 0.003, 24))
    plan = plan_n(noise, 0.006, 0.001, 0.99, 10, 120, 400, seed=0)
    assert plan.power >= 0.99 and 10 <= plan.n < 120
    rng = np.random.default_rng(0)  # the plan's own draws: every smaller n fell short
    assert all(ks_power(noise, 0.006, n, 0.001, 400, rng) < 0.99 for n in range(10, plan.n))
    hopeless = plan_n(noise, 0.0, 0.001, 0.99, 10, 40, 200, seed=0)
    assert hopeless.n == 40 and hopeless.power < 0.99


def test_routing_power_plan_and_fisher() -> None:
    cfg = RoutingConfig()
    n, power = plan_routing_n(cfg)
    assert power >= cfg.power
    assert fisher_power(n - 1, cfg.leak_rate, 1 / cfg.replicas, cfg.alpha_detect) < cfg.power
    assert fisher_p(n, n // 4, n) < 0.001 and fisher_p(n // 4, n // 4, n) == pytest.approx(1.0)


def test_one_block_shape_shares_exactly_one_block() -> None:
    shape = one_block_shape(24, 8, 16)
    assert 0 < shape.shared_words < 24


# ------------------------------------------------------------------------- outcome rules


def _run(label: str, rate: float) -> FloodRun:
    return FloodRun(label, rate, 72, 0, 120, 10)


def test_flooding_without_a_hurting_flood_has_no_power() -> None:
    cfg = FloodConfig()
    weak = FloodReport([_run("none", 0.9), _run("defended", 0.88), _run("open", 0.85)], 1.0)
    assert flood_results(weak, cfg)[0].outcome is Outcome.NO_POWER
    held = FloodReport([_run("none", 0.9), _run("defended", 0.88), _run("open", 0.4)], 1.0)
    assert flood_results(held, cfg)[0].outcome is Outcome.HELD
    broken = FloodReport([_run("none", 0.9), _run("defended", 0.7), _run("open", 0.4)], 1.0)
    assert flood_results(broken, cfg)[0].outcome is Outcome.BROKEN
    # a part of the defence alone is an ablation: reported, never judged
    parts = replace(cfg, defences=("confine", "budget+confine"))
    both = FloodReport(
        [_run("none", 0.9), _run("confine", 0.7), _run("both", 0.88), _run("open", 0.4)], 1.0
    )
    rows = flood_results(both, parts)
    assert [r.outcome for r in rows] == [Outcome.ABLATION, Outcome.HELD]
    assert "within the bound: no" in rows[0].figures
    assert exit_code(rows) == 0


def test_exit_code_and_only() -> None:
    def row(o: Outcome) -> AttackResult:
        return AttackResult("1 x", "1", o, "")

    assert exit_code([row(Outcome.HELD)]) == 0
    assert exit_code([row(Outcome.HELD), row(Outcome.NO_POWER)]) == 3  # 2 is a usage error
    assert exit_code([row(Outcome.NO_POWER), row(Outcome.BROKEN)]) == 1
    assert _only("1,4") == {1, 4}
    for bad in ("7", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _only(bad)
