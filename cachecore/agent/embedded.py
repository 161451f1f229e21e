"""Embedded mode: agents as tasks inside the gateway process, sharing its index.

``kvgate serve --replica URL=EVENTS,REPLAY ...`` hands the parsed specs to
:func:`start_embedded_agents` (it matches ``gateway.core.AgentHook``)::

    stop = await start_embedded_agents(specs, index, load_store, metrics_registry)
    ...
    await stop()

Each spec needs ``id``, ``url``, ``events`` and ``replay`` attributes (``gateway.replicas.
ReplicaSpec``); specs without ``events`` are skipped. All agents share one ZMQ context and
the gateway's index (a :class:`~cachecore.index.memory.MemoryIndex`, or a RedisIndex if the
gateway has one: then they write it through a client of their own, with a standalone agent's
timeouts, :func:`write_index`). Registration is not needed in embedded mode: the gateway
already knows its replicas from ``--replica``. Tunables come from ``KVGATE_AGENT_*``
environment variables or ``overrides``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import zmq.asyncio
from prometheus_client import CollectorRegistry

from cachecore.agent.agent import STOP_STEP_S, Agent
from cachecore.agent.metrics import AgentsCollector
from cachecore.agent.settings import AgentSettings, index_timeouts
from cachecore.index.base import PrefixIndex
from cachecore.index.layout import split_dp_replica_id
from cachecore.index.redis import RedisIndex
from cachecore.loadstate import LoadStore
from cachecore.registry import RegistryStore
from cachecore.tasks import enclosing_limit_s, run_to_end

log = logging.getLogger(__name__)

WRITE_CONNECTIONS_PER_AGENT = 8
"""The bound of the embedded agents' own index pool, per agent (opened as needed: an agent's
rank writes one call at a time, its start-up and checks add one or two beside it)."""


class AgentSpec(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def events(self) -> str | None: ...
    @property
    def replay(self) -> str | None: ...


class EmbeddedAgents:
    """The agents of one gateway process, their shared ZMQ context and, on a Redis index,
    the index client they write through (``write_index``, theirs to close)."""

    def __init__(
        self,
        agents: list[Agent],
        ctx: zmq.asyncio.Context,
        write_index: RedisIndex | None = None,
    ) -> None:
        self.agents = agents
        self.ctx = ctx
        self.write_index = write_index

    def by_replica(self) -> dict[str, Agent]:
        return {a.primary_id: a for a in self.agents}

    @property
    def stop_limit_s(self) -> float:
        """How long :meth:`stop` may take (the limit its :func:`~cachecore.tasks.run_to_end`
        runs the agents' stops under). Derived from the agents' own: they stop together, so
        the longest of theirs, each :attr:`Agent.stop_limit_s <cachecore.agent.agent.Agent.
        stop_limit_s>` with run_to_end's grace past it. A fixed bound shorter than an
        agent's (15 s against ~52 s) gave up on a stop still within its own and left it
        running past the context's destruction. Then the agents' index client's close, a
        step of its own (:data:`~cachecore.agent.agent.STOP_STEP_S`, and its grace)."""
        close_s = enclosing_limit_s(STOP_STEP_S) if self.write_index is not None else 0.0
        return self._agents_limit_s + close_s

    @property
    def _agents_limit_s(self) -> float:
        return max((enclosing_limit_s(a.stop_limit_s) for a in self.agents), default=STOP_STEP_S)

    async def stop(self) -> None:
        """Stop every agent, then destroy the shared context (linger 0: a close must not
        block the loop on unsent messages). Every agent is stopped and the context
        destroyed even when one agent's stop raises (they held their sockets on the context
        and their tasks ran on); such a failure is logged and the first one raised at the
        end. A stop that is cancelled does the same, then ends cancelled: the agents' stops
        run in a task of their own (:func:`~cachecore.tasks.run_to_end`, at most
        :attr:`stop_limit_s`) the cancellation does not cut short, where it used to leave
        an agent half stopped, the agents after it running and the context alive. The
        agents stop together: one after another, a gateway's stop took the sum of their
        bounds. Their index client is closed last, once they are stopped (or given up on),
        whatever their stop raised, at most :data:`~cachecore.agent.agent.STOP_STEP_S`."""
        try:
            await run_to_end(self._stop_agents(), self._agents_limit_s, "embedded agents stop")
        finally:
            self.ctx.destroy(linger=0)
            index, self.write_index = self.write_index, None  # once: a second stop skips it
            if index is not None:
                await run_to_end(index.close(), STOP_STEP_S, "embedded agents' index close")

    async def _stop_agents(self) -> None:
        agents = self.agents
        outcomes = await asyncio.gather(
            *(a.stop(deregister=True) for a in agents), return_exceptions=True
        )
        failed: Exception | None = None
        for agent, outcome in zip(agents, outcomes, strict=True):
            if isinstance(outcome, BaseException):  # the others stopped all the same
                log.error(
                    "embedded agent stop failed",
                    exc_info=outcome,
                    extra={"replica": agent.primary_id},
                )
                if isinstance(outcome, Exception):
                    failed = failed or outcome
        if failed is not None:
            raise failed


class EmbeddedAgentsStop:
    """What :func:`start_embedded_agents` returns: awaited, it unregisters the agents'
    metrics collector and stops them (:meth:`EmbeddedAgents.stop`). ``stop_limit_s`` says
    how long that may take (a :class:`~cachecore.tasks.BoundedStop`): the gateway's stop
    bounds its agents' step by it, not by its own per-step bound."""

    def __init__(
        self,
        group: EmbeddedAgents,
        collector: AgentsCollector | None,
        metrics_registry: CollectorRegistry | None,
    ) -> None:
        self.group = group
        self._collector = collector
        self._registry = metrics_registry

    @property
    def stop_limit_s(self) -> float:
        return self.group.stop_limit_s

    async def __call__(self) -> None:
        if self._collector is not None and self._registry is not None:
            self._registry.unregister(self._collector)
        await self.group.stop()


