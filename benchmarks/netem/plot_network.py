"""Plot the network sweeps of ``bench_allreduce.py``: median time per
algorithm against vector size, one panel per run (1 chunk solid, chunked
dashed, the hand-written baseline black).

    python benchmarks/netem/plot_network.py /tmp/net8.json /tmp/net4x4.json -o docs/img/network.png
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="JSON files written by bench_allreduce.py")
    ap.add_argument("-o", "--output", required=True, help="PNG or SVG")
    ap.add_argument("--titles", help="comma-separated panel titles (default: from the files)")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = args.titles.split(",") if args.titles else None
    fig, axes = plt.subplots(1, len(args.runs), figsize=(6.5 * len(args.runs), 4.8), squeeze=False)
    for k, (path, ax) in enumerate(zip(args.runs, axes[0])):
        with open(path) as f:
            run = json.load(f)
        rows = run["rows"]
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            series.setdefault((r["algorithm"], str(r["chunks"])), []).append((r["nbytes"], r["median"]))
        colours = plt.get_cmap("tab10")
        names = sorted({a for a, _ in series if a != "baseline"})
        for (alg, chunks), pts in sorted(series.items()):
            pts.sort()
            xs, ys = [p[0] / 1e6 for p in pts], [p[1] for p in pts]
            if alg == "baseline":
                ax.plot(xs, ys, "k-o", lw=2, label="baseline (submit sum + replicate)")
                continue
            style = "-" if chunks == "1" else "--"
            ax.plot(xs, ys, style, marker="o", ms=3, color=colours(names.index(alg)),
                    label=f"{alg}, {chunks} chunk{'s' if chunks != '1' else ''}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("MB per rank")
        ax.set_ylabel("median seconds per all-reduce")
        ax.set_title(titles[k] if titles else f"{run['workers']} workers, links {run['rate']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print("wrote", args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
