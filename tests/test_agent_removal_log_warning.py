"""R3: an agent started without a removal log says at start-up what that costs its replica
(the gateways' checks of a miss it cannot explain become unverifiable, D22)."""

from __future__ import annotations

import logging

import pytest

from cachecore.agent.cli import redis_stores
from cachecore.agent.settings import AgentSettings


@pytest.mark.parametrize("removal_log", [0, 16_384])
async def test_an_agent_without_a_removal_log_warns_at_start_up(
    removal_log: int, caplog: pytest.LogCaptureFixture
) -> None:
    settings = AgentSettings(
        replica_id="r0", engine_url="http://127.0.0.1:1", events="tcp://127.0.0.1:2",
        redis="redis://127.0.0.1:1/0", removal_log=removal_log,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="cachecore.agent.cli"):
        index, load, registry = redis_stores(settings, register=False)  # connects lazily
    try:
        warned = [r for r in caplog.records if "KVGATE_AGENT_REMOVAL_LOG=0" in r.getMessage()]
        assert len(warned) == (1 if removal_log == 0 else 0)
        if warned:
            assert "quarantine.max_unverifiable: 0" in warned[0].getMessage()
            assert warned[0].__dict__["replica"] == "r0"
    finally:
        await index.close()
        await load.close()
        assert registry is None
