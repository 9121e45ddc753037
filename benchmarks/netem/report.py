"""Tables and figures of docs/network.md from the campaign's results.

    python benchmarks/netem/report.py benchmarks/results/netem --img docs/img > /tmp/tables.md

Reads the JSON files ``campaign.sh`` writes (``flat8.json``,
``flat16-*.json``, ``hier4x4*.json``, ``cost-model.json``) and prints the
markdown tables; with ``--img`` also draws ``network-flat.png`` (time and
busbw/link per algorithm and size), ``network-predicted.png`` (the
calibrated model's prediction against the measurement of every row) and
``network-calibration.png`` (the ping-pong and bandwidth samples with the
fitted lines).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

ORDER = ["baseline", "reduce-broadcast", "tree", "recursive-doubling", "butterfly", "ring", "hierarchical", "auto"]


def load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def merged(results: str, names: list[str]) -> dict | None:
    """Rows of several runs of one cluster shape (the 16-host sweep ran in
    two parts, each interleaved, with butterfly in both as the anchor)."""
    runs = [r for r in (load(os.path.join(results, f"{n}.json")) for n in names) if r]
    if not runs:
        return None
    out = dict(runs[0])
    rows: dict[tuple, dict] = {}
    for run in runs:
        for r in run["rows"]:
            rows.setdefault((r["size"], r["algorithm"], str(r["chunks"]), r.get("method")), r)
    out["rows"] = list(rows.values())
    return out


def label(r: dict) -> str:
    """``butterfly ×8``; rows of a ``--method`` run also carry it: ``butterfly ×8 [p2p]``."""
    method = f" [{r['method']}]" if r.get("method") and r["algorithm"] != "baseline" else ""
    if r["algorithm"] == "baseline":
        return "baseline"
    if r["algorithm"] == "auto":
        return "auto" + method
    return r["algorithm"] + (f" ×{r['chunks']}" if str(r["chunks"]) != "1" else "") + method


def key(r: dict):
    return (ORDER.index(r["algorithm"]) if r["algorithm"] in ORDER else 99, str(r["chunks"]), r.get("method") or "")


def method_table(runs: dict[str, dict]) -> str:
    """``bench_allreduce.py --method tasks,p2p`` runs: per algorithm (one
    chunk) and size, busbw / link and the median of each method, p2p's
    speed-up, and each method's time over reduce-broadcast's."""
    lines = ["| run | elements | algorithm | tasks: median, busbw/link | p2p: median, busbw/link | tasks / p2p "
             "| reduce-broadcast / it (tasks, p2p) |", "|---|---|---|---:|---:|---:|---:|"]
    for name, run in runs.items():
        by = {(r["algorithm"], str(r["chunks"]), r.get("method"), r["size"]): r for r in run["rows"]}
        for n in sorted({r["size"] for r in run["rows"]}):
            for alg in sorted({r["algorithm"] for r in run["rows"] if r["algorithm"] != "baseline"},
                              key=lambda a: ORDER.index(a.split("@")[0]) if a.split("@")[0] in ORDER else 99):
                t, p = by.get((alg, "1", "tasks", n)), by.get((alg, "1", "p2p", n))
                rb = {m: by.get(("reduce-broadcast", "1", m, n)) for m in ("tasks", "p2p")}
                cell = (lambda r: f"{r['median'] * 1e3:.0f} ms, {100 * r['link_fraction']:.0f}%" if r else "–")
                vs = [f"{rb[m]['median'] / r['median']:.2f}x" if rb[m] and r else "–" for m, r in (("tasks", t), ("p2p", p))]
                speedup = f"{t['median'] / p['median']:.2f}x" if t and p else "–"
                lines.append(f"| {name} | {n:.0e} | {alg} | {cell(t)} | {cell(p)} | {speedup} | {vs[0]}, {vs[1]} |")
    return "\n".join(lines)


def picked(r: dict) -> str:
    plan = r["plan"]
    if not plan.startswith("Plan("):
        return ""
    inside = plan[5:].split(", steps=")[0]
    return inside.replace("'", "").replace("ranks=", "p=")


def flat_table(run: dict) -> str:
    sizes = sorted({r["size"] for r in run["rows"]})
    rows = sorted({label(r): r for r in run["rows"]}.values(), key=key)
    labels = [label(r) for r in rows]
    head = "| algorithm | " + " | ".join(f"{n:.0e} ({n * 4 / 1e6:g} MB)" for n in sizes) + " |"
    lines = [head, "|---|" + "---:|" * len(sizes)]
    by = {(label(r), r["size"]): r for r in run["rows"]}
    for lab in labels:
        cells = []
        for n in sizes:
            r = by.get((lab, n))
            if r is None:
                cells.append("–")
                continue
            cells.append(f"{r['median']:.3g} s, {100 * r['link_fraction']:.0f}%")
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_lines(run: dict) -> list[str]:
    by = {(label(r), r["size"]): r for r in run["rows"]}
    out = []
    for n in sorted({r["size"] for r in run["rows"]}):
        rb, bf = by.get(("reduce-broadcast", n)), by.get(("butterfly", n))
        base = by.get(("baseline", n))
        best = min((r for (lab, m), r in by.items() if m == n and lab != "baseline"), key=lambda r: r["median"])
        bits = [f"{n:.0e}"]
        bits.append(f"{rb['median'] / bf['median']:.2f}" if rb and bf else "–")
        bits.append(f"{base['median'] / bf['median']:.2f}" if base and bf else "–")
        bits.append(f"{label(best)} ({best['median']:.3g} s)")
        bits.append(f"{base['median'] / best['median']:.2f}" if base else "–")
        bits.append(f"{100 * max(r['link_fraction'] for (lab, m), r in by.items() if m == n):.0f}%")
        bits.append(f"{statistics.median(r['cluster_cores'] for (lab, m), r in by.items() if m == n):.2f}")
        bits.append(f"{statistics.median(r['machine_cpu_percent'] for (lab, m), r in by.items() if m == n):.0f}%")
        out.append("| " + " | ".join(bits) + " |")
    return out


def ratio_table(runs: dict[str, dict]) -> str:
    lines = ["| hosts | elements | reduce-broadcast / butterfly | baseline / butterfly | fastest | baseline / fastest "
             "| best busbw / link | cluster cores busy | machine CPU |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for name, run in runs.items():
        lines += [f"| {name} " + line for line in ratio_lines(run)]
    return "\n".join(lines)


def ablation_table(runs: dict[str, dict]) -> str:
    lines = ["| hosts | elements | reduce-broadcast | + chunks only (×8) | algorithm only (butterfly) | both (butterfly ×8) "
             "| gain from chunks | gain from the algorithm | gain from both |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, run in runs.items():
        by = {(label(r), r["size"]): r["median"] for r in run["rows"]}
        for n in sorted({r["size"] for r in run["rows"]}):
            rb, rbc = by.get(("reduce-broadcast", n)), by.get(("reduce-broadcast ×8", n))
            bf, bfc = by.get(("butterfly", n)), by.get(("butterfly ×8", n))
            if None in (rb, rbc, bf, bfc):
                continue
            lines.append(f"| {name} | {n:.0e} | {rb:.3g} s | {rbc:.3g} s | {bf:.3g} s | {bfc:.3g} s "
                         f"| {rb / rbc:.2f}x | {rb / bf:.2f}x | {rb / bfc:.2f}x |")
    return "\n".join(lines)


def auto_table(runs: dict[str, dict]) -> str:
    lines = ["| cluster | elements | auto picked | auto | fastest named | auto / fastest |", "|---|---|---|---:|---|---:|"]
    for name, run in runs.items():
        for n in sorted({r["size"] for r in run["rows"]}):
            rs = [r for r in run["rows"] if r["size"] == n]
            auto = next((r for r in rs if r["algorithm"] == "auto"), None)
            named = [r for r in rs if r["algorithm"] not in ("auto", "baseline")]
            if not auto or not named:
                continue
            best = min(named, key=lambda r: r["median"])
            lines.append(f"| {name} | {n:.0e} | {picked(auto)} | {auto['median']:.3g} s | {label(best)} "
                         f"{best['median']:.3g} s | {auto['median'] / best['median']:.2f} |")
    return "\n".join(lines)


def prediction_table(runs: dict[str, dict]) -> str:
    lines = ["| cluster | rows | median measured / predicted | within 2x | within 1.5x |", "|---|---:|---:|---:|---:|"]
    for name, run in runs.items():
        ratios = [r["median"] / r["predicted"] for r in run["rows"] if r.get("predicted")]
        if not ratios:
            continue
        lines.append(f"| {name} | {len(ratios)} | {statistics.median(ratios):.2f} "
                     f"| {sum(0.5 <= x <= 2 for x in ratios)}/{len(ratios)} "
                     f"| {sum(1 / 1.5 <= x <= 1.5 for x in ratios)}/{len(ratios)} |")
    return "\n".join(lines)


def per_algorithm_prediction(run: dict) -> str:
    sizes = sorted({r["size"] for r in run["rows"]})
    lines = ["| algorithm | " + " | ".join(f"{n:.0e}" for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    by = {(label(r), r["size"]): r for r in run["rows"] if r.get("predicted")}
    for lab in sorted({lab for lab, _ in by}, key=lambda lab: key(next(r for (b, _), r in by.items() if b == lab))):
        cells = [f"{by[lab, n]['predicted']:.3g} / {by[lab, n]['median']:.3g}" if (lab, n) in by else "–"
                 for n in sizes]
        lines.append(f"| {lab} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_flat(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6.2 * len(runs), 8.5), squeeze=False)
    colours = plt.get_cmap("tab10")
    for k, (name, run) in enumerate(runs.items()):
        series: dict[str, list] = {}
        for r in run["rows"]:
            series.setdefault(label(r), []).append(r)
        for lab, rs in sorted(series.items(), key=lambda kv: key(kv[1][0])):
            rs.sort(key=lambda r: r["nbytes"])
            xs = [r["nbytes"] / 1e6 for r in rs]
            style = dict(color="k", lw=2, marker="s") if lab == "baseline" else dict(
                color=colours(ORDER.index(rs[0]["algorithm"]) % 10), marker="o", ms=4,
                ls="--" if "×" in lab else "-")
            axes[0][k].plot(xs, [r["median"] for r in rs], label=lab, **style)
            axes[1][k].plot(xs, [100 * r["link_fraction"] for r in rs], label=lab, **style)
        for ax in axes[:, k]:
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("MB per rank (float32)")
        axes[0][k].set_yscale("log")
        axes[0][k].set_ylabel("median seconds per all-reduce")
        axes[0][k].set_title(f"{name}: {run['workers']} workers, links {run['rate']}")
        axes[1][k].set_ylabel("busbw / link rate (%)")
        axes[1][k].axhline(70, color="grey", ls=":", lw=1)
        axes[1][k].set_ylim(0, 100)
        axes[0][k].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_predicted(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    markers = "osD^v<>"
    lo, hi = math.inf, 0.0
    for k, (name, run) in enumerate(runs.items()):
        rs = [r for r in run["rows"] if r.get("predicted")]
        for alg in ORDER:
            sel = [r for r in rs if r["algorithm"] == alg]
            if not sel:
                continue
            xs, ys = [r["predicted"] for r in sel], [r["median"] for r in sel]
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
            ax.scatter(xs, ys, marker=markers[k % len(markers)], color=plt.get_cmap("tab10")(ORDER.index(alg) % 10),
                       label=f"{name}: {alg}" if k == 0 else None, s=28, alpha=0.8)
    ax.plot([lo, hi], [lo, hi], "k-", lw=1)
    ax.plot([lo, hi], [2 * lo, 2 * hi], "k:", lw=0.8)
    ax.plot([lo, hi], [lo / 2, hi / 2], "k:", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted seconds (calibrated model)")
    ax.set_ylabel("measured median seconds")
    ax.set_title("prediction vs measurement; markers: " + ", ".join(
        f"{markers[k % len(markers)]} {n}" for k, n in enumerate(runs)), fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, title="colour = algorithm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_calibration(model_file: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    meas = model_file["measured"]
    for k, (cls, fit) in enumerate(meas["fits"].items()):
        s = [x for x in meas["samples"] if x["link"] == cls]
        colour = plt.get_cmap("tab10")(k)
        for x in s:
            ax.scatter([x["bytes"]] * len(x["runs"]), [1e3 * t for t in x["runs"]], color=colour, s=12, alpha=0.6)
        xs = sorted({x["bytes"] for x in s})
        grid = [xs[0] * (xs[-1] / xs[0]) ** (i / 60) for i in range(61)]
        ax.plot(grid, [1e3 * (fit["alpha"] + fit["beta"] * b) for b in grid], color=colour,
                label=f"{cls}: α = {fit['alpha'] * 1e3:.1f} ms, 1/β = {fit['bandwidth'] / 1e6:.1f} MB/s "
                      f"(rms {fit['rms_rel_error']:.0%})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per hop")
    ax.set_ylabel("ms per dependent hop")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("flowreduce calibrate on the emulated cluster (2 hosts × 2 workers)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def draw_cluster(path: str, hosts: int = 4, workers: int = 2, rate: str = "100mbit") -> None:
    """The emulated cluster as a picture (graphviz): host namespaces, their
    workers, the shaped veths and the bridge in the switch namespace."""
    import graphviz

    g = graphviz.Graph("netem", format=path.rsplit(".", 1)[-1], graph_attr={"rankdir": "TB", "fontsize": "11",
                                                                              "fontname": "Helvetica"},
                       node_attr={"fontname": "Helvetica", "fontsize": "10"}, edge_attr={"fontname": "Helvetica",
                                                                                          "fontsize": "9"})
    with g.subgraph(name="cluster_sw") as sw:
        sw.attr(label="namespace fr-sw (the switch)", style="rounded,filled", fillcolor="#eeeeee")
        sw.node("br0", "bridge br0", shape="box")
    for i in range(hosts):
        with g.subgraph(name=f"cluster_h{i}") as h:
            extra = "\nscheduler :8786, client" if i == 0 else ""
            h.attr(label=f"namespace fr-h{i}: host 10.77.0.{10 + i}{extra}", style="rounded", color="#4477aa")
            for j in range(workers):
                h.node(f"h{i}w{j}", f"worker h{i}-w{j}", shape="ellipse")
            h.node(f"eth{i}", f"fr-eth{i}\ntbf {rate} out", shape="box", style="filled", fillcolor="#ffe8cc")
            for j in range(workers):
                h.edge(f"h{i}w{j}", f"eth{i}")
            for j in range(1, workers):
                h.edge(f"h{i}w{j - 1}", f"h{i}w{j}", style="dashed", label="loopback,\nunshaped", constraint="false")
        g.edge(f"eth{i}", "br0", label=f"veth; fr-sp{i}: tbf {rate} in", penwidth="2")
    out = g.render(outfile=path, cleanup=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", help="directory with the campaign's JSON files")
    ap.add_argument("--img", help="directory to draw the figures into")
    ap.add_argument("--methods", nargs="+", metavar="JSON",
                    help="only the tasks-vs-p2p table of these bench_allreduce.py --method runs")
    args = ap.parse_args(argv)
    if args.methods:
        runs = {os.path.basename(f).removesuffix(".json"): load(f) for f in args.methods}
        print(method_table({k: v for k, v in runs.items() if v}))
        return 0
    if not args.results:
        ap.error("the results directory is needed (or --methods JSON...)")

    flat = {k: v for k, v in (("8 hosts", merged(args.results, ["flat8", "flat8-small"])),
                              ("16 hosts", merged(args.results, ["flat16"]))) if v}
    hier = {k: v for k, v in (("4×4, by host", load(os.path.join(args.results, "hier4x4.json"))),
                              ("4×4, interleaved", load(os.path.join(args.results, "hier4x4-interleaved.json"))))
            if v}
    for name, run in {**flat, **hier}.items():
        print(f"### {name}: {run['workers']} workers, links {run['rate']}\n")
        print(flat_table(run) + "\n")
    print("### Ratios\n\n" + ratio_table({**flat, **hier}) + "\n")
    messages = load(os.path.join(args.results, "flat8-messages.json"))
    ablation = {**flat, **({"8 hosts, messages ≤ 1 MB": messages} if messages else {})}
    print("### Ablation\n\n" + ablation_table(ablation) + "\n")
    print("### auto (calibrated model)\n\n" + auto_table({**flat, **hier}) + "\n")
    print("### Prediction\n\n" + prediction_table({**flat, **hier}) + "\n")
    for name, run in {**flat, **hier}.items():
        print(f"#### Predicted / measured per algorithm, {name}\n")
        print(per_algorithm_prediction(run) + "\n")
    if args.img:
        if flat:
            plot_flat(flat, os.path.join(args.img, "network-flat.png"))
        if hier:
            plot_flat(hier, os.path.join(args.img, "network-hierarchical.png"))
        plot_predicted({**flat, **hier}, os.path.join(args.img, "network-predicted.png"))
        draw_cluster(os.path.join(args.img, "network-cluster.png"))
        model = load(os.path.join(args.results, "cost-model.json"))
        if model:
            plot_calibration(model, os.path.join(args.img, "network-calibration.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
