#!/bin/bash
# prefix_affinity with SGLang's smallest-tree rule, beside the peer it stands in for and
# expected_latency, on the HTTP fleet (time scale 1.0).
cd /work/main
B="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0"
date
$B --workload mooncake-groups --requests 120 --seeds 0,1,2 --load 0.85 --systems expected_latency,prefix_affinity,sglang-router:cache_aware --out /tmp/bench6/mcg --json /tmp/bench6/mcg.json > /tmp/bench6/mcg.log 2>&1
date
# (the first attempt of this line timed out starting the fleet, 60 s; rerun alone at 23:01)
$B --workload shared-prefix --requests 120 --seeds 0,1,2 --load 0.85 --systems expected_latency,prefix_affinity,sglang-router:cache_aware --out /tmp/bench6/sp85 --json /tmp/bench6/sp85.json > /tmp/bench6/sp85.log 2>&1
date
echo ALLDONE
# (23:11) three more seeds of mooncake-groups with both peers' cache_aware
$B --workload mooncake-groups --requests 120 --seeds 3,4,5 --load 0.85 --systems expected_latency,prefix_affinity,vllm-router:cache_aware,sglang-router:cache_aware --out /tmp/bench6/mcg345 --json /tmp/bench6/mcg345.json > /tmp/bench6/mcg345.log 2>&1
