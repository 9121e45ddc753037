"""What ranks waiting for a late one cost on a host whose ranks outnumber its cores.

An SPMD job of 4 ranks on one host (4 one-thread workers on this 2-core
machine): each iteration rank 0 computes for ``--work-ms`` (numpy, one
thread) while the others have nothing to do, then every rank takes part in
one all-reduce of 1e3 float64. Reported per iteration, medians over the
iterations: the wall time, rank 0's compute time as it measured it (what
the waiting ranks take from it shows here), and the CPU time each waiting
rank used (``time.process_time`` of its worker process).

    python benchmarks/spmd_waiting.py --work-ms 100 --iterations 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # this directory's sparse/ would shadow the pydata package dask probes for

import numpy as np  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

import flowreduce  # noqa: E402


def _busy(seconds: float) -> None:
    """Compute for ``seconds`` of this process's CPU time."""
    a = np.random.default_rng(0).standard_normal(20_000)
    start = time.process_time()
    while time.process_time() - start < seconds:
        a = np.sin(a)


def job(comm, work_ms: float, iterations: int) -> list[tuple[float, float, float]]:
    """Per iteration: (wall s, rank 0's compute wall s, this rank's CPU s)."""
    x = np.ones(1000)
    comm.allreduce(x)  # set up
    out = []
    for _ in range(iterations):
        t0, c0 = time.perf_counter(), time.process_time()
        if comm.rank == 0:
            _busy(work_ms / 1000)
        t1 = time.perf_counter()
        comm.allreduce(x)
        out.append((time.perf_counter() - t0, t1 - t0, time.process_time() - c0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", type=float, default=100.0)
    ap.add_argument("--iterations", type=int, default=30)
    a = ap.parse_args()
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        futures = flowreduce.spmd(client, job, ranks=4, workers=sorted(client.nthreads()),
                                  work_ms=a.work_ms, iterations=a.iterations)
        per_rank = client.gather(futures)
    wall = statistics.median(it[0] for it in per_rank[0])
    work = statistics.median(it[1] for it in per_rank[0])
    waiting_cpu = [statistics.median(it[2] for it in rank) for rank in per_rank[1:]]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"flowreduce from {os.path.dirname(flowreduce.__file__)}")
    print(f"work {a.work_ms:.0f} ms of CPU on rank 0: iteration {1000 * wall:.1f} ms, rank 0's work took "
          f"{1000 * work:.1f} ms of wall time, waiting ranks' CPU per iteration "
          f"{', '.join(f'{1000 * c:.1f}' for c in waiting_cpu)} ms")


if __name__ == "__main__":
    main()
