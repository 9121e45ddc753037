"""deterministic=True (and "exact", --modes) against the default on the emulated hosts, interleaved in one run (issue #28).

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

#: the value of ``deterministic`` for each mode
MODES = {"default": False, "true": True, "exact": "exact"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e5,1e6,1e7")
    ap.add_argument("--algorithms", default="butterfly,ring")
    ap.add_argument("--repeat", type=int, default=6, help="calls per mode, the first not kept")
    ap.add_argument("--modes", default="default,true", help="of default, true, exact (default: default,true)")
    args = ap.parse_args()
    modes = ["default"] + [m for m in args.modes.split(",") if m != "default"]
    c = Client(os.environ["DASK_SCHEDULER_ADDRESS"])
    ws = sorted(c.scheduler_info()["workers"])
    print(f"workers {len(ws)}, load {os.getloadavg()}", flush=True)
    for n in [int(float(s)) for s in args.sizes.split(",")]:
        rng = np.random.default_rng(0)
        xs = [c.scatter(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n), workers=[w], hash=False) for w in ws]
        wait(xs)
        for algo in args.algorithms.split(","):
            times: dict[str, list[float]] = {m: [] for m in modes}
            plans: dict[str, str] = {}
            for rep in range(args.repeat):
                for mode in modes:
                    t0 = time.perf_counter()
                    out = flowreduce.allreduce(c, xs, algorithm=algo, deterministic=MODES[mode], method="tasks")
                    wait(out)
                    if rep:
                        times[mode].append(time.perf_counter() - t0)
                    plan = flowreduce.describe(out[0]).plan
                    plans[mode] = f"{plan.algorithm} chunks={plan.chunks}" + (
                        f" radix={plan.options['radix']}" if "radix" in plan.options else "")
                    del out
            d = statistics.median(times["default"])
            cells = "  ".join(f"{m} {statistics.median(times[m]) * 1000:9.1f} ms" for m in modes)
            ratios = "  ".join(f"{m}/default {statistics.median(times[m]) / d:5.2f}" for m in modes if m != "default")
            print(f"{n:>10} {algo:>10} {cells}  {ratios}  plans: {' / '.join(plans[m] for m in modes)}", flush=True)
        del xs
    print(f"load at end {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
