"""Every ``kvgate`` subcommand's --help speaks to its user: no internal names."""

from __future__ import annotations

import re

import pytest

from gateway.cli import SUBCOMMANDS, main


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_names_no_private_function(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate agent --help` pointed at ``_gc_freezer``, a function of its source."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "usage: kvgate" in text
    assert not re.findall(r"(?<![\w-])_[a-z]\w*", text), text


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_names_only_variables_that_exist(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``KVGATE_*`` variable a --help names is read by a settings class of kvgate."""
    from cachecore.agent.settings import AgentSettings
    from cachecore.replica.settings import ReplicaSettings
    from gateway.settings import GatewaySettings

    known = {
        (str(cls.model_config.get("env_prefix", "")) + field).upper()
        for cls in (GatewaySettings, AgentSettings, ReplicaSettings)
        for field in cls.model_fields
    }
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    named = set(re.findall(r"KVGATE_[A-Z0-9_]*[A-Z0-9]", text))
    assert named <= known, sorted(named - known)


def _help_blocks(text: str) -> dict[str, str]:
    """Each option of a --help text -> its block (the option's line and its help's lines)."""
    blocks: dict[str, str] = {}
    names: list[str] = []
    for line in text.splitlines():
        m = re.match(r"  (-[\w-]+(?:, -[\w-]+)*)(?:\s|$)", line)
        if m:
            names = m.group(1).split(", ")
        elif not line.startswith("   "):  # a section's title or a blank line: no option's
            names = []
            continue
        for name in names:
            blocks[name] = f"{blocks.get(name, '')} {line.strip()}"
    return blocks


def _setting_flags(command: str) -> tuple[dict[str, str], set[str]]:
    """(option -> the environment variable of the setting it sets, the options that set
    theirs false) of ``kvgate COMMAND``, read off what builds its settings: the agent's and
    the replica's maps of flag to field (all their settings_from_args / build_settings
    read), serve's by giving each flag alone and seeing which setting it moves (its
    settings_from_args names them one by one)."""
    import argparse

    from cachecore.agent import cli as agent_cli
    from cachecore.agent.settings import AgentSettings
    from cachecore.replica import cli as replica_cli
    from cachecore.replica.settings import ReplicaSettings

    def options(configure: object) -> dict[str, argparse.Action]:
        parser = argparse.ArgumentParser()
        configure(parser)  # type: ignore[operator]
        return {a.dest: a for a in parser._actions if a.option_strings}

    def by_map(configure: object, fields: dict[str, str], prefix: str) -> dict[str, str]:
        acts = options(configure)
        return {
            next(o for o in acts[dest].option_strings if o.startswith("--")): prefix + field.upper()
            for dest, field in fields.items()
        }

    if command == "agent":
        assert set(agent_cli._FIELDS.values()) <= set(AgentSettings.model_fields)
        return by_map(agent_cli.configure, agent_cli._FIELDS, "KVGATE_AGENT_"), set()
    if command == "replica":
        fields = dict(replica_cli._SETTINGS_FLAGS)
        # build_settings' switches: --no-events sets publish_events false
        for dest in ("legacy_replay_reply", "access_log", "drop_last_hit_block"):
            fields[dest] = dest
        fields["no_events"] = "publish_events"
        assert set(fields.values()) <= set(ReplicaSettings.model_fields)
        return by_map(replica_cli.configure, fields, "KVGATE_REPLICA_"), {"--no-events"}
    assert command == "serve"
    return _serve_setting_flags()


def _serve_setting_flags() -> tuple[dict[str, str], set[str]]:
    import argparse

    from pydantic import ValidationError

    from gateway.serve import configure, settings_from_args
    from gateway.settings import GatewaySettings

    parser = argparse.ArgumentParser(exit_on_error=False)
    configure(parser)
    fields = GatewaySettings.model_fields
    base, again = (settings_from_args(parser.parse_args([])) for _ in range(2))
    random = {f for f in fields if getattr(base, f) != getattr(again, f)}  # gateway_id
    out: dict[str, str] = {}
    negated: set[str] = set()
    for action in parser._actions:
        option = next((o for o in action.option_strings if o.startswith("--")), None)
        if option is None or option == "--help":
            continue
        if action.nargs == 0:
            values: list[list[str]] = [[]]
        elif action.choices:
            values = [[str(next(iter(action.choices)))]]
        else:  # an int, a log level, any text
            values = [["7"], ["DEBUG"], ["x"]]
        for value in values:
            try:
                args = parser.parse_args([option, *value])
            except (argparse.ArgumentError, SystemExit):
                continue
            break
        else:
            raise AssertionError(f"no value found for {option}")
        try:
            got = settings_from_args(args)
        except ValidationError as exc:  # refused: the error names the setting it set
            moved = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
        else:
            moved = {f for f in fields if getattr(got, f) != getattr(base, f)} - random
            negated |= {option for f in moved if getattr(got, f) is False}
        assert len(moved) <= 1, (option, moved)
        for field in moved:
            out[option] = "KVGATE_" + field.upper()
    return out, negated


@pytest.mark.parametrize("command", ["serve", "agent", "replica"])
def test_every_flag_that_sets_a_setting_names_its_variable(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each flag of ``kvgate serve``, ``agent`` and ``replica`` that sets a setting names,
    in --help, the ``KVGATE_*`` variable of that setting (``VAR=false`` for a flag that sets
    it false), as every setting can come from either. They named it for some flags only:
    serve 9 of 19 (not --policy, --replica, --redis, --open, ...), agent 3 of 23, replica
    none of 23."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("KVGATE_"):
            monkeypatch.delenv(name)
    flags, negated = _setting_flags(command)
    assert len(flags) >= 19, flags
    if command == "serve":
        # every serve flag sets a setting, so every one is checked here: --strategy set
        # none (it went to build_gateway beside the settings) and had no variable
        import argparse

        from gateway.serve import configure

        parser = argparse.ArgumentParser()
        configure(parser)
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        assert options - {"--help"} <= set(flags), sorted(options - {"--help"} - set(flags))
    with pytest.raises(SystemExit):
        main([command, "--help"])
    blocks = _help_blocks(capsys.readouterr().out)
    missing = []
    for option, var in sorted(flags.items()):
        said = f"{var}=false" if option in negated else var
        if not re.search(rf"\benv {re.escape(said)}(?![\w=])", blocks.get(option, "")):
            missing.append(f"{option}: {said}")
    assert not missing, missing
