"""An empty `KVGATE_SALT_SECRETS` or `KVGATE_ADMIN_KEY` (a template's unset variable) is
refused at start-up, as the settings refuse every other empty value (review R2, O8).

An empty salt-secret list was "no secret": a random per-process salt, so no two gateways
(nor one restarted) shared a cached prefix, under a warning that said the variable was
absent when it was set. An empty admin key disabled the admin API and /metrics (every call
401) without a word."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from cachecore.argtypes import settings_error
from gateway.cli import main
from gateway.settings import GatewaySettings


@pytest.mark.parametrize("value", ["", " ", " , ", ",,"])
def test_empty_salt_secrets_are_refused(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_SALT_SECRETS", value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert "salt_secrets (KVGATE_SALT_SECRETS): empty: " in settings_error(info.value)
    assert main(["serve", "--open", "--port", "0"]) == 2
    said = [s for s in capsys.readouterr().err.splitlines() if s.startswith("kvgate serve")]
    assert len(said) == 1 and said[0].startswith(
        "kvgate serve: salt_secrets (KVGATE_SALT_SECRETS): empty: give one or two secrets"
    )


@pytest.mark.parametrize("value", ["", " ", "\n"])
def test_an_empty_admin_key_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_KEY", value)
    with pytest.raises(ValidationError) as info:
        GatewaySettings()
    assert "admin_key (KVGATE_ADMIN_KEY): empty: " in settings_error(info.value)
    assert main(["serve", "--open", "--port", "0"]) == 2
    said = [s for s in capsys.readouterr().err.splitlines() if s.startswith("kvgate serve")]
    assert said == [
        "kvgate serve: admin_key (--admin-key, KVGATE_ADMIN_KEY): empty: give a key, or unset"
        " the variable to disable the admin API"
    ]
    monkeypatch.delenv("KVGATE_ADMIN_KEY")
    assert main(["serve", "--open", "--port", "0", "--admin-key", value]) == 2


def test_set_or_unset_they_still_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_SALT_SECRETS", raising=False)
    monkeypatch.delenv("KVGATE_ADMIN_KEY", raising=False)
    s = GatewaySettings()
    assert s.salt_secrets == [] and s.admin_key is None  # unset: random salt, admin closed
    monkeypatch.setenv("KVGATE_SALT_SECRETS", "0123456789abcdef0, 0123456789abcdef1,")
    monkeypatch.setenv("KVGATE_ADMIN_KEY", "adm-key\n")  # a secret file's newline
    s = GatewaySettings()
    assert [x.get_secret_value() for x in s.salt_secrets] == [
        "0123456789abcdef0",
        "0123456789abcdef1",
    ]
    assert s.admin_key is not None and s.admin_key.get_secret_value() == "adm-key"
    assert GatewaySettings(salt_secrets=[SecretStr("s" * 32)]).salt_secrets[0] is not None
