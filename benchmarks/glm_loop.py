"""A dask-glm-style solver as the all-reduce benchmark (issue #26, item 3).

Logistic regression by gradient descent with a fixed step, the data sharded
over the workers (one shard per worker, made on the worker), the weights
kept per worker (each worker's copy updated by its own update task). Per
iteration: a gradient task per worker, an all-reduce of the gradients, an
update task per worker. Written three ways:

``naive``
    ``client.submit(sum_of_gradients, *grads)``: one task (wherever the
    scheduler puts it) sums the four gradients; every update task reads it.
``futures``
    ``flowreduce.allreduce(client, grads)`` on the gradient futures.
``delayed``
    the same loop with ``dask.delayed`` gradient and update functions and
    ``flowreduce.allreduce(client, delayed_grads)`` (a list of ``Delayed``
    in, a list of ``Delayed`` out), persisted once at the end.

Everything is submitted without waiting and waited for once at the end.
Shards and initial weights are made and waited for before the clock starts;
the clock covers submitting the ``--iterations`` iterations and waiting for
the final weights. The final loss (the full data set's mean log-loss at
each variant's final weights, computed after the clock) must agree between
the variants within rounding: the script asserts it. ``client.who_has``
checks, before and after each run, that each shard (and, after it, each
worker's final weights) is held by its own worker only.

Variants are interleaved (rotating order) within each repetition, so they
share the machine's state; the first ``--warmup`` repetitions are not kept.

    python benchmarks/warm_memory.py --gib 12
    python benchmarks/glm_loop.py --sizes 1e3,1e5,1e6,1e7 --repeat 5,5,5,3 --warmup 1 \\
        --json glm.json --markdown glm.md --trace glm-traces --trace-sizes 1e5,1e6
    python benchmarks/glm_loop.py --report glm.json      # the table again, from the JSON

Measured and discussed in docs/workflows.md.

``--trace DIR`` then traces one more iteration of the ``futures`` and of the
``naive`` loop at the largest size (``--trace-sizes`` to choose), after two
untraced ones (``flowreduce.trace``: the user's gradient and update tasks and
the all-reduce on one timeline), into DIR/<variant>-<size>/: timeline.png and
.svg, trace.json (Perfetto), summary.txt (flowreduce's summary of the call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

# Run as a script, this directory is sys.path[0], and its sparse/ folder would shadow the
# pydata `sparse` package that dask.array probes for (AttributeError: no SparseArray).
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import dask  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client, Future, LocalCluster, futures_of, wait  # noqa: E402

import flowreduce  # noqa: E402

VARIANTS = ("naive", "futures", "delayed")


# -- the user's functions (what a dask-glm solver would write) -----------------
def make_shard(seed: int, rows: int, n_features: int) -> tuple[np.ndarray, np.ndarray]:
    """One worker's rows of the data set: X (rows x n_features), labels y in {0, 1}."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, n_features))
    X /= math.sqrt(n_features)  # keeps X @ w of order 1 whatever n_features
    truth = np.random.default_rng(12345).standard_normal(n_features)
    y = (X @ truth + 0.1 * rng.standard_normal(rows) > 0).astype(np.float64)
    return X, y


def init_weights(n_features: int) -> np.ndarray:
    return np.zeros(n_features)


def gradient(shard: tuple[np.ndarray, np.ndarray], w: np.ndarray) -> np.ndarray:
    """This shard's gradient of the summed log-loss: X.T @ (sigmoid(X w) - y)."""
    X, y = shard
    p = 1.0 / (1.0 + np.exp(-(X @ w)))
    return X.T @ (p - y)


def update(w: np.ndarray, g: np.ndarray, step: float) -> np.ndarray:
    """A new array (never in place: the previous weights may still be read)."""
    return w - step * g


def sum_of_gradients(*grads: np.ndarray) -> np.ndarray:
    total = grads[0].copy()
    for g in grads[1:]:
        total += g
    return total


def shard_loss(shard: tuple[np.ndarray, np.ndarray], w: np.ndarray) -> float:
    """Summed log-loss of this shard at w (numerically stable form)."""
    X, y = shard
    z = X @ w
    return float(np.sum(np.logaddexp(0.0, z) - y * z))


# -- the three loops -------------------------------------------------------------
def loop_naive(client, shards, weights, workers, iterations, step):
    w = list(weights)
    for _ in range(iterations):
        grads = [client.submit(gradient, s, wk, workers=[wr], pure=False) for s, wk, wr in zip(shards, w, workers)]
        total = client.submit(sum_of_gradients, *grads, pure=False)
        w = [client.submit(update, wk, total, step, workers=[wr], pure=False) for wk, wr in zip(w, workers)]
    return w


