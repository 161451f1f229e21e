"""Attack 6's runs start from the same state: what an earlier run left in the gateway (the
router's per-tenant memory of where cold data went) must not decide where a later run's
flood lands. Before each run had a gateway of its own, a confined run sent the flooder's
cold data to two replicas, and the undefended flood after it went to the other two, which
took the full-size contrast under its bound (NO POWER)."""

from __future__ import annotations

from loadtest.attacks.flooding import FloodConfig, measure


async def test_undefended_flood_spreads_after_a_confined_run() -> None:
    # 2 s at 40 floods/s: the confined run puts 80 floods (80k tokens) on 2 of 4 replicas;
    # a router that remembers them sends the next 80 to the other two until they catch up
    cfg = FloodConfig(duration_s=2.0, defences=("confine",), claimed="confine", seed=3)
    rep = await measure(cfg)
    labels = [r.label for r in rep.runs]
    assert labels == ["no flood", "flood, confine", "flood, no defence"]
    confined, open_ = rep.runs[1], rep.runs[2]
    assert confined.flood_admitted == confined.flood_sent == 80
    assert len(confined.flood_replicas) == cfg.cold_replica_count
    assert open_.flood_admitted == open_.flood_sent == 80
    # from a fresh router the undefended flood spreads evenly (measured: 20 on each of the
    # four); a router that remembers the confined run gave the two confined replicas 8-11
    assert len(open_.flood_replicas) == cfg.replicas
    assert min(open_.flood_replicas.values()) >= 15, open_.flood_replicas
    # the paired runs see the same victims' requests, all answered
    assert {r.victim_requests for r in rep.runs} == {rep.runs[0].victim_requests}
    assert all(r.victim_errors == 0 for r in rep.runs)
