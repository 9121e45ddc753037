#!/usr/bin/env bash
# The measurements of docs/network.md, one emulated cluster per step (each
# step holds the netem lock for well under 10 minutes where it can), results
# in benchmarks/results/netem/. Needs root. About an hour on 2 cores.
#
#   bash benchmarks/netem/campaign.sh [STEP...]   (default: all steps)
#
# Steps: calibrate flat8 flat16 hier4x4 hier4x4-interleaved flat8-messages
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
step_flat8() {  # docs/network.md: the 1e5 and 1e6 rows are from flat8-small.json (same command, earlier run)
    bench flat8 8 1 --sizes "${FLAT8_SIZES:-$SIZES}" \
        --algorithms reduce-broadcast,tree,recursive-doubling,butterfly,ring,hierarchical,auto
}
step_flat16() {  # the ablation ran at 8 hosts: here every algorithm at one chunk, side by side
    bench flat16 16 1 --sizes "$SIZES" --chunked none \
        --algorithms reduce-broadcast,tree,recursive-doubling,butterfly,ring,hierarchical,auto
}
step_hier4x4() {
    bench hier4x4 4 4 --sizes 1e6,1e7 --algorithms hierarchical,butterfly,ring,auto --chunked reduce-broadcast
}
step_hier4x4-interleaved() {
    bench hier4x4-interleaved 4 4 --sizes 1e7 --algorithms hierarchical,butterfly,ring,auto --chunked none \
        --no-baseline --order interleaved
}

step_flat8-messages() {  # chunking again, with dask sending at most 1 MB per message between two workers
    DASK_DISTRIBUTED__WORKER__TRANSFER__MESSAGE_BYTES_LIMIT=1MB \
        bench flat8-messages 8 1 --sizes 1e7 --algorithms reduce-broadcast,butterfly --no-baseline
}

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(calibrate flat8 flat16 hier4x4 hier4x4-interleaved flat8-messages)
for s in "${steps[@]}"; do
    "step_$s" || echo "!! step $s failed (rc=$?)"
    bash benchmarks/netem/netns.sh down 2>/dev/null || true
done
echo "== done ($(date +%T))"