def loop_futures(client, shards, weights, workers, iterations, step):
    w = list(weights)
    for _ in range(iterations):
        grads = [client.submit(gradient, s, wk, workers=[wr], pure=False) for s, wk, wr in zip(shards, w, workers)]
        summed = flowreduce.allreduce(client, grads)
        w = [client.submit(update, wk, gk, step, workers=[wr], pure=False) for wk, gk, wr in zip(w, summed, workers)]
    return w


def loop_delayed(client, shards, weights, workers, iterations, step):
    """Shards and initial weights are futures already on their workers; the
    loop is built lazily (each worker's tasks annotated to it, as the other
    loops pin them) and persisted once."""
    dgrad, dupdate = dask.delayed(gradient, pure=False), dask.delayed(update, pure=False)
    w = [dask.delayed(f) for f in weights]
    s = [dask.delayed(f) for f in shards]
    for _ in range(iterations):
        grads = []
        for k, wr in enumerate(workers):
            with dask.annotate(workers=[wr], allow_other_workers=False):
                grads.append(dgrad(s[k], w[k]))
        summed = flowreduce.allreduce(client, grads)
        new = []
        for k, wr in enumerate(workers):
            with dask.annotate(workers=[wr], allow_other_workers=False):
                new.append(dupdate(w[k], summed[k], step))
        w = new
    return client.persist(w, optimize_graph=False)


LOOPS = {"naive": loop_naive, "futures": loop_futures, "delayed": loop_delayed}


# -- checks and measurements ---------------------------------------------------
def check_placement(client, futures, workers, when: str) -> None:
    """Each of ``futures`` (shards, or final weights) held by its own worker only."""
    who = client.who_has(futures)
    for f, w in zip(futures, workers):
        holders = list(who[f.key])
        if holders != [w]:
            raise AssertionError(f"{when}: {f.key} is held by {holders}, expected only {w}")


def final_loss(client, shards, w, workers) -> tuple[float, float]:
    """Mean log-loss over all rows at each worker's final weights (rank 0's
    copy), and the largest difference between the workers' copies."""
    losses = [client.submit(shard_loss, s, w[0], workers=[wr], pure=False) for s, wr in zip(shards, workers)]
    rows = sum(client.gather([client.submit(lambda sh: len(sh[1]), s, workers=[wr], pure=False)
                              for s, wr in zip(shards, workers)]))
    spread = client.submit(lambda *ws: float(max(np.max(np.abs(x - ws[0])) for x in ws)), *w, pure=False).result()
    return sum(client.gather(losses)) / rows, spread


def supports_delayed(client) -> str | None:
    """None if this flowreduce takes a list of Delayed, else why not."""
    try:
        out = flowreduce.allreduce(client, [dask.delayed(np.ones)(3) for _ in range(2)])
        values = client.gather(out) if isinstance(out[0], Future) else dask.compute(*out)
        assert all(np.array_equal(v, np.full(3, 2.0)) for v in values), values
        return None
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def run_once(client, variant, shards, workers, n, iterations, step):
    weights = [client.submit(init_weights, n, workers=[wr], pure=False) for wr in workers]
    wait(weights + list(shards))
    check_placement(client, shards, workers, f"{variant} before")
    t0 = time.perf_counter()
    w = LOOPS[variant](client, shards, weights, workers, iterations, step)
    t_submit = time.perf_counter() - t0
    if variant == "delayed":  # persisted Delayed: one future each
        w = [futures_of(d)[0] for d in w]
    wait(w)
    total = time.perf_counter() - t0
    del weights
    errs = [f for f in w if f.status != "finished"]
    if errs:
        errs[0].result()  # raises the task's error
    check_placement(client, shards, workers, f"{variant} after")
    check_placement(client, w, workers, f"{variant}'s final weights")
    loss, spread = final_loss(client, shards, w, workers)
    del w
    return {"submit_s": t_submit, "total_s": total, "per_iter_ms": 1000 * total / iterations, "loss": loss,
            "copies_max_abs_diff": spread}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def git_head() -> str:
    try:
        return subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()[:120]
    except OSError:
        return "?"