def embedded_agent_settings(spec: AgentSpec, **overrides: Any) -> AgentSettings:
    """The settings of ``spec``'s embedded agent (``spec.events`` must be set): the spec's
    replica, the rest from ``KVGATE_AGENT_*`` or ``overrides``. Raises pydantic's
    ValidationError for a setting out of range."""
    if spec.events is None:
        raise ValueError(f"replica {spec.id} has no event endpoints: no agent to configure")
    # an id R@dpN is rank N of engine R: the agent's index ids are R@dpN for its batches of
    # rank N (vLLM names the rank in each batch), not R@dpN@dpN
    name, rank = split_dp_replica_id(spec.id)
    return AgentSettings(
        replica_id=name,
        data_parallel_rank=rank,
        engine_url=spec.url,
        events=spec.events,
        replay=spec.replay,
        **overrides,
    )


def write_index(index: PrefixIndex, settings: Sequence[AgentSettings]) -> RedisIndex | None:
    """The index client the embedded agents of ``settings`` write ``index`` through when it
    is a RedisIndex (:meth:`~cachecore.index.redis.RedisIndex.sibling`): a standalone
    agent's timeouts (``KVGATE_AGENT_REDIS_TIMEOUT_S``, unset 2 s to read and 1 s to
    connect) over a pool of its own, :data:`WRITE_CONNECTIONS_PER_AGENT` each, and their
    ``KVGATE_AGENT_REMOVAL_LOG`` (the gateway's index keeps the default: it writes no
    removal). Through the gateway's lookup client (0.25 s to read unless
    ``KVGATE_REDIS_TIMEOUT_S``) every write to a Redis slower than that timed out, and so
    did each rewrite from the mirror, for as long as it lasted. None (the agents write
    ``index`` itself): an in-process index, no agent, or a RedisIndex built on a client
    (its URL unknown)."""
    if not settings or not isinstance(index, RedisIndex):
        return None
    # one client for all: the timeouts and the log are the process's (KVGATE_AGENT_*,
    # overrides), as the in-process index's log (gateway.core's _embedded_index)
    return index.sibling(
        **index_timeouts(settings[0]),
        max_connections=WRITE_CONNECTIONS_PER_AGENT * len(settings),
        removal_log=settings[0].removal_log,
    )


