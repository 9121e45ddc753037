"""What the p2p engine's log costs (issue #25 item 5: tracing overhead under 3%).

The engine records every plan node it computes, every message it sends and every message it receives
(:mod:`flowreduce.schedule.engine_log`), always, so that ``flowreduce.trace`` and the dashboard see its
steps. Two measurements:

1. **Per entry** (in this process, no cluster): the time of ``EngineLog.node`` / ``send`` / ``receive``
   as the engine calls them (clock read, tuple, deque append), minus the same calls on a no-op, median
   of ``--micro`` repetitions of 100,000 calls.
2. **Per call** (a ``LocalCluster`` of ``--workers`` single-threaded worker processes, one rank each):
   ``method="p2p"`` all-reduces of ``--sizes`` float64 per rank, ``--algorithm``, ``--chunks``; each pair
   runs the call once with recording on and once with it off (the log's methods replaced by no-ops and
   its dashboard reporter stopped on every worker, between the runs, untimed), in ABBA order; the clock
   covers ``allreduce`` + waiting for every result; inputs made once per size, untimed. Reported: the
   median of each variant, the median of the per-pair ratios on/off with a bootstrap 95% interval, and
   the entries logged per call (whose per-entry cost from 1. bounds what recording can add).

    python benchmarks/engine_log_overhead.py [--sizes 1e3 1e6] [--pairs 41] >> benchmarks/results/engine-log-overhead-DATE.txt
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import time
import timeit

import numpy as np
from distributed import Client, LocalCluster, wait

import flowreduce
from flowreduce.cli.bench import make_input


def _noop(*args, **kwargs) -> None:
    return None


def set_recording(on: bool, dask_worker=None) -> int:
    """On a worker: the engine log's methods back (``on``) or replaced by no-ops; its entries so far."""
    from flowreduce.schedule.p2p import engine_of

    engine = engine_of(dask_worker)
    log = engine.log if engine is not None else None
    if log is None:
        return 0
    pc = dask_worker.periodic_callbacks.get("flowreduce-engine-log")
    for name in ("begin", "node", "send", "receive"):
        if on:
            log.__dict__.pop(name, None)
        else:
            setattr(log, name, _noop)
    if pc is not None:
        (pc.start if on else pc.stop)()
    return log.count


def micro(repeat: int) -> dict[str, float]:
    """ns per call of each recording method, minus a no-op's."""
    from flowreduce.schedule.engine_log import EngineLog, now

    log = EngineLog()
    index = [[0, 5, [["<f8", 10]]], [1, 6, [["<f8", 10]]]]
    packed = np.zeros(160, np.uint8)
    items = [(0, 5, (np.zeros(10),)), (1, 6, (np.zeros(10),))]
    n = 100_000
    out = {}
    cases = {
        "node": ("log.node('run.0', 1, 12, t0, 8000)", "noop('run.0', 1, 12, t0, 8000)"),
        "send": ("log.send('run.0', 'tcp://a:1', t0, index, packed, ())", "noop('run.0', 'tcp://a:1', t0, index, packed, ())"),
        "receive": ("log.receive('run.0', items)", "noop('run.0', items)"),
        "clock": ("now()", "noop()"),
    }
    env = {"log": log, "noop": _noop, "t0": 0.0, "index": index, "packed": packed, "items": items, "now": now}
    for name, (stmt, base) in cases.items():
        t = statistics.median(timeit.repeat(stmt, number=n, repeat=repeat, globals=env))
        b = statistics.median(timeit.repeat(base, number=n, repeat=repeat, globals=env))
        out[name] = (t - b) / n * 1e9
    return out


def bootstrap(ratios: list[float], rounds: int = 10_000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e3, 1e6])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--algorithm", default="butterfly")
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=41)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro", type=int, default=7)
    args = ap.parse_args()

    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()}, "
          f"{os.cpu_count()} cores")
    print(f"# python benchmarks/engine_log_overhead.py --sizes {' '.join(f'{s:g}' for s in args.sizes)} "
          f"--workers {args.workers} --algorithm {args.algorithm} --chunks {args.chunks} --pairs {args.pairs}")
    for name, ns in micro(args.micro).items():
        print(f"per entry  {name:<8} {ns:7.0f} ns (minus a no-op call)")
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        workers = sorted(client.nthreads())
        for size in args.sizes:
            n = int(size)
            xs = [client.submit(make_input, n, r, "float64", workers=[w], pure=False) for r, w in enumerate(workers)]
            wait(xs)

            def once(on: bool) -> tuple[float, int]:
                before = sum(client.run(set_recording, on).values())
                t0 = time.perf_counter()
                out = flowreduce.allreduce(client, xs, algorithm=args.algorithm, chunks=args.chunks, method="p2p")
                wait(out)
                elapsed = time.perf_counter() - t0
                del out
                after = sum(client.run(set_recording, on).values())
                return elapsed, after - before

            for _ in range(args.warmup):
                once(True), once(False)
            on_t, off_t, ratios, entries = [], [], [], []
            for i in range(args.pairs):
                order = (True, False) if i % 2 == 0 else (False, True)
                got = {}
                for on in order:
                    got[on] = once(on)
                on_t.append(got[True][0])
                off_t.append(got[False][0])
                entries.append(got[True][1])
                ratios.append(got[True][0] / got[False][0])
            lo, hi = bootstrap(ratios)
            med = statistics.median(ratios)
            print(f"{args.algorithm} p2p, {args.workers} workers, {size:g} float64 per rank, {args.chunks} chunks, "
                  f"{args.pairs} ABBA pairs after {args.warmup} warm-up")
            print(f"  recording on   median {statistics.median(on_t) * 1e3:8.2f} ms (min {min(on_t) * 1e3:.2f}, "
                  f"max {max(on_t) * 1e3:.2f})")
            print(f"  recording off  median {statistics.median(off_t) * 1e3:8.2f} ms (min {min(off_t) * 1e3:.2f}, "
                  f"max {max(off_t) * 1e3:.2f})")
            print(f"  per-pair on/off median {med:.3f} (95% CI of the median {lo:.3f}-{hi:.3f}; "
                  f"min {min(ratios):.3f}, max {max(ratios):.3f})")
            print(f"  entries logged per call {statistics.median(entries):.0f} (all workers)")
            xs = []
    print(f"# load average after {os.getloadavg()}")


if __name__ == "__main__":
    main()
