"""``kvgate serve --strategy`` has an environment variable, ``KVGATE_STRATEGY``, as every
other flag of it that sets something has one.

``--strategy`` set no setting: ``kvgate serve`` handed it to ``build_gateway`` beside the
settings, as ``Gateway.strategy_override``, the strategy that wins over the policy's
``routing.strategy`` for the life of the process. So it had no variable (d2624c2 names each
setting's variable in --help, and noted this flag had none), a deployment configured by
environment could not set it, and ``KVGATE_STRATEGY`` was warned about as no setting and
ignored. It is now the setting ``strategy``: the flag wins over the variable, the variable
over the policy's ``routing.strategy``, and a policy reload moves neither (an explain's
``?strategy=`` still wins for its one call)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.routing import Strategy
from gateway.settings import GatewaySettings
from tests.test_gateway_support import stack, words

pytestmark = pytest.mark.timeout(60)

POLICY = "routing:\n  strategy: prefix_affinity\n"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    import os

    for name in list(os.environ):
        if name.upper().startswith("KVGATE_"):
            monkeypatch.delenv(name)
    yield monkeypatch


def _serve_settings(argv: list[str]) -> GatewaySettings:
    from gateway.serve import configure, settings_from_args

    parser = argparse.ArgumentParser()
    configure(parser)
    return settings_from_args(parser.parse_args(argv))


def test_the_variable_sets_it_and_the_flag_wins(clean_env: pytest.MonkeyPatch) -> None:
    assert _serve_settings([]).strategy is None
    clean_env.setenv("KVGATE_STRATEGY", "round_robin")
    assert _serve_settings([]).strategy is Strategy.ROUND_ROBIN
    got = _serve_settings(["--strategy", "least_loaded"])
    assert got.strategy is Strategy.LEAST_LOADED


def test_a_bad_value_is_one_line_naming_the_flag_and_the_variable(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway import serve
    from gateway.cli import main

    def no_listening(*args: object, **kw: object) -> None:
        # a refusal ends before the listeners: past them this would serve until killed
        raise AssertionError("kvgate serve got past its settings")

    clean_env.setattr(serve, "bind_listeners", no_listening)
    clean_env.setenv("KVGATE_STRATEGY", "fastest")
    assert main(["serve", "--open"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("kvgate serve: strategy (--strategy, KVGATE_STRATEGY): "), err
    assert "round_robin" in err[0], err


def test_the_variable_is_no_longer_warned_about(clean_env: pytest.MonkeyPatch) -> None:
    from gateway.serve import unknown_settings

    assert unknown_settings({"KVGATE_STRATEGY": "random"}) == []
    assert unknown_settings({"KVGATE_STRATEGIES": "random"})  # a typo still is


@pytest.mark.parametrize("flag", [None, "least_loaded"])
async def test_precedence_through_the_running_gateway(
    clean_env: pytest.MonkeyPatch, flag: str | None
) -> None:
    """The variable over the policy's routing.strategy, the flag over the variable (as
    ``kvgate serve`` passes it: into the settings), and a policy reload moves neither: the
    admin API says so and the requests are routed by it."""
    clean_env.setenv("KVGATE_STRATEGY", "round_robin")
    want = flag or "round_robin"
    extra: dict[str, Any] = {"strategy": flag} if flag is not None else {}
    async with stack(count=2, policy=POLICY, **extra) as st, st.http() as h:
        adm = st.admin_headers()
        got = (await h.get("/admin/policy", headers=adm)).json()
        assert got["policy"]["routing"]["strategy"] == "prefix_affinity"
        assert (got["strategy_in_effect"], got["strategy_override"]) == (want, want)
        for i in range(4):
            r = await h.post(
                "/v1/completions",
                json={"model": st.model, "prompt": words(32, i), "max_tokens": 1},
            )
            assert r.status_code == 200, r.text
        decided = {
            s.labels["strategy"]
            for m in st.gw.metrics.decisions.collect()
            for s in m.samples
            if s.name.endswith("_total") and s.value > 0
        }
        assert decided == {want}, decided
        r = await h.post(
            "/admin/policy", headers=adm, content="routing:\n  strategy: consistent_hash\n"
        )
        assert r.status_code == 200, r.text
        assert (r.json()["strategy"], r.json()["strategy_in_effect"]) == ("consistent_hash", want)


async def test_without_either_the_policy_decides(clean_env: pytest.MonkeyPatch) -> None:
    async with stack(count=1, policy=POLICY) as st, st.http() as h:
        got = (await h.get("/admin/policy", headers=st.admin_headers())).json()
        assert got["strategy_in_effect"] == "prefix_affinity"
        assert "strategy_override" not in got


@pytest.mark.parametrize(
    ("variable", "flag", "want"),
    [(None, None, None), ("round_robin", None, "round_robin"), ("round_robin", "random", "random")],
)
def test_kvgate_serve_hands_the_setting_to_the_gateway(
    clean_env: pytest.MonkeyPatch, variable: str | None, flag: str | None, want: str | None
) -> None:
    """``kvgate serve`` itself: the gateway it serves has the flag's or the variable's
    strategy as its override (run() builds it from the settings alone; it used to pass the
    flag to build_gateway again, redundantly)."""
    from cachecore.testing import free_port
    from gateway import serve
    from gateway.cli import main

    seen: list[Strategy | None] = []

    def no_serving(self: serve._DrainingServer, sockets: object = None) -> None:
        seen.append(self.gw.strategy_override)  # the gateway it would serve; not served

    clean_env.setattr(serve._DrainingServer, "run", no_serving)
    clean_env.setattr(serve, "configure_logging", lambda *args: None)  # the test's logging
    if variable is not None:
        clean_env.setenv("KVGATE_STRATEGY", variable)
    argv = ["serve", "--open", "--host", "127.0.0.1", "--port", str(free_port())]
    assert main(argv + (["--strategy", flag] if flag else [])) == 0
    assert seen == [Strategy(want) if want else None]
