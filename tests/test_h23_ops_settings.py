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
