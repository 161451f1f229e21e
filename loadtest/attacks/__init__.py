"""The isolation attack suite behind ``kvgate attack`` (:mod:`loadtest.attack`).

One module per attack family; each returns :class:`~loadtest.attacks.common.AttackResult`
rows. Every attack runs against real components (simulated replicas, the real gateway, real
agents, a real redis-server) and has a positive control where the issue asks for one, so a
"held" outcome is evidence, not the absence of a measurement. See ``docs/security.md``.
"""
