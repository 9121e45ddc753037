#!/usr/bin/env bash
# Everything docs/training.md shows, in one go (about 30-60 minutes on a busy 2-core machine).
# Usage: bash benchmarks/train/study.sh [OUT_DIR]   (default /tmp/train-study); figures land in docs/img/train/.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/train-study}
img=docs/img/train
mkdir -p "$out" "$img"

# 1. the workload: 20 epochs, defaults (auto, 25 MB buckets, overlap on)
flowreduce train --ranks 4 --epochs 20 --json "$out/full.json" | tee "$out/full.txt"

# 2. traces of three steps on 4 ranks: small model with per-layer buckets, overlap on / off, a straggler;
#    and a wide model whose backward pass is long enough to hide something
flowreduce train --ranks 4 --epochs 1 --bucket-bytes 16kB --algorithm ring --trace "$out/trace-overlap" > "$out/trace-overlap.txt"
flowreduce train --ranks 4 --epochs 1 --bucket-bytes 16kB --algorithm ring --no-overlap --trace "$out/trace-no-overlap" > "$out/trace-no-overlap.txt"
flowreduce train --ranks 4 --epochs 1 --bucket-bytes 16kB --algorithm ring --straggler 2:0.1 --trace "$out/trace-straggler" > "$out/trace-straggler.txt"
flowreduce train --ranks 4 --epochs 1 --hidden 1024,1024 --bucket-bytes 1MB --algorithm ring --trace "$out/trace-wide" > "$out/trace-wide.txt"
flowreduce train --ranks 4 --epochs 1 --hidden 1024,1024 --bucket-bytes 1MB --algorithm ring --no-overlap --trace "$out/trace-wide-no-overlap" > "$out/trace-wide-no-overlap.txt"
for t in overlap no-overlap straggler wide wide-no-overlap; do
    cp "$out/trace-$t/steps.png" "$img/steps-$t.png"
done

# 3. step time per algorithm and bucket size (the benchmark), small model
python benchmarks/train/train_bench.py --experiment grid --bucket-bytes 0,16kB,25MB \
    --json "$out/grid.json" --plot "$img/grid.png" | tee "$out/grid.txt"
# 4. bucket size and overlap, wide model
python benchmarks/train/train_bench.py --experiment overlap --hidden 1024,1024 --bucket-bytes 0,1MB,25MB \
    --json "$out/overlap.json" --plot "$img/overlap.png" | tee "$out/overlap.txt"
# 5. straggler: delay d on rank 2's backward, overlap on / off, small model, 16 kB buckets
python benchmarks/train/train_bench.py --experiment straggler --bucket 16kB --delays 0,0.1,0.3,0.6 \
    --steps 8 --rounds 4 --json "$out/straggler.json" --plot "$img/straggler.png" | tee "$out/straggler.txt"
# 6. the interleaving table of the wide, overlap-on trace
python benchmarks/train/interleave.py "$out/trace-wide" | tee "$out/interleave.txt"
# 7. (as root, not run here) the same training on 4 emulated hosts behind 100 Mbit/s links, with traces:
#    bash benchmarks/train/netem.sh    (docs/training.md, "On an emulated network")