def trace_one_iteration(client, shards, workers, n, step, out_dir: str, variant: str = "futures") -> dict:
    """Trace one iteration of a futures loop (``futures`` or ``naive``), after
    two untraced ones: DIR/timeline.png (and .svg), trace.json, summary.txt."""
    from flowreduce.tracing import plot_timeline, summarize, to_chrome

    os.makedirs(out_dir, exist_ok=True)
    w = [client.submit(init_weights, n, workers=[wr], pure=False) for wr in workers]
    w = LOOPS[variant](client, shards, w, workers, 2, step)
    wait(w)
    with flowreduce.trace(client) as tr:
        if variant == "futures":  # loop_futures, one iteration, keeping the call's futures for tr.add
            grads = [client.submit(gradient, s, wk, workers=[wr], pure=False) for s, wk, wr in zip(shards, w, workers)]
            summed = flowreduce.allreduce(client, grads)
            w = [client.submit(update, wk, gk, step, workers=[wr], pure=False) for wk, gk, wr in zip(w, summed, workers)]
            wait(w)
            # a call placed on arrival is not noted by the open trace by itself (its record is made by its
            # barrier, on a worker): tell it, so that the engine's steps and the summary are in the trace
            tr.add(summed, grads)
        else:
            w = LOOPS[variant](client, shards, w, workers, 1, step)
            wait(w)
    to_chrome(tr, os.path.join(out_dir, "trace.json"))
    if tr.calls:
        with open(os.path.join(out_dir, "summary.txt"), "w") as f:
            f.write(str(summarize(tr)) + "\n")
    what = "flowreduce.allreduce on futures" if variant == "futures" else "naive submit(sum_of_gradients)"
    plot_timeline(tr, [os.path.join(out_dir, "timeline.png"), os.path.join(out_dir, "timeline.svg")],
                  title=f"one glm_loop iteration, {n:.0e} features, {what}")
    return {"dir": out_dir, "variant": variant, "size": n, "events": len(tr.events)}


def summarise(runs: dict[str, list[dict]], variants: list[str], skipped: dict[str, str]) -> dict:
    """One size's runs per variant: medians, losses, and naive / this (of the medians, and per repetition)."""
    row: dict = {}
    for v in variants:
        if v in skipped:
            row[v] = {"skipped": skipped[v]}
            continue
        rs = runs[v]
        row[v] = {"median": {k: statistics.median(r[k] for r in rs) for k in ("submit_s", "total_s", "per_iter_ms")},
                  "losses": [r["loss"] for r in rs], "runs": rs}
    if "median" in row.get("naive", {}):
        for v in variants:
            if "median" in row[v]:
                row[v]["naive_over_this"] = row["naive"]["median"]["per_iter_ms"] / row[v]["median"]["per_iter_ms"]
                pairs = [a["per_iter_ms"] / b["per_iter_ms"] for a, b in zip(runs["naive"], runs[v])]
                row[v]["paired_naive_over_this"] = {"median": statistics.median(pairs), "min": min(pairs),
                                                    "max": max(pairs), "all": pairs}
    return row


