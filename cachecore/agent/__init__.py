"""The per-replica cache agent: engine KV events and load into the global index.

Public API:

* :class:`~cachecore.agent.agent.Agent` (settings, index, load store, registry;
  ``await start()`` / ``await stop()``), its settings
  :class:`~cachecore.agent.settings.AgentSettings`;
* :func:`~cachecore.agent.embedded.start_embedded_agents` for ``kvgate serve``;
* ``kvgate agent`` (:mod:`cachecore.agent.cli`).

See ``docs/agent.md``.
"""

from cachecore.agent.agent import Agent, index_replica_id
from cachecore.agent.embedded import build_embedded_agents, start_embedded_agents
from cachecore.agent.settings import AgentSettings

__all__ = [
    "Agent",
    "AgentSettings",
    "build_embedded_agents",
    "index_replica_id",
    "start_embedded_agents",
]
