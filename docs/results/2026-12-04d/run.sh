#!/bin/bash
# Mooncake with its reuse (seventh session, 2026-12-04): 120 rows per seed drawn whole prefix
# group at a time (workload mooncake-groups), 85% of least_loaded's knee, time scale 1.0.
cd /work/main
B="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0"
SYS=expected_latency,least_loaded,prefix_affinity,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware
date
$B --workload mooncake-groups --requests 120 --seeds 0,1,2 --load 0.85 --systems $SYS --out /tmp/bench4/mcg --json /tmp/bench4/mcg.json > /tmp/bench4/mcg.log 2>&1
date
echo ALLDONE