def table(results: dict, sizes: list[int]) -> str:
    """Medians per variant; naive / this of the medians, and the median (min-max) of the
    per-repetition ratios (each repetition runs every variant back to back)."""
    lines = ["| features (gradient bytes) | variant | submit s | total s | submit / total | per iteration ms | "
             "naive / this: medians | naive / this: per repetition, median (min-max) | load | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for n in sizes:
        row = results[str(n)]
        load = row.get("load_range")
        load = f"{load[0]:g}-{load[1]:g}" if load else ""
        for v in VARIANTS:
            r = row.get(v)
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {n:.0e} ({8 * n / 1e6:g} MB) | {v} | | | | | | | | not run: {r['skipped']} |")
                continue
            m = r["median"]
            ratio = f"{r['naive_over_this']:.2f}x" if "naive_over_this" in r else ""
            paired = r.get("paired_naive_over_this")
            paired = (f"{paired['median']:.2f}x ({paired['min']:.2f}-{paired['max']:.2f})"
                      if paired and v != "naive" else "")
            lines.append(f"| {n:.0e} ({8 * n / 1e6:g} MB) | {v} | {m['submit_s']:.3f} | {m['total_s']:.2f} | "
                         f"{100 * m['submit_s'] / m['total_s']:.0f}% | {m['per_iter_ms']:.1f} | {ratio} | {paired} | "
                         f"{load} | {r['losses'][0]:.12g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e3,1e5,1e6,1e7", help="n_features (gradient lengths), comma-separated")
    ap.add_argument("--rows", type=int, default=4, help="rows per shard (small: the gradients dominate)")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--step", type=float, default=10.0, help="fixed step on the summed gradient / total rows")
    ap.add_argument("--repeat", default="5", help="timed repetitions per variant and size (or one per size: 5,5,5,3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rtol", type=float, default=1e-9, help="final losses must agree within this")
    ap.add_argument("--json", help="write everything (raw timings too) here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--trace", metavar="DIR", help="trace one futures iteration (and one naive) into DIR/futures-<size>/ "
                    "(and DIR/naive-<size>/) after the timed runs of that size")
    ap.add_argument("--report", metavar="JSON", help="print (and --markdown) the table of a --json file, run nothing")
    ap.add_argument("--trace-sizes", default=None, help="sizes to trace (default: the largest)")
    a = ap.parse_args(argv)
    sizes = [int(float(s)) for s in a.sizes.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    trace_sizes = [int(float(s)) for s in a.trace_sizes.split(",")] if a.trace_sizes else [max(sizes)]
    counts = [int(x) for x in a.repeat.split(",")]
    if len(counts) not in (1, len(sizes)):
        ap.error("--repeat: one count, or one per size")
    repeats = dict(zip(sizes, counts * len(sizes) if len(counts) == 1 else counts))
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    if a.report:
        with open(a.report) as f:
            done = json.load(f)
        for row in done["results"].values():
            keep = [v for v in VARIANTS if v in row]
            row.update(summarise({v: row[v].get("runs", []) for v in keep}, keep,
                                 {v: row[v]["skipped"] for v in keep if "skipped" in row[v]}))
        md = table(done["results"], [int(n) for n in done["results"]])
        print(md)
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write(md + "\n")
        return done
    started = datetime.now(timezone.utc)
    out: dict = {"started": started.isoformat(timespec="seconds"), "args": vars(a), "git": git_head(),
                 "versions": {"python": platform.python_version(), "dask": dask.__version__,
                              "numpy": np.__version__, "flowreduce": flowreduce.__version__},
                 "cores": os.cpu_count(), "load_before": loadavg(), "results": {}}
    with LocalCluster(n_workers=a.workers, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        workers = sorted(client.nthreads())
        why_not = supports_delayed(client) if "delayed" in variants else None
        if why_not:
            print(f"delayed: not run, this flowreduce does not take Delayed inputs ({why_not})", flush=True)
        for n in sizes:
            rows_total = a.rows * len(workers)
            step = a.step / rows_total
            shards = [client.submit(make_shard, 1000 + k, a.rows, n, workers=[wr], pure=False)
                      for k, wr in enumerate(workers)]
            wait(shards)
            runs: dict[str, list[dict]] = {v: [] for v in variants}
            loads = []
            for rep in range(a.warmup + repeats[n]):
                order = variants[rep % len(variants):] + variants[:rep % len(variants)]
                for v in order:
                    if v == "delayed" and why_not:
                        continue
                    r = run_once(client, v, shards, workers, n, a.iterations, step)
                    r["load"] = loadavg()
                    loads.append(r["load"][0])
                    tag = "warm-up" if rep < a.warmup else f"rep {rep - a.warmup + 1}"
                    print(f"{n:.0e} {v:8s} {tag:8s} submit {r['submit_s']:7.3f} s  total {r['total_s']:7.2f} s  "
                          f"{r['per_iter_ms']:8.1f} ms/iter  loss {r['loss']:.15g}  load {r['load'][0]}", flush=True)
                    if rep >= a.warmup:
                        runs[v].append(r)
            row = summarise(runs, variants, {"delayed": f"flowreduce at {out['git'][:7]} refuses Delayed inputs "
                                                        f"({why_not})"} if why_not else {})
            row["load_range"] = [min(loads), max(loads)] if loads else None
            all_losses = [x for v in variants for x in row[v].get("losses", [])]
            ref = all_losses[0]
            bad = [x for x in all_losses if not math.isclose(x, ref, rel_tol=a.rtol)]
            print(f"{n:.0e}: final losses {sorted(set(all_losses))}", flush=True)
            assert not bad, f"final losses disagree at n={n}: {all_losses}"
            out["results"][str(n)] = row
            if a.trace and n in trace_sizes:
                for v in ("futures", "naive"):
                    out.setdefault("traces", []).append(
                        trace_one_iteration(client, shards, workers, n, step, os.path.join(a.trace, f"{v}-{n:.0e}"), v))
            del shards
    out["load_after"] = loadavg()
    out["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    md = table(out["results"], sizes)
    print(md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(md + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
