"""What not reducing into received values costs the task graph (method="tasks").

Since recovery showed that a received copy reduced into could be read again as its key's value
(docs/failures.md), task graphs reduce into buffers of their own (``TASKS_REDUCE_INTO_RECEIVED``).
This runs the same calls both ways, interleaved, on 4 one-thread workers of one host, and prints
the medians and their ratio. Run ``benchmarks/warm_memory.py`` first.

    python benchmarks/received_buffers.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from distributed import Client, LocalCluster, wait

import flowreduce
from flowreduce.schedule import call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--sizes", default="1e6,1e7")
    args = ap.parse_args()
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = sorted(client.nthreads())
        for n in (int(float(s)) for s in args.sizes.split(",")):
            parts = [client.submit(np.full, n, float(r), workers=[w], pure=False) for r, w in enumerate(ws)]
            wait(parts)
            held = client.who_has(parts)
            assert [list(held[f.key]) for f in parts] == [[w] for w in ws], "each input on its own worker"
            for algorithm in ("ring", "butterfly"):
                times: dict[bool, list[float]] = {True: [], False: []}
                for _ in range(args.repeat):
                    for into_received in (True, False):
                        call.TASKS_REDUCE_INTO_RECEIVED = into_received
                        t = time.perf_counter()
                        out = flowreduce.allreduce(client, parts, algorithm=algorithm, method="tasks")
                        wait(out)
                        times[into_received].append(time.perf_counter() - t)
                        del out
                on, off = (statistics.median(times[m]) * 1e3 for m in (True, False))
                print(f"{n:>9.0e} {algorithm:<10} into received {on:7.1f} ms, own buffers {off:7.1f} ms, "
                      f"ratio {off / on:.3f}", flush=True)
            del parts


if __name__ == "__main__":
    main()