def build_embedded_agents(
    specs: Sequence[AgentSpec],
    index: PrefixIndex,
    load_store: LoadStore | None = None,
    registry: RegistryStore | None = None,
    **overrides: Any,
) -> EmbeddedAgents:
    """Construct (not start) one agent per spec that has event endpoints, on ``index`` or,
    a RedisIndex, on a client of their own (:func:`write_index`). Every spec's settings are
    read before anything is made: a spec refused (pydantic's ValidationError) leaves no ZMQ
    context behind, nor does an agent that fails to construct (nor a connection: a client
    connects at its first command)."""
    settings = [embedded_agent_settings(sp, **overrides) for sp in specs if sp.events]
    writes = write_index(index, settings)
    target = index if writes is None else writes
    ctx = zmq.asyncio.Context()
    try:
        agents = [Agent(st, target, load_store, registry, zmq_context=ctx) for st in settings]
    except BaseException:
        ctx.destroy(linger=0)
        raise
    return EmbeddedAgents(agents, ctx, writes)


async def start_embedded_agents(
    specs: Sequence[AgentSpec],
    index: PrefixIndex,
    load_store: LoadStore | None = None,
    metrics_registry: CollectorRegistry | None = None,
    **overrides: Any,
) -> EmbeddedAgentsStop:
    """Start an agent per spec (returns at once; each waits for its engine on its own)
    and return the function that stops them all (:class:`EmbeddedAgentsStop`, which says
    how long that may take). ``metrics_registry``: the agents' metrics are exposed there
    too (the gateway's ``/metrics``), labelled by replica, until they stop.

    A start that raises part way (an agent's start, the collector's registration, a
    cancellation) stops the agents it made (their tasks and sockets), unregisters the
    collector and destroys the context before it raises the original exception: the
    caller gets no stop function to do it with (a gateway whose agent hook raised stops
    all it made but these agents). A failure of that clean-up is logged, not raised over
    it."""
    group = build_embedded_agents(specs, index, load_store, None, **overrides)
    collector: AgentsCollector | None = None
    try:
        if metrics_registry is not None:
            collector = AgentsCollector({a.primary_id: a.metrics.registry for a in group.agents})
            metrics_registry.register(collector)
        for agent in group.agents:
            await agent.start()
    except GeneratorExit:  # the coroutine closed unawaited (its loop gone): no awaiting
        raise
    except BaseException:
        await _undo_start(group, collector, metrics_registry)
        raise
    log.info("embedded agents started", extra={"replicas": [a.primary_id for a in group.agents]})
    return EmbeddedAgentsStop(group, collector, metrics_registry)


async def _undo_start(
    group: EmbeddedAgents,
    collector: AgentsCollector | None,
    metrics_registry: CollectorRegistry | None,
) -> None:
    """:func:`start_embedded_agents`' clean-up after it failed: each step runs, and a
    failure is logged (the caller raises the start's own exception), as is a cancellation
    that arrives meanwhile (the agents' stop runs to its end all the same)."""
    if collector is not None and metrics_registry is not None:
        try:
            metrics_registry.unregister(collector)
        except KeyError:  # its registration was what failed
            pass
        except Exception:
            log.exception("unregistering the embedded agents' metrics after a failed start")
    try:
        await group.stop()  # every agent, then the context, whatever one of them raised
    except asyncio.CancelledError:
        # the start's own exception is raised (as a TaskGroup raises its errors over one)
        log.warning("the embedded agents' failed start was cancelled again while they stopped")
    except Exception:
        log.exception("stopping the embedded agents after their failed start failed too")
