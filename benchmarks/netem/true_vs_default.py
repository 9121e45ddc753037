"""deterministic=True against the default on the emulated hosts, interleaved in one run (issue #28).

Run inside the head namespace by cluster.py, e.g.

    python benchmarks/netem/cluster.py --hosts 4 --workers-per-host 1 --rate 1gbit --timeout 800 \\
        -- benchmarks/netem/true_vs_default.py --sizes 1e5,1e6,1e7 --repeat 6

One rank per worker (its input scattered there, floats spanning 16 orders of magnitude),
method="tasks", each algorithm's default and True calls alternating; the first repetition is not
kept. Prints the medians and True / default per size and algorithm.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from distributed import Client, wait

import flowreduce


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e5,1e6,1e7")
    ap.add_argument("--algorithms", default="butterfly,ring")
    ap.add_argument("--repeat", type=int, default=6, help="calls per mode, the first not kept")
    args = ap.parse_args()
    c = Client(os.environ["DASK_SCHEDULER_ADDRESS"])
    ws = sorted(c.scheduler_info()["workers"])
    print(f"workers {len(ws)}, load {os.getloadavg()}", flush=True)
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        rng = np.random.default_rng(0)
        xs = [c.scatter(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n), workers=[w], hash=False) for w in ws]
        wait(xs)
        for algo in args.algorithms.split(","):
            times: dict[bool, list[float]] = {False: [], True: []}
            plans: dict[bool, str] = {}
            for rep in range(args.repeat):
                for det in (False, True):
                    t0 = time.perf_counter()
                    out = flowreduce.allreduce(c, xs, algorithm=algo, deterministic=det, method="tasks")
                    wait(out)
                    if rep:
                        times[det].append(time.perf_counter() - t0)
                    plan = flowreduce.describe(out[0]).plan
                    plans[det] = f"{plan.algorithm} chunks={plan.chunks}"
                    del out
            d, t = statistics.median(times[False]), statistics.median(times[True])
            print(f"{n:>10} {algo:>10} default {d * 1000:9.1f} ms  true {t * 1000:9.1f} ms  true/default {t / d:5.2f}"
                  f"  plans: {plans[False]} / {plans[True]}", flush=True)
        del xs
    print(f"load at end {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
