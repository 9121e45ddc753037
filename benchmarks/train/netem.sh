#!/usr/bin/env bash
# Training on the emulated multi-host network, in one command (as root; ~10 minutes on 2 cores):
# brings up 4 emulated hosts x 1 worker behind 100 Mbit/s links (benchmarks/netem/cluster.py), runs
# benchmarks/train/netem_train.py in the head namespace (step time per algorithm, overlap on/off, traces),
# and tears the cluster down (cluster.py does, on any exit; checked below).
#
# Usage: bash benchmarks/train/netem.sh [OUT_DIR] [netem_train.py options...]
#   OUT_DIR defaults to /tmp/train-netem; JSON lands in benchmarks/results/train/netem-*.json and the
#   pictures in docs/img/train/netem*.png unless NETEM_NO_PUBLISH=1.
#   e.g.  bash benchmarks/train/netem.sh /tmp/probe --parts probe      (one step's cost, nothing published)
# Environment: HOSTS (4), RATE (100mbit), DASK_FLOWREDUCE__COST_MODEL (default: the 100 Mbit/s calibration
# benchmarks/results/netem/cost-model.json, so that `auto` prices the links as measured).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/train-netem}
shift || true
hosts=${HOSTS:-4}
rate=${RATE:-100mbit}
export DASK_FLOWREDUCE__COST_MODEL=${DASK_FLOWREDUCE__COST_MODEL:-$PWD/benchmarks/results/netem/cost-model.json}
# benchmarks/netem/cluster.py gives every process it starts one BLAS thread unless set, as dask's nanny
# would (the emulated workers run without one, --no-nanny): with OpenBLAS's default of one thread per core
# four workers computing at once on 2 cores spin against each other (a 16x1024 @ 1024x1024 matmul: p90
# 36-126 ms instead of 1.5-5 ms, measured on this machine), which would be counted as compute.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
publish=()
if [[ "${NETEM_NO_PUBLISH:-0}" != 1 && " $* " != *" --parts probe "* ]]; then
    publish=(--results benchmarks/results/train --img docs/img/train)
fi
mkdir -p "$out"
rc=0
python benchmarks/netem/cluster.py --hosts "$hosts" --workers-per-host 1 --rate "$rate" --no-nanny \
    --timeout "${NETEM_TIMEOUT:-2400}" -- \
    benchmarks/train/netem_train.py --out "$out" --rate "$rate" "${publish[@]}" "$@" 2>&1 | tee "$out/run.txt" \
    || rc=$?
left=$(ip netns list | awk '$1 ~ /^fr-/ {print $1}')
if [[ -n "$left" ]]; then
    echo "netem.sh: namespaces left behind: $left (run: bash benchmarks/netem/netns.sh down)" >&2
    exit 1
fi
echo "netem.sh: emulated cluster torn down (no fr-* namespace left); output in $out"
exit "$rc"
