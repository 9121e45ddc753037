"""Touch most of the machine's memory once before benchmarking.

On the project's virtual machines the first write to a page of guest
memory is slow: the host backs it lazily (measured: 0.3 GB/s, an 800 MB
fresh copy took 2.1 s the first time and 0.24 s once the memory had been
touched). A benchmark started on a freshly booted machine then times page
faults, not all-reduce, and more so for large vectors. Run this once after
boot; it fills ``--gib`` GiB (default: 90% of the available memory) with
ones, one GiB at a time, and frees it.

    python benchmarks/warm_memory.py [--gib N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def available_gib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // (1 << 20)
    return 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=None, help="GiB to touch (default: 90%% of what is available)")
    n = ap.parse_args().gib or int(available_gib() * 0.9)
    t0, keep = time.perf_counter(), []
    for _ in range(n):
        keep.append(np.ones(1 << 27))  # 1 GiB, every page written
    elapsed = time.perf_counter() - t0
    print(f"touched {n} GiB in {elapsed:.1f} s ({n / elapsed:.2f} GiB/s)")


if __name__ == "__main__":
    main()
