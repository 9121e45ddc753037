"""One algorithm's all-reduce between emulated hosts by ``method="tasks"`` and ``"p2p"`` (two calls
each, alternately, timed), then one traced ``p2p`` call whose received messages, reduces and copies
on ranks 0 and 1 are printed per plan step: when each step's values started and finished arriving.

    python benchmarks/netem/cluster.py --hosts 8 --workers-per-host 1 --rate 100mbit -- \\
        benchmarks/netem/butterfly_steps_probe.py 1e7 butterfly

Arguments: elements per rank (float32), algorithm. Runs inside the head namespace (cluster.py sets
``DASK_SCHEDULER_ADDRESS``); ranks are the workers in address order, one chunk.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import numpy as np
from distributed import Client, wait

import flowreduce


def make(n: int, r: int) -> np.ndarray:
    return np.full(n, float(r + 1), dtype=np.float32)


def address_order(address: str) -> tuple[int, ...]:
    return tuple(int(x) for x in address.split("//")[1].replace(":", ".").split("."))


def main() -> None:
    n, algorithm = int(float(sys.argv[1])), sys.argv[2]
    client = Client(os.environ["DASK_SCHEDULER_ADDRESS"])
    workers = sorted(client.nthreads(), key=address_order)

    def inputs() -> list:
        xs = [client.submit(make, n, r, workers=[w], pure=False) for r, w in enumerate(workers)]
        wait(xs)
        return xs

    for method in ("tasks", "p2p", "tasks", "p2p"):
        xs = inputs()
        t0 = time.perf_counter()
        out = flowreduce.allreduce(client, xs, algorithm=algorithm, method=method, chunks=1)
        wait(out)
        print(f"{method} {time.perf_counter() - t0:.2f} s {flowreduce.describe(out).plan}", flush=True)
        del out, xs

    xs = inputs()
    tracer = flowreduce.trace(client).start()
    out = flowreduce.allreduce(client, xs, algorithm=algorithm, method="p2p", chunks=1)
    wait(out)
    events = [e for e in tracer.stop().events if e.token and e.rank in (0, 1) and e.step is not None
              and e.phase in ("transfer", "reduce", "copy") and e.nbytes > 1000]
    t0 = min(e.start for e in events)
    rows = collections.defaultdict(list)
    for e in events:
        rows[e.rank, e.step, e.phase].append(f"{e.start - t0:.3f}-{e.stop - t0:.3f} s {e.nbytes / 1e6:.0f} MB"
                                             + (f" from {e.source}" if e.source else ""))
    print("rank step phase: seconds from the first event")
    for (rank, step, phase), what in sorted(rows.items()):
        print(rank, step, phase, "; ".join(what))


if __name__ == "__main__":
    main()
