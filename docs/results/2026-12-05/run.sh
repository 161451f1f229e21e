#!/bin/bash
# D14 on the HTTP fleet (time scale 1.0, 85% and 50% of least_loaded's knee): expected_latency
# with the per-scope smallest-tree tie-break beside sglang-router cache_aware (the best peer
# on these workloads in earlier runs), then expected_latency before D14 (random rounds,
# b009072 in a git worktree at /work/exp) on the same seeds right after.
set -u
A="flock /tmp/kvgate-bench.lock .venv/bin/kvgate bench routers --replicas 4 --time-scale 1.0 --requests 120 --seeds 0,1,2"
OUT=${OUT:-/tmp/d14}
mkdir -p $OUT
for spec in "shared-prefix 0.85 sp85" "mooncake-groups 0.85 mcg" "shared-prefix 0.5 sp50"; do
  set -- $spec
  date +"%H:%M:%S $3 after"
  (cd /work/main && $A --workload $1 --load $2 --systems expected_latency,sglang-router:cache_aware --out $OUT/$3 --json $OUT/$3.json > $OUT/$3.log 2>&1)
  date +"%H:%M:%S $3 before"
  (cd /work/exp && PYTHONPATH=/work/exp flock /tmp/kvgate-bench.lock /work/main/.venv/bin/python -m gateway.cli bench routers --replicas 4 --time-scale 1.0 --requests 120 --seeds 0,1,2 --workload $1 --load $2 --systems expected_latency --peers-dir /work/main/.peers --json $OUT/$3-before.json > $OUT/$3-before.log 2>&1)
done
date +"%H:%M:%S done"
# (02:17) shared-prefix at 50% again, beside vllm-router round_robin, the best peer at this
# load point in the seventh session's run
(cd /work/main && $A --workload shared-prefix --load 0.5 --systems expected_latency,vllm-router:round_robin --out $OUT/sp50rr --json $OUT/sp50rr.json > $OUT/sp50rr.log 2>&1)
# (02:18) short non-repeating requests: the cold path D14 changes, beside least_loaded
(cd /work/main && $A --workload short-unique --load 0.85 --systems expected_latency,least_loaded --out $OUT/su85 --json $OUT/su85.json > $OUT/su85.log 2>&1)
# (02:39) hot prefix after D14, beside least_loaded
(cd /work/main && $A --workload hot-prefix --load 0.85 --systems expected_latency,least_loaded --out $OUT/hot85 --json $OUT/hot85.json > $OUT/hot85.log 2>&1)
