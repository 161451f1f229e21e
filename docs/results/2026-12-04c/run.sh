#!/bin/bash
cd /work/main
SYS7=expected_latency,least_loaded,round_robin,prefix_affinity,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware
B="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0"
date
$B --workload shared-prefix --requests 120 --seeds 0,1,2,3,4,5 --load 0.85 --systems $SYS7 --out /tmp/bench3/sp85 --json /tmp/bench3/sp85.json > /tmp/bench3/sp85.log 2>&1
date
$B --workload shared-prefix --requests 120 --seeds 0,1,2 --load 0.5 --systems expected_latency,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench3/sp50 --json /tmp/bench3/sp50.json > /tmp/bench3/sp50.log 2>&1
date
$B --workload hot-prefix --requests 100 --seeds 0,1,2 --load 0.85 --systems expected_latency,least_loaded,vllm-router:cache_aware,sglang-router:cache_aware --out /tmp/bench3/hot --json /tmp/bench3/hot.json > /tmp/bench3/hot.log 2>&1
date
$B --workload short-unique --requests 100 --seeds 0,1,2,3,4,5 --load 0.85 --systems expected_latency,least_loaded,round_robin --json /tmp/bench3/su.json > /tmp/bench3/su.log 2>&1
date
$B --workload mooncake --requests 120 --seeds 0,1,2 --systems expected_latency,least_loaded,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench3/mc --json /tmp/bench3/mc.json > /tmp/bench3/mc.log 2>&1
date
echo ALLDONE
