"""What tracing costs: one all-reduce with and without ``flowreduce.trace``, in interleaved pairs.

Protocol (docs/tracing.md, "Overhead"):

* an embedded LocalCluster of ``--ranks`` single-threaded worker processes,
  memory limit as ``flowreduce bench`` sets it (``system``: the machine's
  memory per worker, so nothing spills);
* one rank per worker, ``--size`` float64 elements per rank (default 1e7,
  80 MB), ``--algorithm`` (default butterfly), ``--chunks`` as the cost
  model prefers unless given;
* ``--warmup`` untimed pairs first (the first trace registers dask's task
  stream plugin), then ``--pairs`` timed pairs; each pair runs the call once
  plain and once traced, back to back, the order alternating from pair to
  pair (plain first in even pairs, traced first in odd ones) so that drift
  of a shared machine hits both alike;
* every run gets fresh inputs (new seeds), made and waited for *before* the
  clock starts; the clock covers ``allreduce`` + ``wait`` for the outputs (they stay on the workers),
  and for the traced run also entering and leaving the trace
  (``Trace.start``/``Trace.stop``: scheduler and worker snapshots, turning
  dask's records into events), which is also timed on its own;
* results are released and the cluster is idle before the next run.

Reported: the median of each variant; per pair the ratios traced/plain
(end to end) and traced-call/plain (the call alone, between ``start`` and
``stop``: how much tracing perturbs what it measures); the median of each
ratio with a bootstrap 95% interval (resampling pairs) and the min/max; the
time inside ``start``/``stop``. ``--json FILE`` writes every raw timing.

    python benchmarks/trace_overhead.py --json trace-overhead.json        # the real run (1e7, 21 pairs)
    python benchmarks/trace_overhead.py --size 1e4 --pairs 3 --warmup 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import numpy as np


def _make(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


def _flowreduce_keys(dask_scheduler=None) -> int:
    return sum("flowreduce-" in str(k) for k in dask_scheduler.tasks)


def bootstrap_median(values: list[float], *, resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values`` (resampled
    with replacement, ``resamples`` times)."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    meds = np.median(v[rng.integers(0, len(v), size=(resamples, len(v)))], axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def describe(values: list[float]) -> dict[str, float]:
    lo, hi = bootstrap_median(values)
    return {"median": statistics.median(values), "ci95_low": lo, "ci95_high": hi,
            "min": min(values), "max": max(values)}


def order_of(pair: int) -> tuple[bool, bool]:
    """(traced?, traced?) in the order pair ``pair`` runs them: alternating."""
    return (False, True) if pair % 2 == 0 else (True, False)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=1e7, help="float64 elements per rank (default 1e7)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks = single-threaded worker processes (default 4)")
    ap.add_argument("--pairs", type=int, default=21, help="timed (plain, traced) pairs (default 21)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed pairs first (default 2)")
    ap.add_argument("--algorithm", default="butterfly", help="default butterfly")
    ap.add_argument("--chunks", type=int, default=None, help="default: what the cost model prefers")
    ap.add_argument("--memory-limit", default="system",
                    help="per worker: 'system' (default, as flowreduce bench), 'auto' or e.g. 4GB")
    ap.add_argument("--json", metavar="FILE", help="write the configuration and every raw timing")
    a = ap.parse_args(argv)

    import distributed
    from distributed import wait

    import flowreduce
    from flowreduce.launch import cluster
    from flowreduce.tracing import trace

    n = int(a.size)
    kw = {"algorithm": a.algorithm, **({"chunks": a.chunks} if a.chunks else {})}
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: list[dict] = []
    with cluster("local", workers=a.ranks, memory_limit=a.memory_limit) as client:
        workers = sorted(client.nthreads())
        seeds = iter(range(10**6))

        def idle() -> None:
            """Wait (bounded) until the previous call's keys are released."""
            deadline = time.monotonic() + 10
            while client.run_on_scheduler(_flowreduce_keys) and time.monotonic() < deadline:
                time.sleep(0.01)

        def once(traced: bool) -> dict:
            base = next(seeds) * a.ranks
            xs = [client.submit(_make, n, base + r, workers=[w], pure=False) for r, w in enumerate(workers)]
            wait(xs)  # inputs exist before the clock starts
            rec: dict = {"traced": traced}
            if traced:
                tr = trace(client)
                t0 = time.perf_counter()
                tr.start()
                t1 = time.perf_counter()
                out = flowreduce.allreduce(client, xs, **kw)
                wait(out)  # results stay on the workers, as in flowreduce bench
                t2 = time.perf_counter()
                tr.stop()
                t3 = time.perf_counter()
                rec.update(seconds=t3 - t0, call_seconds=t2 - t1, start_seconds=t1 - t0, stop_seconds=t3 - t2,
                           events=len(tr.events), lost=dict(tr.lost))
                del tr
            else:
                t0 = time.perf_counter()
                out = flowreduce.allreduce(client, xs, **kw)
                wait(out)  # results stay on the workers, as in flowreduce bench
                rec.update(seconds=time.perf_counter() - t0)
            info = flowreduce.describe(out)
            rec.update(plan=str(info.plan), predicted_seconds=info.predicted)
            del out, xs
            idle()
            return rec

        for i in range(a.warmup):
            for traced in order_of(i):
                once(traced)
        for i in range(a.pairs):
            pair = {}
            for traced in order_of(i):
                pair["traced" if traced else "plain"] = once(traced)
            runs.append({"pair": i, "first": "plain" if not order_of(i)[0] else "traced", **pair})
            p, t = pair["plain"], pair["traced"]
            print(f"pair {i + 1:2d}/{a.pairs} ({runs[-1]['first']} first): plain {p['seconds']:.3f} s, "
                  f"traced {t['seconds']:.3f} s (call {t['call_seconds']:.3f} s, "
                  f"start+stop {(t['start_seconds'] + t['stop_seconds']) * 1e3:.1f} ms), "
                  f"ratio {t['seconds'] / p['seconds']:.3f}", file=sys.stderr, flush=True)

    plain = [r["plain"]["seconds"] for r in runs]
    traced = [r["traced"]["seconds"] for r in runs]
    call = [r["traced"]["call_seconds"] for r in runs]
    own = [r["traced"]["start_seconds"] + r["traced"]["stop_seconds"] for r in runs]
    summary = {
        "plain_seconds": describe(plain),
        "traced_seconds": describe(traced),
        "traced_call_seconds": describe(call),
        "ratio_traced_over_plain": describe([t / p for t, p in zip(traced, plain, strict=True)]),
        "ratio_call_over_plain": describe([c / p for c, p in zip(call, plain, strict=True)]),
        "trace_start_stop_seconds": describe(own),
        "trace_start_stop_over_plain_median": statistics.median(own) / statistics.median(plain),
        "events_per_call": statistics.median([r["traced"]["events"] for r in runs]),
        "lost": [r["traced"]["lost"] for r in runs if any(r["traced"]["lost"].values())],
    }
    doc = {
        "benchmark": "trace_overhead",
        "config": {"size": n, "bytes_per_rank": n * 8, "ranks": a.ranks, "pairs": a.pairs, "warmup": a.warmup,
                   "algorithm": a.algorithm, "chunks": a.chunks, "memory_limit": a.memory_limit,
                   "plan": runs[0]["plain"]["plan"] if runs else None,
                   "order": "pairs alternate plain-first / traced-first, starting plain-first"},
        "machine": {"started": started, "host": platform.node(), "cpus": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                    "python": platform.python_version(), "numpy": np.__version__,
                    "distributed": distributed.__version__, "flowreduce": getattr(flowreduce, "__version__", "")},
        "summary": summary,
        "pairs": runs,
    }
    print(report(doc))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"raw timings: {a.json}")
    return doc


