"""Simulated vLLM-compatible replicas: HTTP (OpenAI API + router helper endpoints), ZMQ KV
events with replay, vLLM metrics; see docs/engine.md."""

from cachecore.replica.fleet import Fleet, FleetProcess, launch_fleet, plan_ports, run_fleet
from cachecore.replica.server import SimReplica
from cachecore.replica.settings import ReplicaEndpoints, ReplicaPorts, ReplicaSettings

__all__ = [
    "Fleet",
    "FleetProcess",
    "ReplicaEndpoints",
    "ReplicaPorts",
    "ReplicaSettings",
    "SimReplica",
    "launch_fleet",
    "plan_ports",
    "run_fleet",
]
