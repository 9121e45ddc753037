"""What warm result buffers (``flowreduce.shm.result_buffers``) save:
``shm-direct`` with the workers' result pools on, against the same calls
with them off (``limit`` 0: every result in a fresh mapping, as
``np.empty`` gives), interleaved in rotating order, plus the bench's
hand-written baseline as the common yardstick.

On a LocalCluster of ``--workers`` single-threaded processes (memory limit
the machine's, as ``flowreduce bench``), for each size: fresh inputs made
(untimed, one per worker, checked with ``client.who_has``), then one timed
call; results dropped before the next run. Medians of ``--reps`` runs per
variant after ``--warmup`` rounds.

    python benchmarks/warm_memory.py --gib 12
    python benchmarks/warm_results.py --sizes 1e6,1e7,1e8 --reps 7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from distributed import Client, LocalCluster, wait

import flowreduce
from flowreduce.cli.bench import check_placed, make_input, run_baseline


def set_result_pool(on: bool, dask_worker=None) -> dict:
    """Turn this worker's result pool on (its configured bound) or off (keep no free buffer)."""
    from flowreduce.shm import result_buffers

    b = result_buffers.buffers()
    if not hasattr(b, "configured"):
        b.configured = b.limit
    b.limit = b.configured if on else 0
    if not on:
        b.release_idle(now=float("inf"))
    return b.stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    variants = ["warm", "fresh", "baseline"]
    out: dict = {"load_before": os.getloadavg(), "sizes": {}}
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=0) as cluster, Client(cluster) as client:
        workers = sorted(client.nthreads())
        for n in sizes:
            times: dict[str, list[float]] = {v: [] for v in variants}
            for it in range(args.warmup + args.reps):
                order = variants[it % 3:] + variants[:it % 3]
                for v in order:
                    if v != "baseline":
                        client.run(set_result_pool, v == "warm")
                    inputs = [client.submit(make_input, n, r, "float64", workers=[workers[r]], pure=False)
                              for r in range(len(workers))]
                    wait(inputs)
                    check_placed(client, inputs, workers)
                    t0 = time.perf_counter()
                    if v == "baseline":
                        outs = run_baseline(client, inputs, workers)
                    else:
                        outs = flowreduce.allreduce(client, inputs, algorithm="shm-direct")
                    wait(outs)
                    dt = time.perf_counter() - t0
                    if it >= args.warmup:
                        times[v].append(dt)
                    del outs, inputs
                    time.sleep(0.2)  # the results' keys released on the workers before the next run
            med = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}
            row = {"median_ms": med, "runs_ms": {v: [t * 1e3 for t in ts] for v, ts in times.items()},
                   "fresh_over_warm": med["fresh"] / med["warm"], "baseline_over_warm": med["baseline"] / med["warm"]}
            out["sizes"][n] = row
            print(f"{n:>10.0e}  warm {med['warm']:8.1f} ms  fresh {med['fresh']:8.1f} ms  baseline "
                  f"{med['baseline']:8.1f} ms   fresh/warm {row['fresh_over_warm']:.2f}x   "
                  f"baseline/warm {row['baseline_over_warm']:.2f}x", flush=True)
        out["stats"] = client.run(set_result_pool, True)
    out["load_after"] = os.getloadavg()
    print(f"load average before {out['load_before'][0]:.1f}, after {out['load_after'][0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