def report(doc: dict) -> str:
    c, s, m = doc["config"], doc["summary"], doc["machine"]

    def sec(d: dict) -> str:
        return (f"median {d['median'] * 1e3:8.1f} ms  (95% CI of median {d['ci95_low'] * 1e3:.1f}-"
                f"{d['ci95_high'] * 1e3:.1f}; min {d['min'] * 1e3:.1f}, max {d['max'] * 1e3:.1f})")

    def ratio(d: dict) -> str:
        return (f"median {d['median']:.3f}  (95% CI of median {d['ci95_low']:.3f}-{d['ci95_high']:.3f}; "
                f"min {d['min']:.3f}, max {d['max']:.3f})")

    lines = [
        f"{c['algorithm']} ({c['plan']}), {c['ranks']} ranks x {c['size']:.3g} float64 "
        f"({c['bytes_per_rank'] / 1e6:.3g} MB) per rank; {c['pairs']} interleaved pairs after {c['warmup']} "
        f"warm-up; load average {m['loadavg_before'][0]:.1f} before, {m['loadavg_after'][0]:.1f} after",
        f"plain                        {sec(s['plain_seconds'])}",
        f"traced (incl. start/stop)    {sec(s['traced_seconds'])}",
        f"traced call alone            {sec(s['traced_call_seconds'])}",
        f"trace start + stop           {sec(s['trace_start_stop_seconds'])}"
        f"  = {s['trace_start_stop_over_plain_median']:.1%} of the plain median",
        f"per-pair traced / plain      {ratio(s['ratio_traced_over_plain'])}",
        f"per-pair call / plain        {ratio(s['ratio_call_over_plain'])}",
        f"events per traced call: {s['events_per_call']:.0f}"
        + (f"; records lost in {len(s['lost'])} runs" if s["lost"] else ""),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
