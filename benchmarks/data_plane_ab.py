"""Medians (ms) of one tree's same-host data plane users, 4 workers on one host, float64:
``auto`` (``direct``'s posts), ``butterfly-p2p`` (the engine's messages through segments),
``ring-tasks`` (the task graph's published edges) and ``arrival`` (a call on inputs still being
computed: inputs kept as they arrive), at 1e3, 1e5 and 1e6 elements.

To compare two trees, run it alternately with each on ``PYTHONPATH`` (``git worktree add``), e.g.::

    for i in 1 2 3; do for t in /tmp/wt-old /work/main; do
        PYTHONPATH=$t python benchmarks/data_plane_ab.py 15; done; done

Usage: ``python benchmarks/data_plane_ab.py REPEAT`` (prints one JSON line).
"""
import json
import statistics
import sys
import time

import numpy as np
from distributed import Client, LocalCluster, wait

import flowreduce


def run(c, futs, reps, **kw):
    ts = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        out = flowreduce.allreduce(c, futs, **kw)
        wait(out)
        ts.append(time.perf_counter() - t0)
        del out
    return 1e3 * statistics.median(ts[2:])

def grad(n, seed):
    return np.full(n, float(seed))

if __name__ == "__main__":
    reps = int(sys.argv[1])
    res = {}
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cl, Client(cl) as c:
        ws = sorted(c.nthreads())
        for n in (1000, 100_000, 1_000_000):
            futs = [c.submit(grad, n, r, workers=[ws[r]], pure=False) for r in range(4)]
            wait(futs)
            assert all(len(v) == 1 for v in c.who_has(futs).values()) and len({tuple(v) for v in c.who_has(futs).values()}) == 4
            res[f"auto {n:.0e}"] = run(c, futs, reps)
            res[f"butterfly-p2p {n:.0e}"] = run(c, futs, reps, algorithm="butterfly", method="p2p")
            res[f"ring-tasks {n:.0e}"] = run(c, futs, reps, algorithm="ring", method="tasks")
            # a call on inputs still computed: placed on arrival
            ts = []
            for i in range(reps + 2):
                t0 = time.perf_counter()
                g = [c.submit(grad, n, r + i, workers=[ws[r]], pure=False) for r in range(4)]
                out = flowreduce.allreduce(c, g)
                wait(out)
                ts.append(time.perf_counter() - t0)
            res[f"arrival {n:.0e}"] = 1e3 * statistics.median(ts[2:])
    print(json.dumps(res))
