"""`kvgate serve` settings an operator gets wrong: one clear line, exit 2, nothing started."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.cli import main
from gateway.serve import settings_error
from gateway.settings import GatewaySettings


@pytest.mark.parametrize("host", ["", " "])
def test_an_empty_host_is_refused_not_every_interface(
    host: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`KVGATE_HOST=` (a template's unset variable) or `--host ''` listened on 0.0.0.0 and
    [::]: the gateway, loopback-only by default, was open on every interface without
    anyone asking for it. Refused, naming the explicit way."""
    with pytest.raises(ValidationError) as info:
        GatewaySettings(host=host)
    assert "host (KVGATE_HOST): empty" in settings_error(info.value)
    monkeypatch.setenv("KVGATE_HOST", host)
    with pytest.raises(ValidationError):
        GatewaySettings()
    assert main(["serve", "--open", "--port", "0", "--host", host]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvgate serve: host (KVGATE_HOST): empty: give 0.0.0.0 (or ::) to listen on every interface"
    ]


@pytest.mark.parametrize("name", ["KVGATE_DRAIN_GRACE_S", "KVGATE_POLICY_POLL_S"])
@pytest.mark.parametrize("value", ["inf", "Infinity", "1e400"])
def test_an_infinite_grace_or_poll_is_refused(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_DRAIN_GRACE_S=inf` was accepted and a SIGTERM then never stopped the gateway
    (it answered 503 `draining` until killed); `KVGATE_POLICY_POLL_S=inf` started a policy
    watcher that slept forever, so file edits were silently never applied."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert f"({name}): Input should be a finite number" in settings_error(info.value)
