"""OmniReduce's protocol: block-sparse against the dense butterfly.

26,214,400 float32 values (100 MB) per rank, blocks of 256, block density
0.1% ... 100%, three overlap patterns: ``random`` (each rank picks its
non-zero blocks independently), ``identical`` (all ranks the same blocks),
``disjoint`` (no block non-zero on two ranks; only where ranks·density <= 1).
At 100% every pattern is the same dense data, run once. Every configuration
is timed interleaved with ``algorithm="butterfly"`` on the same inputs
(medians of ``--repeat`` runs after ``--warmup``), and its bytes moved are
read from a trace of its last run.

Expected: block-sparse moves (density of the union)·n per rank, so its time
falls with density until the fixed costs (levels, the scan for zero blocks,
the dense output) dominate; with dense data it moves what the radix-p
butterfly moves, in one level fewer than the radix-2 butterfly.

    python benchmarks/sparse/omnireduce.py             # the full protocol (~10 min)
    python benchmarks/sparse/omnireduce.py --quick     # a smoke test

Writes docs/sparse/omnireduce.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    add_run_arguments,
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
BLOCK = 256
DENSITIES = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0]
PATTERNS = ["random", "identical", "disjoint"]


def block_input(n: int, block: int, density: float, pattern: str, rank: int, ranks: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s vector: exactly round(density·blocks) non-zero blocks of
    standard normal values, placed by ``pattern``."""
    nb = n // block
    k = int(round(density * nb))
    if pattern == "identical" or density >= 1:
        ids = np.random.default_rng(seed).choice(nb, k, replace=False)
    elif pattern == "disjoint":
        ids = np.random.default_rng(seed).permutation(nb)[rank * k:(rank + 1) * k]
    else:
        ids = np.random.default_rng(seed + 1 + rank).choice(nb, k, replace=False)
    x = np.zeros(n, np.float32)
    vals = np.random.default_rng(seed + 100 + rank).standard_normal((ids.size, block), dtype=np.float32)
    x.reshape(nb, block)[ids] = vals
    return x


def groups(densities, patterns, ranks):
    for d in densities:
        for pat in patterns:
            if d >= 1 and pat != patterns[0]:
                continue  # dense data has no pattern
            if pat == "disjoint" and d * ranks > 1:
                continue
            yield d, ("dense" if d >= 1 else pat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(ap, "omnireduce", N, quick="a few densities")
    ap.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    a = parse_run_args(ap, argv, densities="0.01,0.25,1.0")
    if a.render:
        meta, rows = read_json(a.name)
        return report(a.name, meta, rows, render_table, plot)
    n = int(a.size)
    densities = [float(x) for x in a.densities.split(",")]
    patterns = a.patterns.split(",")

    from distributed import wait

    import flowreduce
    from flowreduce.launch import cluster

    rows = []
    with cluster("local", workers=a.workers, memory_limit=a.memory_limit, progress=False) as client:
        workers = sorted(client.nthreads())
        p = len(workers)
        for i, (d, pattern) in enumerate(groups(densities, patterns, p)):
            xs = [client.submit(block_input, n, BLOCK, d, pattern, r, p, 1000 * i, workers=[w], pure=False)
                  for r, w in enumerate(workers)]
            wait(xs)
            from _common import checksum

            expected = sum(client.gather([client.submit(checksum, x, workers=[w], pure=False)
                                          for x, w in zip(xs, workers)]))
            configs = [
                ("block-sparse", lambda xs=xs: flowreduce.allreduce(client, xs, algorithm="block-sparse")),
                ("butterfly", lambda xs=xs: flowreduce.allreduce(client, xs, algorithm="butterfly")),
            ]
            rows += run_interleaved(client, {"density": d, "pattern": pattern}, configs, expected,
                                    repeat=a.repeat, warmup=a.warmup)
            del xs
    meta = {**machine(), "elements": n, "block": BLOCK, "ranks": p, "repeat": a.repeat, "warmup": a.warmup,
            "command": "python benchmarks/sparse/omnireduce.py " + " ".join(argv or sys.argv[1:])}
    write_json(a.name, meta, rows)
    return report(a.name, meta, rows, render_table, plot)


def render_table(rows, meta) -> str:
    sp = speedups(rows, "butterfly")
    base = {(r.group["density"], r.group["pattern"]): r for r in rows if r.label == "butterfly"}
    lines = [
        f"{meta['elements']:,} float32 per rank, block {meta['block']}, {meta['ranks']} ranks; median of "
        f"{meta['repeat']} runs (ms), interleaved; speed-up = median over runs of butterfly/block-sparse time in the same run; bytes moved between workers from a trace of the last run.",
        "",
        "| density | pattern | block-sparse ms | butterfly ms | speed-up | block-sparse MB moved | butterfly MB moved "
        "| bytes ratio | correct |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.label != "block-sparse":
            continue
        b = base[(r.group["density"], r.group["pattern"])]
        ratio = (r.bytes_moved / b.bytes_moved) if r.bytes_moved and b.bytes_moved else float("nan")
        lines.append(f"| {r.group['density']:.1%} | {r.group['pattern']} | {r.median * 1e3:.0f} | "
                     f"{b.median * 1e3:.0f} | {sp[id(r)]:.2f}x | {mb(r.bytes_moved)} | {mb(b.bytes_moved)} | "
                     f"{ratio:.3f} | {'yes' if r.correct and b.correct else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows, path, meta) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sp = speedups(rows, "butterfly")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    marks = {"random": "o", "identical": "s", "disjoint": "^", "dense": "*"}
    for pattern in marks:
        rs = sorted((r for r in rows if r.label == "block-sparse" and r.group["pattern"] == pattern),
                    key=lambda r: r.group["density"])
        if not rs:
            continue
        xs = [r.group["density"] * 100 for r in rs]
        ax1.plot(xs, [sp[id(r)] for r in rs], marker=marks[pattern], label=pattern)
        ax2.plot(xs, [r.bytes_moved / 1e6 for r in rs], marker=marks[pattern], label=f"block-sparse, {pattern}")
    dense = [r for r in rows if r.label == "butterfly"]
    ax2.axhline(np.median([r.bytes_moved for r in dense]) / 1e6, color="k", ls="--", label="butterfly (dense)")
    ax1.axhline(1.0, color="k", ls="--", lw=1)
    ax1.axhline(1 / 1.1, color="r", ls=":", lw=1, label="10% slower than butterfly")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("non-zero blocks per rank (%)")
        ax.grid(alpha=0.3, which="both")
    ax1.set_ylabel("speed-up over the dense butterfly (x)")
    ax1.set_yscale("log")
    ax2.set_ylabel("MB moved between workers (all links)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.suptitle(f"Block-sparse all-reduce (OmniReduce protocol): {meta['elements']:,} float32 x "
                 f"{meta['ranks']} ranks, block {meta['block']}, median of {meta['repeat']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
