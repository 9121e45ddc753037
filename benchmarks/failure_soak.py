"""Many consecutive all-reduces with a worker killed every ``--every``
calls (issue #15's soak): every result checked against numpy, and the
resident memory of the scheduler and the workers reported at the start, in
the middle and at the end (flat means nothing of the calls piles up).

    python benchmarks/failure_soak.py --calls 1000 --every 100

On a 4-worker LocalCluster with nannies (a killed worker is restarted by
its nanny). The kill is tests/faults.py's ``fail_at`` (a test helper) at a
rotating rank and plan step of the next call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

#: tests/, for its test helpers (faults.py, browser.py: not part of the library)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def rank_input(r: int, n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) * (r + 1) + r


def _rss(dask_worker=None, dask_scheduler=None) -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def _guard_state(dask_scheduler=None) -> dict:
    """How much the guard holds: watched calls, keys it tracks, recovery counters."""
    from flowreduce.schedule.guard import guard_of

    g = guard_of(dask_scheduler)
    return {"watches": len(g.watches), "outputs": len(g.watch_of), "inputs": len(g.input_ranks),
            "processing": len(g.since), "tries": len(g.tries)}


def _growth(before, after, top: int = 15) -> list[dict]:
    """The files whose live Python allocations grew most between two tracemalloc snapshots."""
    out = []
    for group in ("filename", "lineno"):
        out += [{"at": f"{st.traceback[0].filename}" + (f":{st.traceback[0].lineno}" if group == "lineno" else ""),
                 "kib": round(st.size_diff / 1024, 1), "blocks": st.count_diff}
                for st in after.compare_to(before, group)[:top]]
    return out


def main(argv: list[str] | None = None) -> dict:
    import faults
    from distributed import Client, LocalCluster, wait

    import flowreduce

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--every", type=int, default=100, help="kill a worker in every N-th call")
    p.add_argument("--elements", type=int, default=10**5)
    p.add_argument("--algorithm", default="butterfly")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--small-dask-logs", action="store_true",
                   help="shrink Dask's own bounded logs (transition log, events, worker/scheduler logs, "
                        "computations) to a few entries: what grows then is not theirs")
    p.add_argument("--tracemalloc", type=int, default=None, metavar="CALL",
                   help="trace Python allocations in this process (client + in-process scheduler) and print the "
                        "growth between call CALL and the last call, by file")
    args = p.parse_args(argv)
    if args.small_dask_logs:
        import dask

        dask.config.set({"distributed.admin.low-level-log-length": 10, "distributed.admin.log-length": 10,
                         "distributed.diagnostics.computations.max-history": 1,
                         "distributed.scheduler.events-cleanup-delay": "1s"})
    if args.tracemalloc is not None:
        import tracemalloc

        tracemalloc.start(1)
    snapshots = []

    n, ranks = args.elements, 4
    want = sum(rank_input(r, n) for r in range(ranks))
    depth = flowreduce.plan(args.algorithm, ranks).depth
    samples = []
    with LocalCluster(n_workers=4, threads_per_worker=1, dashboard_address=None) as cluster, Client(cluster) as client:
        def sample(i: int) -> None:
            workers = client.run(_rss)
            samples.append({"call": i, "scheduler_rss": client.run_on_scheduler(_rss),
                            "worker_rss": sorted(workers.values()),
                            "scheduler_tasks": client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)),
                            "guard_state": client.run_on_scheduler(_guard_state)})

        kills, start = 0, time.perf_counter()
        for i in range(args.calls):
            parts = [client.submit(rank_input, r, n, pure=False) for r in range(ranks)]
            wait(parts)
            if i % args.every == args.every - 1:
                step = kills % depth  # every plan step; the last one is the result (one chunk: no step key)
                faults.fail_at(client, rank=kills % ranks, step=None if step == depth - 1 else step, action="kill")
            out = flowreduce.allreduce(client, parts, algorithm=args.algorithm)
            for r, x in enumerate(client.gather(out)):
                if not np.array_equal(x, want):
                    raise AssertionError(f"call {i}: rank {r} is wrong")
            if i % args.every == args.every - 1:
                if not faults.fired(client):
                    raise AssertionError(f"call {i}: the fault was not injected")
                faults.disarm(client)
                kills += 1
                client.wait_for_workers(4, timeout=120)
            del out, parts
            if i in (0, args.calls // 2, args.calls - 1):
                sample(i)
            if args.tracemalloc is not None and i in (args.tracemalloc, args.calls - 1):
                import gc
                import tracemalloc

                gc.collect()
                snapshots.append(tracemalloc.take_snapshot())
        seconds = time.perf_counter() - start
    growth = _growth(*snapshots) if len(snapshots) == 2 else None
    report = {"calls": args.calls, "kills": kills, "elements": n, "algorithm": args.algorithm,
              "seconds": round(seconds, 1), "samples": samples,
              "small_dask_logs": args.small_dask_logs, "python_growth_by_file": growth}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
