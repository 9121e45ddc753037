"""What ``deterministic=True`` and ``"exact"`` cost: the default against
them, float64 sums at 1e5, 1e6 and 1e7 elements on a 4-worker LocalCluster
(one rank per worker), ``algorithm="auto"`` (or ``--algorithm``) in all.

Each repetition makes fresh inputs (untimed, pinned to their worker, checked
there with ``client.who_has`` as ``flowreduce bench`` does), then times the
call until every result is in memory; the two modes alternate within a
repetition and rotate every repetition. One warm-up repetition, then
``--repeat`` timed ones (median reported). ``true`` is checked against
``reference_reduce(order="tree")``, ``exact`` against fsum, on the first 1000
elements of every rank's result. Expected: True adds in a fixed tree order
and, for plans whose merges are siblings of that tree, moves no more bytes:
about the default's time; exact with ``auto`` folds every rank's values
where a gathering plan reduces them, at the default's bytes: its cost is the
fold's CPU time (lower on ``--data normal``, whose blocks are proven exact as
a whole); a named plan that adds partial sums moves 3 int64 limbs and an
int16 exponent per element (26 bytes against 8) through two all-reduces and
costs several times the default. Run benchmarks/warm_memory.py first on a
freshly booted machine.

    python benchmarks/reproducible.py [--sizes 1e5 1e6 1e7] [--repeat 5] [--modes default true exact]
                                      [--algorithm auto] [--ranks 4] [--method tasks] [--data wide|normal]
    python benchmarks/reproducible.py --bytes   # True's bytes on the wire against the default's, no cluster
    MALLOC_TRIM_THRESHOLD_=65536 python benchmarks/reproducible.py --kernels --sizes 1e5 1e6 1e7 1e8  # no cluster
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import numpy as np
from distributed import Client, LocalCluster, wait

import flowreduce
from flowreduce.reproducible import reference_reduce

#: the value of ``deterministic`` for each mode
MODES = {"default": False, "true": True, "exact": "exact"}


def make_input(n: int, rank: int, data: str = "wide") -> np.ndarray:
    """Rank ``rank``'s values: ``wide`` spans 16 orders of magnitude (the
    issue's test data: different orders give different bits), ``normal`` is
    standard normal noise, like gradients (values within a few decades)."""
    rng = np.random.default_rng(rank)
    if data == "normal":
        return rng.standard_normal(n)
    return rng.standard_normal(n) * 10.0 ** rng.integers(-8, 9, n)


def head(x: np.ndarray) -> np.ndarray:
    return x[:1000]


def check(x: np.ndarray, sample: np.ndarray) -> bool:
    return bool(np.array_equal(x[: sample.size], sample))


def bytes_table(ranks: tuple[int, ...] = (2, 3, 4, 5, 6, 8, 16, 32)) -> None:
    """deterministic=True's bytes on the wire relative to the default, per plan
    (one chunk): each transfer weighed by the partial sums its value carries
    (:func:`flowreduce.algorithms.partials.wire_factor`, what ``auto`` prices)."""
    from flowreduce.algorithms.partials import wire_factor

    variants = [("butterfly", {}), ("butterfly", {"radix": 4}), ("recursive-doubling", {}),
                ("recursive-doubling", {"radix": 4}), ("reduce-broadcast", {}), ("tree", {}), ("tree", {"fan_in": 3}),
                ("ring", {}), ("hierarchical", {}), ("shm-direct", {}), ("direct", {})]
    print(f"{'algorithm':32} " + " ".join(f"{p:>6}" for p in ranks))
    for algorithm, options in variants:
        cells = []
        for p in ranks:
            plan = flowreduce.plan(algorithm, p, **options)
            cells.append(f"{wire_factor(plan):6.2f}" if plan.transfers() else "     -")
        print(f"{algorithm + (str(options) if options else ''):32} " + " ".join(cells))


def kernels_table(sizes: list[float], repeat: int) -> None:
    """The one-level routes' sum of 4 ranks in one process (under Dask's
    MALLOC_TRIM_THRESHOLD_ when run as the docs say): the default's fold in
    rank order against True's tree order (kernels.dense.tree_fold), median
    of ``repeat`` after a warm-up; little disturbed by other load, unlike the
    cluster timings."""
    from flowreduce.kernels.dense import tree_fold
    from flowreduce.ops import resolve_op

    op = resolve_op("sum")
    print(f"{'elements':>10} {'fold ms':>9} {'tree ms':>9} {'tree/fold':>9}")
    for n in (int(x) for x in sizes):
        xs = [make_input(n, r) for r in range(4)]
        out = np.empty(n)
        med = {}
        for name, run in (("fold", lambda: op.fold(xs, out)), ("tree", lambda: tree_fold(op, 4, xs, out))):
            run()
            ts = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t0)
            med[name] = statistics.median(ts)
        print(f"{n:>10} {med['fold'] * 1e3:>9.2f} {med['tree'] * 1e3:>9.2f} {med['tree'] / med['fold']:>9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6, 1e7])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=None, help="ranks (default: one per worker; more share workers)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--data", choices=["wide", "normal"], default="wide",
                    help="wide: 16 orders of magnitude (default); normal: standard normal values")
    ap.add_argument("--method", default="tasks", help="allreduce(method=...) for every mode (True runs as tasks)")
    ap.add_argument("--bytes", action="store_true", help="print True's bytes against the default's and stop")
    ap.add_argument("--kernels", action="store_true", help="time the one-level routes' sums in this process and stop")
    args = ap.parse_args()
    if args.bytes:
        bytes_table()
        return
    if args.kernels:
        kernels_table(args.sizes, max(args.repeat, 9))
        return
    print(f"load average at start: {os.getloadavg()}  (cores: {os.cpu_count()})")
    with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        workers = sorted(client.nthreads())
        p = args.ranks or len(workers)
        at = [workers[r % len(workers)] for r in range(p)]
        print(f"algorithm={args.algorithm} method={args.method} ranks={p} workers={len(workers)} data={args.data}")
        print(f"{'elements':>10} {'mode':>8} {'median ms':>10} {'runs ms':>40} {'x default':>10}  plan")
        for n in (int(s) for s in args.sizes):
            times: dict[str, list[float]] = {m: [] for m in args.modes}
            plans: dict[str, str] = {}
            samples: dict[str, np.ndarray] = {}
            for it in range(1 + args.repeat):
                k = it % len(args.modes)
                modes = args.modes[k:] + args.modes[:k]
                for m in modes:
                    inputs = [client.submit(make_input, n, r, args.data, workers=[at[r]], pure=False) for r in range(p)]
                    wait(inputs)
                    held = client.who_has(inputs)
                    for r, f in enumerate(inputs):
                        if list(held[f.key]) != [at[r]]:
                            raise RuntimeError(f"input of rank {r} is on {list(held[f.key])}, not {at[r]}")
                    t0 = time.perf_counter()
                    outs = flowreduce.allreduce(client, inputs, algorithm=args.algorithm, deterministic=MODES[m],
                                                method=args.method)
                    wait(outs)
                    elapsed = time.perf_counter() - t0
                    record = flowreduce.describe(outs)
                    plans[m] = f"{record.plan.algorithm} chunks={record.plan.chunks} ({record.transport})"
                    if m in ("exact", "true"):  # every rank the same bits: fsum's, or the reference tree's
                        if m not in samples:
                            xs = client.gather([client.submit(head, f, pure=False) for f in inputs])
                            samples[m] = (np.array([math.fsum(v) for v in zip(*xs)]) if m == "exact" else
                                          reference_reduce(xs, "sum", order="tree"))
                        ok = client.gather([client.submit(check, o, samples[m], workers=[at[r]], pure=False)
                                            for r, o in enumerate(outs)])
                        if not all(ok):
                            raise RuntimeError(f"{m} results differ from their reference at n={n}")
                    del outs, inputs, record
                    if it > 0:
                        times[m].append(elapsed)
            base = statistics.median(times["default"]) if "default" in times else float("nan")
            for m, ts in times.items():
                med = statistics.median(ts)
                runs = " ".join(f"{t * 1e3:.1f}" for t in ts)
                print(f"{n:>10} {m:>8} {med * 1e3:>10.1f} {runs:>40} {med / base:>10.2f}  {plans[m]}", flush=True)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
