#!/bin/bash
# alternate main and branch: A B A B at 1e3,1e5 then one 1e6 each
cd /tmp/wt-delayed
R=benchmarks/results
run() {  # label pythonpath sizes
  echo "=== $1 sizes $3 start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  flock /tmp/measure.lock env PYTHONPATH=$2 python benchmarks/glm_loop.py --sizes $3 --variants naive,futures,delayed \
     --repeat 5 --warmup 1 --json $R/glm_loop_2026-11-28-delayed-$1.json --markdown $R/glm_loop_2026-11-28-delayed-$1.md
  echo "=== $1 end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
}
run main-1 /work/main 1e3,1e5
run branch-1 /tmp/wt-delayed 1e3,1e5
run main-2 /work/main 1e3,1e5
run branch-2 /tmp/wt-delayed 1e3,1e5
run main-1e6 /work/main 1e6
run branch-1e6 /tmp/wt-delayed 1e6
