#!/bin/bash
# Held-out seeds 3-5 on the HTTP fleet (time scale 1.0, 4 replicas, 120 requests per run):
# expected_latency after D14 beside the two best peers of earlier sessions at each load
# point, to pool with the ninth session's seeds 0-2 (docs/results/2026-12-05/).
set -u
A="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0 --requests 120 --seeds 3,4,5"
OUT=${OUT:-/tmp/tenth}
mkdir -p $OUT
cd /work/main
for spec in "shared-prefix 0.85 sp85 sglang-router:cache_aware,vllm-router:cache_aware" \
            "shared-prefix 0.5 sp50 vllm-router:round_robin,sglang-router:cache_aware" \
            "mooncake-groups 0.85 mcg sglang-router:cache_aware,vllm-router:cache_aware"; do
  set -- $spec
  date +"%H:%M:%S $3"
  $A --workload $1 --load $2 --systems expected_latency,$4 --out $OUT/$3 --json $OUT/$3.json > $OUT/$3.log 2>&1
done
date +"%H:%M:%S done"
