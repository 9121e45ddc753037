#!/usr/bin/env bash
# The measurements of docs/network.md, one emulated cluster per step (each
# step holds the netem lock for well under 10 minutes where it can), results
# in benchmarks/results/netem/. Needs root. About an hour on 2 cores.
#
#   bash benchmarks/netem/campaign.sh [STEP...]   (default: all steps)
#
# Steps: calibrate flat8 flat16-ablation flat16-rest hier4x4 hier4x4-interleaved
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=benchmarks/results/netem
RATE="${RATE:-100mbit}"
SIZES="${SIZES:-1e5,1e6,1e7}"
REPEAT="${REPEAT:-3}"
MODEL="$OUT/cost-model.json"
mkdir -p "$OUT"

cluster() {  # cluster HOSTS WORKERS_PER_HOST -- SCRIPT ARGS...
    local hosts=$1 wph=$2; shift 3
    python benchmarks/netem/cluster.py --hosts "$hosts" --workers-per-host "$wph" --rate "$RATE" \
        --no-nanny --memory-limit 4GB --startup-timeout 120 -- "$@"
}
bench() {  # bench NAME HOSTS WPH ARGS...
    local name=$1 hosts=$2 wph=$3; shift 3
    echo "== $name: $hosts hosts x $wph workers @ $RATE ($(date +%T))"
    cluster "$hosts" "$wph" -- benchmarks/netem/bench_allreduce.py --rate "$RATE" --repeat "$REPEAT" \
        --cost-model "$MODEL" --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.txt"
}

step_calibrate() {
    echo "== calibrate: 2 hosts x 2 workers @ $RATE ($(date +%T))"
    cluster 2 2 -- -m flowreduce calibrate --scheduler tcp://10.77.0.10:8786 -o "$MODEL" \
        --repeat 3 2>&1 | tee "$OUT/calibrate.txt"
}
step_flat8() {
    bench flat8 8 1 --sizes "$SIZES" \
        --algorithms reduce-broadcast,tree,recursive-doubling,butterfly,ring,hierarchical,auto
}
step_flat16-ablation() {
    bench flat16-ablation 16 1 --sizes "$SIZES" --algorithms reduce-broadcast,butterfly,auto --no-baseline
}
step_flat16-rest() {
    bench flat16-rest 16 1 --sizes "$SIZES" --algorithms tree,recursive-doubling,butterfly,ring,hierarchical \
        --chunked none
}
step_hier4x4() {
    bench hier4x4 4 4 --sizes 1e6,1e7 --algorithms hierarchical,butterfly,ring,auto --chunked reduce-broadcast
}
step_hier4x4-interleaved() {
    bench hier4x4-interleaved 4 4 --sizes 1e7 --algorithms hierarchical,butterfly,ring,auto --chunked none \
        --no-baseline --order interleaved
}

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(calibrate flat8 flat16-ablation flat16-rest hier4x4 hier4x4-interleaved)
for s in "${steps[@]}"; do
    "step_$s" || echo "!! step $s failed (rc=$?)"
    bash benchmarks/netem/netns.sh down 2>/dev/null || true
done
echo "== done ($(date +%T))"
