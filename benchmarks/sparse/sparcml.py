"""A SparCML-style sweep: k non-zeros per rank, sparse algorithms against the
dense butterfly.

Every rank holds a 1-D ``scipy.sparse.csr_array`` of 26,214,400 float32
elements (100 MB dense) with k non-zeros at uniformly random places, and the
same data as a dense numpy array. Each k runs ``sparse-recursive-doubling``,
``sparse-split-allgather``, ``auto`` (on the sparse inputs) and
``butterfly`` (on the dense ones) interleaved (medians of ``--repeat`` runs
after ``--warmup``), with bytes moved from a trace of each one's last run.

Expected: recursive doubling sends ~2^s·k pairs at step s (lg p steps, the
fewest levels), split-allgather ~k·(p-1)/p pairs in the reduce-scatter and
the union's (p-1)/p in the all-gather; both switch to dense once the union
passes the break-even density (0.5 for float32 with int32 indices), where
they become the dense algorithms plus packing.

    python benchmarks/sparse/sparcml.py           # the full sweep (~5 min)
    python benchmarks/sparse/sparcml.py --quick   # a smoke test

Writes docs/sparse/sparcml.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_run_arguments,
    checksum,
    machine,
    mb,
    parse_run_args,
    read_json,
    report,
    run_interleaved,
    speedups,
    write_json,
)

N = 26_214_400
KS = [1_000, 10_000, 100_000, 1_000_000, 4_000_000, 8_000_000]
SPARSE = ["sparse-recursive-doubling", "sparse-split-allgather", "auto"]


def sparse_input(n: int, k: int, rank: int, seed: int):
    import scipy.sparse as sp

    rng = np.random.default_rng(seed + rank)
    idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int32)
    vals = rng.standard_normal(k, dtype=np.float32)
    return sp.csr_array((vals, idx, np.array([0, k], dtype=np.int32)), shape=(n,))


def densify(x) -> np.ndarray:
    return x.toarray()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap, "sparcml", N, quick="three k")
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="non-zeros per rank")
    a = parse_run_args(ap, argv, ks="100,10000,300000")
    if a.render:
        meta, rows = read_json(a.name)
        return report(a.name, meta, rows, render_table, plot)
    n = int(a.size)
    ks = [int(float(k)) for k in a.ks.split(",")]

    from distributed import wait

    import flowreduce
    from flowreduce.launch import cluster

    rows = []
    with cluster("local", workers=a.workers, memory_limit=a.memory_limit, progress=False) as client:
        workers = sorted(client.nthreads())
        p = len(workers)
        for i, k in enumerate(ks):
            sparse = [client.submit(sparse_input, n, k, r, 1000 * i, workers=[w], pure=False)
                      for r, w in enumerate(workers)]
            dense = [client.submit(densify, x, workers=[w], pure=False) for x, w in zip(sparse, workers)]
            wait(sparse + dense)
            expected = sum(client.gather([client.submit(checksum, x, workers=[w], pure=False)
                                          for x, w in zip(sparse, workers)]))
            configs = [(alg, lambda alg=alg, xs=sparse: flowreduce.allreduce(client, xs, algorithm=alg))
                       for alg in SPARSE]
            configs.append(("butterfly", lambda xs=dense: flowreduce.allreduce(client, xs, algorithm="butterfly")))
            rows += run_interleaved(client, {"k": k, "density": k / n}, configs, expected,
                                    repeat=a.repeat, warmup=a.warmup)
            del sparse, dense
    meta = {**machine(), "elements": n, "ranks": p, "repeat": a.repeat, "warmup": a.warmup,
            "command": "python benchmarks/sparse/sparcml.py " + " ".join(argv or sys.argv[1:])}
    write_json(a.name, meta, rows)
    return report(a.name, meta, rows, render_table, plot)


def _short(plan: str) -> str:
    """'sparse-split-allgather radix 2' from a plan's repr."""
    name = plan.split("'")[1] if "'" in plan else plan
    radix = plan.split("radix=")[1].split(",")[0] if "radix=" in plan else ""
    inner = "ring" if "inner='ring'" in plan else ""
    return name + (f" radix {radix}" if radix else "") + (" ring" if inner else "")


def render_table(rows, meta) -> str:
    sp = speedups(rows, "butterfly")
    lines = [
        f"{meta['elements']:,} float32 per rank ({meta['elements'] * 4 / 1e6:.0f} MB dense), k random non-zeros "
        f"per rank, {meta['ranks']} ranks; median of {meta['repeat']} runs (ms), interleaved; speed-up = median over runs of the butterfly's time / this time in the same run; MB moved between "
        "workers from a trace of the last run (planned: the cost card at the measured density).",
        "",
        "| k per rank | density | algorithm | ms | speed-up vs butterfly | MB moved | MB planned | correct |",
        "|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.group["k"], r.label != "butterfly")):
        name = r.label if r.label != "auto" else f"auto ({_short(r.plan)})"
        lines.append(f"| {r.group['k']:,} | {r.group['density']:.3%} | {name} | {r.median * 1e3:.0f} | "
                     f"{sp[id(r)]:.2f}x | {mb(r.bytes_moved)} | {mb(r.bytes_planned)} | "
                     f"{'yes' if r.correct else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows, path, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, mark in (("sparse-recursive-doubling", "o"), ("sparse-split-allgather", "s"), ("auto", "x"),
                        ("butterfly", "*")):
        rs = sorted((r for r in rows if r.label == label), key=lambda r: r.group["k"])
        ks = [r.group["k"] for r in rs]
        name = label if label != "butterfly" else "butterfly (dense inputs)"
        ax1.plot(ks, [r.median * 1e3 for r in rs], marker=mark, label=name)
        ax2.plot(ks, [r.bytes_moved / 1e6 for r in rs], marker=mark, label=name)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("non-zeros per rank (k)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    ax1.set_ylabel("median time (ms)")
    ax2.set_ylabel("MB moved between workers (all links)")
    fig.suptitle(f"Sparse all-reduce (SparCML-style sweep): {meta['elements']:,} float32 x {meta['ranks']} "
                 f"ranks, median of {meta['repeat']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
