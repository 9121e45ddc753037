"""What tracing costs: median wall time of one all-reduce with and without
``flowreduce.trace`` around it, interleaved in ABBA order (plain, traced, traced,
plain, ...) so that drift of a shared machine hits both alike.

Each timed call: fresh inputs are made and waited for first (not timed);
the timer covers ``allreduce`` + ``gather`` of the outputs, plus for the
traced variant entering and leaving the trace (two scheduler calls and two
worker broadcasts, and turning dask's records into events). Expected
growth: the trace's fixed cost is a few round trips (ms); its variable cost
grows with tasks and transfers (events), not with bytes, so the ratio
shrinks as the vector grows.

    python benchmarks/bench_trace_overhead.py --size 1e7 --ranks 4 --reps 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from distributed import Client, LocalCluster, wait

import flowreduce
from flowreduce.tracing import trace


def _make(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1e7)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--algorithm", default="butterfly")
    ap.add_argument("--chunks", type=int, default=None)
    a = ap.parse_args(argv)
    n = int(a.size)
    kw = {"algorithm": a.algorithm, **({"chunks": a.chunks} if a.chunks else {})}
    with LocalCluster(n_workers=a.ranks, threads_per_worker=1, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        workers = sorted(client.nthreads())

        plain, traced, own, events = [], [], [], []

        def once(traced: bool, seed: int) -> float:
            """Seconds of one call; the traced variant also notes the time
            spent inside ``Trace.start``/``stop`` in ``own``."""
            xs = [client.submit(_make, n, seed + r, workers=[w], pure=False) for r, w in enumerate(workers)]
            wait(xs)
            t0 = time.perf_counter()
            if traced:
                tr = trace(client)
                t1 = time.perf_counter()
                tr.start()
                t2 = time.perf_counter()
                out = flowreduce.allreduce(client, xs, **kw)
                tr.add(out, xs)
                client.gather(out)
                t3 = time.perf_counter()
                tr.stop()
                own.append((t2 - t1) + (time.perf_counter() - t3))
                events.append(len(tr.events))
            else:
                out = flowreduce.allreduce(client, xs, **kw)
                client.gather(out)
            dt = time.perf_counter() - t0
            del out, xs
            return dt

        once(False, 0)  # warm-up both paths
        once(True, 0)
        own.clear()
        events.clear()
        for i in range(a.reps):  # ABBA order: neither variant always runs second
            for traced_first in ((False, True) if i % 2 == 0 else (True, False)):
                (traced if traced_first else plain).append(once(traced_first, 100 * i + 50 * traced_first))
    p, t = statistics.median(plain), statistics.median(traced)
    print(f"{a.algorithm}, {a.ranks} ranks, {n:.3g} float64 ({n * 8 / 1e6:.0f} MB) per rank, {a.reps} reps each")
    print("plain  s:", " ".join(f"{x:.3f}" for x in plain))
    print("traced s:", " ".join(f"{x:.3f}" for x in traced))
    o = statistics.median(own)
    print(f"median plain {p:.3f} s, traced {t:.3f} s, ratio {t / p:.3f} ({(t - p) * 1e3:+.1f} ms)")
    print(f"time inside trace start + stop (the trace's own work): median {o * 1e3:.1f} ms "
          f"= {o / p:.1%} of a plain call; {statistics.median(events):.0f} events per call")
    return {"plain": plain, "traced": traced, "ratio": t / p, "own": own}


if __name__ == "__main__":
    main()
