#!/bin/bash
# After D12 (recompute charge, spill off): the reuse workloads again, time scale 1.0.
cd /work/main
B="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0"
date
$B --workload mooncake-groups --requests 120 --seeds 0,1,2 --load 0.85 --systems expected_latency,least_loaded,vllm-router:cache_aware,sglang-router:cache_aware --out /tmp/bench5/mcg --json /tmp/bench5/mcg.json > /tmp/bench5/mcg.log 2>&1
date
$B --workload shared-prefix --requests 120 --seeds 0,1,2 --load 0.85 --systems expected_latency,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench5/sp85 --json /tmp/bench5/sp85.json > /tmp/bench5/sp85.log 2>&1
date
$B --workload hot-prefix --requests 100 --seeds 0,1,2 --load 0.85 --systems expected_latency,least_loaded,vllm-router:cache_aware,sglang-router:cache_aware --out /tmp/bench5/hot --json /tmp/bench5/hot.json > /tmp/bench5/hot.log 2>&1
date
echo ALLDONE
