#!/bin/bash
# After D12: shared-prefix 85% on seeds 3-5 (with run2's seeds 0-2: six), shared-prefix 50%,
# and the windowed mooncake, time scale 1.0.
cd /work/main
B="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0"
date
$B --workload shared-prefix --requests 120 --seeds 3,4,5 --load 0.85 --systems expected_latency,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench6/sp85b --json /tmp/bench6/sp85b.json > /tmp/bench6/sp85b.log 2>&1
date
$B --workload shared-prefix --requests 120 --seeds 0,1,2 --load 0.5 --systems expected_latency,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench6/sp50 --json /tmp/bench6/sp50.json > /tmp/bench6/sp50.log 2>&1
date
$B --workload mooncake --requests 120 --seeds 0,1,2 --systems expected_latency,least_loaded,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench6/mc --json /tmp/bench6/mc.json > /tmp/bench6/mc.log 2>&1
date
echo ALLDONE
# added after the above (22:17): shared-prefix 85%, seeds 6-8, to see whether six seeds' 0.66x holds
$B --workload shared-prefix --requests 120 --seeds 6,7,8 --load 0.85 --systems expected_latency,vllm-router:cache_aware,vllm-router:round_robin,sglang-router:cache_aware --out /tmp/bench7/sp85c --json /tmp/bench7/sp85c.json > /tmp/bench7/sp85c.log 2>&1
