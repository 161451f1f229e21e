"""Review R2's O5: eight agent settings (scrape_timeout_s, replay_total_timeout_s,
max_replay_batches, stale_probe_cooldown_s, queue_size, rcvhwm, max_coalesce_blocks,
resync_chunk_blocks) existed only as environment variables and were documented nowhere.
docs/agent.md's Settings table now names every AgentSettings field's variable, its flag
(the CLI's own map) and its default; this holds the table to the class both ways."""

from __future__ import annotations

import re
from pathlib import Path

from cachecore.agent import cli
from cachecore.agent.settings import AgentSettings

AGENT_MD = Path(__file__).resolve().parents[1] / "docs" / "agent.md"


def _rows() -> dict[str, tuple[str, str]]:
    """variable -> (flag cell, default cell) of the Settings table."""
    text = AGENT_MD.read_text()
    m = re.search(r"^### Settings$(.*?)(?=^#)", text, re.M | re.S)
    assert m, "docs/agent.md has no Settings section"
    rows = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`KVGATE_AGENT_"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def _default(field: str) -> str | None:
    info = AgentSettings.model_fields[field]
    if info.is_required() or info.default is None:
        return None
    value = info.default
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def test_every_setting_is_in_the_table_with_its_flag_and_default() -> None:
    rows = _rows()
    prefix = str(AgentSettings.model_config.get("env_prefix", "")).upper()
    flags = {field: "--" + flag.replace("_", "-") for flag, field in cli._FIELDS.items()}
    variables = {prefix + f.upper(): f for f in AgentSettings.model_fields}
    assert set(rows) == set(variables), set(rows) ^ set(variables)
    for var, field in variables.items():
        flag_cell, default_cell = rows[var]
        assert flag_cell == (f"`{flags[field]}`" if field in flags else ""), (var, flag_cell)
        want = _default(field)
        if AgentSettings.model_fields[field].is_required():
            assert default_cell == "required", (var, default_cell)
        elif want is not None:
            assert default_cell.strip('`"') == want, (var, default_cell, want)
