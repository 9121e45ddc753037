"""``flowreduce bench``: an nccl-tests style sweep on a Dask cluster.

Each size gets fresh inputs on the workers (rank r holds ``(i mod 7) + r``,
so every result has a closed form and is checked where it lives, without
moving data to the client). Every repetition times each algorithm and the
hand-written baseline (``client.submit`` of a sum over all inputs, then
``client.replicate`` to every worker) back to back, in a rotating order, so
machine noise hits all of them alike. Every run gets fresh inputs, made
before its clock starts: runs leave copies of their inputs on other workers
(the baseline's sum task fetches them all), which would favour the next run. Rows report median/min/max seconds,
algbw = bytes/time, busbw = algbw·2(p-1)/p, correctness and the speed-up
over the baseline measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from flowreduce.cli.args import add_cost_model_argument, model_from_args, spec_from_arg

BASELINE = "baseline"


@dataclass
class Row:
    size: int
    nbytes: int
    dtype: str
    ranks: int
    algorithm: str
    chunks: int | str
    plan: str
    times: list[float] = field(default_factory=list)
    correct: bool = True
    trace: str | None = None
    predicted: float | None = None  # the cost model's seconds for the plan that ran

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def stats(self, baseline: Row | None) -> dict:
        med = self.median
        algbw = self.nbytes / med if med else 0.0
        return {
            **asdict(self), "median": med, "min": min(self.times), "max": max(self.times),
            "algbw": algbw, "busbw": algbw * 2 * (self.ranks - 1) / self.ranks if self.ranks > 1 else 0.0,
            "speedup": (baseline.median / med) if baseline and med else None,
        }


def parse_sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s.strip()]


def sweep_sizes(lo: float, hi: float, factor: float) -> list[int]:
    out, n = [], lo
    while n <= hi * (1 + 1e-9):
        out.append(int(round(n)))
        n *= factor
    return out


def make_input(n: int, rank: int, dtype: str) -> np.ndarray:
    return ((np.arange(n) % 7) + rank).astype(dtype)


def check(result, n: int, ranks: int, dtype: str, op: str) -> bool:
    base = np.arange(n) % 7
    if op == "sum":
        expected = (ranks * base + ranks * (ranks - 1) // 2).astype(dtype)
    elif op == "max":
        expected = (base + ranks - 1).astype(dtype)
    elif op == "min":
        expected = base.astype(dtype)
    elif op == "mean":
        expected = base + (ranks - 1) / 2
    else:
        return True  # no closed form: not checked
    return result.shape == (n,) and bool(np.allclose(result, expected) if op == "mean" else np.array_equal(result, expected))


def check_placed(client, inputs, workers) -> None:
    """Every rank's input on its own worker only, before the clock starts: a
    copy elsewhere (a previous run's fetch, the Active Memory Manager moving
    data) would let a run start ahead and make it look fast."""
    held = client.who_has(inputs)
    for r, f in enumerate(inputs):
        if list(held[f.key]) != [workers[r % len(workers)]]:
            raise RuntimeError(f"input of rank {r} is on {list(held[f.key])}, not on {workers[r % len(workers)]}")


def check_workers(client, workers) -> None:
    """Every worker the ranks were given still in the cluster: the next
    inputs are pinned to them, and would wait for a lost one forever."""
    alive = set(client.nthreads())
    lost = [w for w in workers if w not in alive]
    if lost:
        raise RuntimeError(f"worker(s) {', '.join(lost)} left the cluster during the benchmark (killed, e.g. out "
                           "of memory: see the workers' logs and dmesg); stopping here")


def _sum_all(*xs):
    out = xs[0].copy()
    for x in xs[1:]:
        out += x
    return out


def run_baseline(client, inputs, workers):
    from distributed import wait

    total = client.submit(_sum_all, *inputs, pure=False)

    wait([total])
    client.replicate([total], n=len(workers))
    return [total]


def _save_trace(tr: Any, trace_dir: str, n: int, alg: str, chunks: int | None, plan: str) -> str:
    import os

    from flowreduce.cli.trace_files import write_all

    out = os.path.join(trace_dir, f"{n}-{alg}-{chunks or 'auto'}")
    write_all(tr, out, title=f"{plan}, {n:g} elements" if alg != BASELINE else f"baseline: {plan}, {n:g} elements")
    return out


def bench(
    client,
    sizes: list[int],
    algorithms: list[str],
    *,
    chunks: Sequence[int | None] = (None,),
    dtype: str = "float64",
    op: str = "sum",
    ranks: int | None = None,
    repeat: int = 5,
    warmup: int = 1,
    baseline: bool = True,
    progress: bool = True,
    on_row=None,
    trace_dir: str | None = None,
    model=None,
    extra: Sequence[tuple[str, int | None]] = (),
    workers: list[str] | None = None,
) -> list[dict]:
    """Run the sweep and return one dict per (size, algorithm, chunks).

    With ``trace_dir``, the last repetition of every row runs inside
    :func:`flowreduce.trace` and its exports (Perfetto JSON, CSV, summary,
    timeline pictures) go to ``trace_dir/<size>-<algorithm>-<chunks>/``; the
    row's ``trace`` field names that directory. Opening and closing a trace
    costs ~17 ms and the traced call itself is not slower (see
    ``benchmarks/trace_overhead.py``, docs/tracing.md), on that repetition only.
    ``model`` (a :class:`flowreduce.CostModel`) is passed to every call;
    each row keeps the time it predicted (``predicted``). ``extra`` adds
    ``(algorithm, chunks)`` rows beyond every algorithm at every ``chunks``;
    ``workers`` places rank r on ``workers[r % len(workers)]`` (default:
    the workers in rank order, those of one host next to each other).
    """
    from distributed import wait

    import flowreduce
    from flowreduce.algorithms import parse_spec
    from flowreduce.launch import ranked_workers

    workers = list(workers) if workers else ranked_workers(client)
    ranks = ranks or len(workers)
    configs: list[tuple[str, int | None]] = [(a, c) for a in algorithms for c in chunks] + [(a, c) for a, c in extra]
    total = len(sizes) * (warmup + repeat) * (len(configs) + baseline)
    rows_out = []
    with ExitStack() as stack:
        bar = None
        if progress:
            from rich.progress import Progress

            bar = stack.enter_context(Progress(transient=True))
            task = bar.add_task("bench", total=total)
        for n in sizes:
            def fresh():
                return [client.submit(make_input, n, r, dtype, workers=[workers[r % len(workers)]], pure=False)
                        for r in range(ranks)]

            rows: dict[tuple, Row] = {}
            nbytes = n * np.dtype(dtype).itemsize
            order = ([(BASELINE, None)] if baseline else []) + configs
            for it in range(warmup + repeat):
                shift = it % len(order)
                for alg, c in order[shift:] + order[:shift]:
                    # fresh inputs for every run (made untimed): a run may leave copies of
                    # its inputs on other workers (the baseline's sum task fetches them
                    # all), and the next run on the same inputs would start ahead
                    check_workers(client, workers)
                    inputs = fresh()
                    wait(inputs)
                    check_placed(client, inputs, workers)
                    tr = None
                    if trace_dir and it == warmup + repeat - 1:
                        tr = flowreduce.trace(client).start()
                    t0 = time.perf_counter()
                    if alg == BASELINE:
                        outs, plan = run_baseline(client, inputs, workers), "submit(sum) + replicate"
                    else:
                        spec, _, transport = alg.partition("@")  # "ring@dask": the plan over Dask's comm
                        name, kw = parse_spec(spec)
                        if c:
                            kw["chunks"] = c
                        outs = flowreduce.allreduce(client, inputs, algorithm=name, op=op, model=model,
                                                    transport=transport or "auto", **kw)
                        info = flowreduce.describe(outs)
                        plan, predicted = repr(info.plan), info.predicted
                    wait(outs)
                    elapsed = time.perf_counter() - t0
                    key = (alg, c)
                    row = rows.setdefault(key, Row(n, nbytes, dtype, ranks, alg, c or "auto", plan))
                    if tr is not None and trace_dir:  # a trace is taken only with trace_dir
                        row.trace = _save_trace(tr.stop(), trace_dir, n, alg, c, plan)
                    # checked where each result lives: every replica of the baseline's
                    ok = all(client.gather(
                        [client.submit(check, o, n, ranks, dtype, op, pure=False, workers=[w])
                         for o in outs for w in client.who_has([o])[o.key]]))
                    del outs, inputs
                    row.plan = plan
                    if alg != BASELINE:
                        row.predicted = predicted
                    if it >= warmup:
                        row.times.append(elapsed)
                    row.correct &= ok
                    if bar:
                        bar.advance(task)
            base = rows.get((BASELINE, None))
            for row in rows.values():
                d = row.stats(base)
                rows_out.append(d)
                if on_row:
                    on_row(d)
    return rows_out


HEADER = (f"{'size':>12} {'bytes':>12} {'algorithm':>20} {'chunks':>6} {'median ms':>10} {'min ms':>9} "
          f"{'max ms':>9} {'algbw GB/s':>10} {'busbw GB/s':>10} {'vs base':>8} {'ok':>3}  plan")


def format_row(d: dict) -> str:
    sp = f"{d['speedup']:.2f}x" if d["speedup"] else "-"
    return (f"{d['size']:>12} {d['nbytes']:>12} {d['algorithm']:>20} {str(d['chunks']):>6} "
            f"{d['median']*1e3:>10.2f} {d['min']*1e3:>9.2f} {d['max']*1e3:>9.2f} "
            f"{d['algbw']/1e9:>10.3f} {d['busbw']/1e9:>10.3f} {sp:>8} {'yes' if d['correct'] else 'NO':>3}  {d['plan']}")


def add_arguments(p) -> None:
    from flowreduce.launch import add_cluster_arguments

    add_cluster_arguments(p)
    p.add_argument("--ranks", help="comma-separated rank counts to sweep, e.g. 2,4 (default: one rank per "
                   "worker); rank r runs on worker r mod W, so fewer ranks than workers sweep the worker count")
    p.add_argument("--sizes", help="comma-separated element counts, e.g. 1e3,1e5,1e7")
    p.add_argument("--min", type=float, default=1e3, help="smallest size when --sizes is not given")
    p.add_argument("--max", type=float, default=1e7, help="largest size when --sizes is not given")
    p.add_argument("--factor", type=float, default=10, help="size step when --sizes is not given")
    p.add_argument("--algorithms", default="all", help="comma-separated names, or 'all' (default); a name may carry "
                   "options, NAME:OPTION=VALUE[:...], e.g. butterfly,butterfly:radix=4,tree:fan_in=4, and "
                   "@dask to run with transport='dask' (no shared memory), e.g. ring@dask")
    p.add_argument("--chunks", default="auto", help="comma-separated chunk counts, or 'auto' (default)")
    p.add_argument("--dtype", default="float64", help="comma-separated dtypes to sweep (default float64)")
    p.add_argument("--op", default="sum")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true", help="skip the hand-written baseline")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", help="write every row with its raw timings to this file")
    p.add_argument("--trace", metavar="DIR", help="save a trace (JSON, CSV, summary, timeline) of the last "
                   "repetition of each row under DIR/<size>-<algorithm>-<chunks>/")
    add_cost_model_argument(p)


def run(args) -> int:
    import flowreduce
    from flowreduce.launch import from_args

    sizes = parse_sizes(args.sizes) if args.sizes else sweep_sizes(args.min, args.max, args.factor)
    algorithms = list(flowreduce.ALGORITHMS) if args.algorithms == "all" else args.algorithms.split(",")
    for a in algorithms:
        name, _ = spec_from_arg(a.partition("@")[0])
        if name not in flowreduce.ALGORITHMS:  # the sweep's inputs are dense
            raise SystemExit(f"bench runs dense algorithms; {name!r} is not one of {', '.join(flowreduce.ALGORITHMS)}")
    chunks: list[int | None] = [None] if args.chunks == "auto" else [int(c) for c in args.chunks.split(",")]
    model = model_from_args(args)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    for d in dtypes:
        np.dtype(d)  # an unknown dtype fails here, before any cluster starts
    with from_args(args, progress=not args.no_progress) as client:
        nworkers = len(client.nthreads())
        rank_counts = [int(r) for r in args.ranks.split(",")] if args.ranks else [nworkers]
        if any(r < 1 for r in rank_counts):
            raise SystemExit(f"--ranks must be positive integers, got {args.ranks!r}")
        print(f"# flowreduce {flowreduce.__version__} bench: {','.join(map(str, rank_counts))} ranks on {nworkers} "
              f"workers, dtype {','.join(dtypes)}, op {args.op}, {args.repeat} timed runs after {args.warmup} "
              "warm-up, interleaved with the baseline")
        rows = []
        several = len(rank_counts) > 1 or len(dtypes) > 1
        for ranks in rank_counts:
            for dtype in dtypes:
                if several:
                    print(f"# {ranks} ranks, {dtype}")
                print(HEADER, flush=True)
                rows += bench(client, sizes, algorithms, chunks=chunks, dtype=dtype, op=args.op, ranks=ranks,
                              repeat=args.repeat, warmup=args.warmup, baseline=not args.no_baseline,
                              progress=not args.no_progress, on_row=lambda d: print(format_row(d), flush=True),
                              trace_dir=f"{args.trace}/{ranks}-ranks-{dtype}" if args.trace and several else args.trace,
                              model=model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r["correct"]]
    if bad:
        print(f"# {len(bad)} rows gave WRONG results")
        return 1
    best_lines(rows)
    if args.trace:
        print(f"# traces of the last repetition of each row under {args.trace}/ "
              "(open trace.json in https://ui.perfetto.dev)")
    return 0


def best_lines(rows: list[dict]) -> None:
    """One line per size (and rank count and dtype, when the sweep has
    several): the fastest flowreduce row, auto, and the baseline."""
    groups = sorted({(r["ranks"], r["dtype"], r["size"]) for r in rows})
    several = len({g[:2] for g in groups}) > 1
    for p, dtype, n in groups:
        same = [r for r in rows if (r["ranks"], r["dtype"], r["size"]) == (p, dtype, n)]
        # auto may pick options (radix, chunks) no named row uses, so it competes for "best"
        rs = [r for r in same if r["algorithm"] != BASELINE]
        base = next((r for r in same if r["algorithm"] == BASELINE), None)
        auto = next((r for r in rs if r["algorithm"] == "auto"), None)
        if not rs:
            continue
        best = min(rs, key=lambda r: r["median"])
        where = f" ({p} ranks, {dtype})" if several else ""
        msg = f"# size {n}{where}: best {best['algorithm']} {best['median']*1e3:.2f} ms"
        if base:
            msg += f", {base['median'] / best['median']:.2f}x the baseline ({base['median']*1e3:.2f} ms)"
        if auto:
            msg += f"; auto {auto['median']*1e3:.2f} ms = {auto['median'] / best['median']:.2f}x best"
        print(msg)


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
