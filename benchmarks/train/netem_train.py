"""Training steps on the emulated multi-host network (``benchmarks/netem/``).

Runs **inside the head namespace** of an emulated cluster, against the
scheduler at ``DASK_SCHEDULER_ADDRESS``; ``benchmarks/train/netem.sh`` brings
the cluster up (4 hosts x 1 worker, 100 Mbit/s links), runs this and tears
it down. Nothing here trains or times by itself: the measurements are
``benchmarks/train/train_bench.py``'s (``run``: interleaved rounds in a
rotating order, medians, :mod:`flowreduce.train.timing`) and the traces are
``flowreduce train --trace``'s. This script only chooses the configurations,
adds what the network needs to be judged (the plan each bucket ran, the
busiest host link's bytes and the time they need at the link rate, the CPU
the cluster used, the tbf qdiscs' byte and drop counters) and writes JSON,
a figure and the traces.

Parts (``--parts``, in this order):

``probe``
    two algorithms, 3 steps x 2 rounds: what one step costs (to size a run);
``algorithms``
    step time per algorithm (``--algorithms``) at one bucket size
    (``--bucket``), overlap on: ``train_bench --experiment grid``;
``overlap``
    overlap on / off for one algorithm (``--overlap-algorithm``; ``best``:
    the fastest named algorithm of ``algorithms``) at ``--overlap-buckets``:
    ``train_bench --experiment overlap``;
``trace``
    ``flowreduce train --epochs 1 --trace DIR`` for each of ``--traces``
    (``ALGORITHM:BUCKET``, ``best`` allowed), then
    ``benchmarks/train/interleave.py DIR``;
``replot`` (alone, no cluster needed)
    redraw ``netem.png`` from the JSON files in ``--out``.

Outputs in ``--out`` (``netem-<part>.json``, ``trace-<algorithm>-<bucket>/``);
with ``--results DIR`` / ``--img DIR`` also the JSON files and the pictures
(``netem.png``, ``netem-steps-<algorithm>.png``) there.

    python benchmarks/netem/cluster.py --hosts 4 --rate 100mbit --no-nanny -- \\
        benchmarks/train/netem_train.py --out /tmp/train-netem --rate 100mbit
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowreduce.grouping import host_of

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "netem")]

import train_bench  # noqa: E402  (benchmarks/train/train_bench.py)
from cluster import rate_bytes  # noqa: E402  (benchmarks/netem/cluster.py)

PARTS = ("probe", "algorithms", "overlap", "trace", "replot")
FLAT = ["reduce-broadcast", "tree", "recursive-doubling", "butterfly", "ring", "auto"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/train-netem", help="directory for JSON, traces and pictures")
    p.add_argument("--results", default=None, help="also copy netem-*.json (and trace tables) here")
    p.add_argument("--img", default=None, help="also write the pictures here")
    p.add_argument(
        "--parts", default="algorithms,overlap,trace", help=f"comma-separated of {', '.join(PARTS)}"
    )
    p.add_argument(
        "--rate", default="100mbit", help="the cluster's link rate (recorded; sets the link floor)"
    )
    p.add_argument("--hidden", default="1024,1024")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--algorithms", default=",".join(FLAT))
    p.add_argument("--bucket", default="25MB", help="bucket size of the algorithms part")
    p.add_argument("--overlap-algorithm", default="best")
    p.add_argument("--overlap-buckets", default="0,1MB,25MB")
    p.add_argument(
        "--traces",
        default="best:1MB,reduce-broadcast:1MB",
        help="ALGORITHM:BUCKET,... traced with flowreduce train (best: the fastest named algorithm)",
    )
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds, the first of them warm-up")
    p.add_argument("--scheduler", default=os.environ.get("DASK_SCHEDULER_ADDRESS"))
    args = p.parse_args(argv)
    if not args.scheduler and args.parts != "replot":
        p.error("no scheduler: run inside the emulated cluster (DASK_SCHEDULER_ADDRESS) or pass --scheduler")
    args.parts = [x for x in args.parts.split(",") if x]
    bad = set(args.parts) - set(PARTS)
    if bad:
        p.error(f"unknown parts {sorted(bad)}")
    return args


# -- what the network did ------------------------------------------------------------------
def link_terms(call: Any, link_rate: float) -> dict[str, float]:
    """The busiest host link's bytes of one bucket all-reduce and the time
    they need at ``link_rate``, pipelined over chunks as the cost model
    does (no latency, no computation): a floor for that bucket."""
    from flowreduce.cost import link_loads, link_seconds

    order: dict[str, list[int]] = {}
    for r, w in enumerate(call.workers):
        order.setdefault(host_of(w), []).append(r)
    groups = list(order.values())
    if len(groups) < 2:
        return {"host_max_bytes": 0.0, "link_seconds": 0.0}
    loads = link_loads(call.plan, groups, call.nbytes)
    return {"host_max_bytes": loads.host_max, "link_seconds": link_seconds(loads, call.plan.chunks, 1 / link_rate)}


def plans_with_links(link_rate: float) -> Callable[[tuple[str, ...]], dict[str, Any]]:
    """What ``train_bench.run`` records of a step's buckets (``describe``):
    :func:`train_bench.plans_ran`'s fields, and each bucket's plan, the cost
    model's prediction and the link floor."""

    def describe(tokens: tuple[str, ...]) -> dict[str, Any]:
        from flowreduce.tracing.registry import lookup

        out = train_bench.plans_ran(tokens)
        calls = [c for c in map(lookup, tokens) if c is not None]
        out["plans"] = [
            {
                "algorithm": c.plan.algorithm,
                "chunks": c.plan.chunks,
                "levels": c.plan.depth,
                "tasks": c.plan.cost().tasks,
                "bytes": c.nbytes,
                "predicted": c.predicted,
                "options": {k: repr(v) for k, v in c.plan.options.items()},
                **link_terms(c, link_rate),
            }
            for c in calls
        ]
        out["predicted"] = sum(p["predicted"] for p in out["plans"])
        out["link_seconds"] = sum(p["link_seconds"] for p in out["plans"])
        out["host_max_bytes"] = sum(p["host_max_bytes"] for p in out["plans"])
        return out

    return describe


def _ns_pids() -> list[int]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    pids: list[int] = []
    for name in (line.split()[0] for line in out.splitlines() if line.strip()):
        if name.startswith("fr-h"):
            got = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            pids += [int(x) for x in got.split()]
    return pids


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds of every process in the emulated hosts (scheduler, workers,
    this client) and of the whole machine, and the wall clock."""
    tick = os.sysconf("SC_CLK_TCK")
    cluster = 0.0
    for pid in _ns_pids():
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cluster += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    cpu = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)
    return {
        "wall": time.time(),
        "cluster_cpu": cluster,
        "machine_busy": (sum(cpu) - idle) / tick,
        "machine_total": sum(cpu) / tick,
    }


def cpu_use(before: dict, after: dict) -> dict[str, float]:
    wall = after["wall"] - before["wall"]
    return {
        "seconds": wall,
        "cluster_cores_busy": (after["cluster_cpu"] - before["cluster_cpu"]) / wall if wall else float("nan"),
        "machine_cpu_share": (
            (after["machine_busy"] - before["machine_busy"])
            / max(after["machine_total"] - before["machine_total"], 1e-9)
        ),
        "cores": os.cpu_count(),
    }


def qdisc_counters() -> dict[str, dict[str, int]]:
    """Bytes sent and packets dropped by the tbf qdisc on each end of every
    host link: ``{"h0 up": {...}, "h0 down": {...}, ...}`` (up: host ->
    switch, in the host's namespace; down: switch -> host, in fr-sw)."""
    import re

    out: dict[str, dict[str, int]] = {}
    pat = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)")
    i = 0
    while True:
        got = {}
        for direction, ns, dev in (("up", f"fr-h{i}", f"fr-eth{i}"), ("down", "fr-sw", f"fr-sp{i}")):
            p = subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev],
                capture_output=True,
                text=True,
            )
            m = pat.search(p.stdout)
            if p.returncode or not m:
                return out
            got[direction] = {"bytes": int(m[1]), "packets": int(m[2]), "dropped": int(m[3])}
        for direction, v in got.items():
            out[f"h{i} {direction}"] = v
        i += 1


def qdisc_delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {k: {f: after[k][f] - before.get(k, {}).get(f, 0) for f in after[k]} for k in after}


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import dask
    import distributed
    import numpy
    from distributed import Client

    with Client(args.scheduler) as client:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    cost_model = dask.config.get("flowreduce.cost-model", None)
    return {
        "scheduler": args.scheduler,
        "workers": workers,
        "hosts": sorted({host_of(w) for w in workers}),
        "rate": args.rate,
        "link_bytes_per_s": rate_bytes(args.rate),
        "cost_model": cost_model,
        "python": platform.python_version(),
        "dask": dask.__version__,
        "distributed": distributed.__version__,
        "numpy": numpy.__version__,
        "kernel": platform.release(),
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "threads_env": {
            k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# -- the parts ----------------------------------------------------------------------------
def bench(args: argparse.Namespace, argv: list[str]) -> tuple[list[dict], argparse.Namespace, dict]:
    """One ``train_bench.run`` with ``argv``, plus CPU and qdisc counters around it."""
    bargs = train_bench.parse_args(
        [*argv, "--hidden", args.hidden, "--batch-size", str(args.batch_size), "--scheduler", args.scheduler]
    )
    load0, cpu0, q0 = os.getloadavg(), cpu_snapshot(), qdisc_counters()
    rows = train_bench.run(bargs, describe=plans_with_links(rate_bytes(args.rate)))
    cpu1, q1 = cpu_snapshot(), qdisc_counters()
    train_bench.print_table(rows, bargs)
    extra = {
        "cpu": cpu_use(cpu0, cpu1),
        "qdisc": qdisc_delta(q0, q1),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }
    print(
        f"cluster cores busy {extra['cpu']['cluster_cores_busy']:.2f} of {os.cpu_count()}, machine "
        f"{extra['cpu']['machine_cpu_share']:.0%}, {extra['cpu']['seconds']:.0f} s",
        flush=True,
    )
    return rows, bargs, extra


def save(args: argparse.Namespace, name: str, payload: dict) -> Path:
    out = Path(args.out) / f"netem-{name}.json"
    out.write_text(json.dumps(payload, indent=1, default=str))
    if args.results:
        shutil.copy(out, Path(args.results) / out.name)
    print(f"wrote {out}", flush=True)
    return out


def best_named(rows: list[dict]) -> str:
    named = [r for r in rows if r["algorithm"] not in ("auto", "hierarchical") and r["steps"]]
    return min(named, key=lambda r: r["seconds"])["algorithm"]


def part_bench(args: argparse.Namespace, env: dict, name: str, argv: list[str]) -> list[dict]:
    t0 = time.time()
    rows, bargs, extra = bench(args, argv)
    for r in rows:
        print_link(r)
    save(
        args,
        name,
        {
            "environment": env,
            "args": {k: v for k, v in vars(bargs).items() if k != "bucket_list"},
            "driver_args": vars(args),
            **extra,
            "wall_seconds": time.time() - t0,
            "rows": rows,
        },
    )
    return rows


def print_link(r: dict) -> None:
    label = train_bench.algorithm_label(r) if "algorithm" in r else ""
    plans = ", ".join(f"{p['algorithm']}x{p['chunks']}" for p in r.get("plans", []))
    print(
        f"  {label} {'overlap ' + ('on' if r.get('overlap') else 'off') if 'overlap' in r else ''} "
        f"bucket {r.get('bucket_bytes')}: plans [{plans}] step {r['seconds'] * 1e3:.0f} ms, link floor "
        f"{r.get('link_seconds', float('nan')) * 1e3:.0f} ms, predicted {r.get('predicted', float('nan')) * 1e3:.0f} ms",
        flush=True,
    )


def part_trace(args: argparse.Namespace, algorithm: str, bucket: str) -> dict:
    from flowreduce.cli.train import parse_bucket_bytes

    tag = f"{algorithm}-{bucket}"
    out_dir = Path(args.out) / f"trace-{tag}"
    cmd = [
        sys.executable,
        "-m",
        "flowreduce",
        "train",
        "--scheduler",
        args.scheduler,
        "--ranks",
        "4",
        "--epochs",
        "1",
        "--hidden",
        args.hidden,
        "--batch-size",
        str(args.batch_size),
        "--bucket-bytes",
        str(parse_bucket_bytes(bucket)),
        "--algorithm",
        algorithm,
        "--trace",
        str(out_dir),
        "--trace-steps",
        str(args.trace_steps),
        "--json",
        str(Path(args.out) / f"netem-trace-{tag}.json"),
    ]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    (Path(args.out) / f"trace-{tag}.txt").write_text(p.stdout + p.stderr)
    print(p.stdout[-2000:], p.stderr[-3000:] if p.returncode else "", flush=True)
    if p.returncode:
        raise SystemExit(f"flowreduce train failed (rc={p.returncode})")
    table = subprocess.run(
        [sys.executable, str(HERE / "interleave.py"), str(out_dir)], capture_output=True, text=True
    )
    (Path(args.out) / f"netem-interleave-{tag}.md").write_text(table.stdout + table.stderr)
    print(table.stdout, table.stderr, flush=True)
    if args.results:
        for f in (f"netem-trace-{tag}.json", f"netem-interleave-{tag}.md"):
            shutil.copy(Path(args.out) / f, Path(args.results) / f)
    if args.img:
        shutil.copy(out_dir / "steps.png", Path(args.img) / f"netem-steps-{algorithm}.png")
    meta = json.loads((out_dir / "steps.json").read_text())
    return {
        "algorithm": algorithm,
        "bucket": bucket,
        "dir": str(out_dir),
        "seconds": time.time() - t0,
        "workers": meta["workers"],
    }


# -- the figure ---------------------------------------------------------------------------
def _quartiles(row: dict) -> tuple[float, float]:
    s = sorted(t["seconds"] for t in row["timings"])
    if len(s) < 2:
        return row["seconds"], row["seconds"]
    q = statistics.quantiles(s, n=4)
    return q[0], q[2]


def _bars(ax: Any, xs: list[float], rows: list[dict], width: float, colour: str, label: str) -> None:
    """Bars as tall as the median step, the busiest rank's median compute in
    green at the bottom, the steps' interquartile range as an error bar."""
    step = [r["seconds"] * 1e3 for r in rows]
    comp = [min(r["compute"], r["seconds"]) * 1e3 for r in rows]
    q = [_quartiles(r) for r in rows]
    ax.bar(xs, [s - c for s, c in zip(step, comp)], width, bottom=comp, color=colour, label=label)
    ax.bar(xs, comp, width, color="#31a354")
    ax.errorbar(
        xs,
        step,
        yerr=[[s - lo * 1e3 for s, (lo, _) in zip(step, q)], [hi * 1e3 - s for s, (_, hi) in zip(step, q)]],
        fmt="none",
        ecolor="black",
        elinewidth=0.8,
        capsize=3,
    )


def plot(
    algo_rows: list[dict] | None, overlap_rows: list[dict] | None, args: argparse.Namespace, path: str
) -> None:
    from dask.utils import format_bytes
    from matplotlib.figure import Figure

    panels = [x for x in (algo_rows, overlap_rows) if x]
    if not panels:
        return
    fig = Figure(figsize=(5.4 * len(panels) + 1.2, 4.6))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    k = 0
    if algo_rows:
        ax = axes[k]
        k += 1
        labels = [train_bench.algorithm_label(r).replace(" (", "\n(") for r in algo_rows]
        xs = list(range(len(algo_rows)))
        _bars(ax, xs, algo_rows, 0.7, "#fd8d3c", "comm (step - compute)")
        floor = [r.get("link_seconds", float("nan")) * 1e3 for r in algo_rows]
        ax.scatter(
            xs,
            floor,
            marker="_",
            s=900,
            color="black",
            zorder=3,
            label=f"busiest link's bytes at {args.rate}",
        )
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("median step time (ms), IQR of the steps")
        ax.set_title(f"algorithms: bucket {args.bucket} (1 bucket), overlap on", fontsize=9)
        ax.legend(frameon=False, fontsize=7, loc="upper right")
        ax.grid(axis="y", linewidth=0.3)
    if overlap_rows:
        ax = axes[k]
        buckets = list(dict.fromkeys(r["bucket_bytes"] for r in overlap_rows))
        for j, ov in enumerate((True, False)):
            rs = [
                next(r for r in overlap_rows if r["bucket_bytes"] == b and r["overlap"] == ov)
                for b in buckets
            ]
            _bars(
                ax,
                [i - 0.2 + 0.4 * j for i in range(len(buckets))],
                rs,
                0.38,
                "#6baed6" if ov else "#d62728",
                f"overlap {'on' if ov else 'off'}",
            )
        n_buckets = {
            b: next(r.get("buckets", "?") for r in overlap_rows if r["bucket_bytes"] == b) for b in buckets
        }
        ax.set_xticks(
            range(len(buckets)),
            [
                ("per tensor" if not b else f"bucket {format_bytes(b)}")
                + f"\n({n_buckets[b]} all-reduce{'s' if n_buckets[b] != 1 else ''})"
                for b in buckets
            ],
            fontsize=8,
        )
        ax.set_ylabel("median step time (ms), IQR of the steps")
        ax.set_title(f"overlap on / off, {overlap_rows[0].get('ran', '')}", fontsize=9)
        ax.set_ylim(0, 1.18 * max(r["seconds"] * 1e3 for r in overlap_rows))
        ax.legend(frameon=False, fontsize=7, loc="upper center", ncol=2)
        ax.grid(axis="y", linewidth=0.3)
    fig.suptitle(
        f"4 emulated hosts x 1 worker, {args.rate} links: MLP 64-{args.hidden.replace(',', '-')}-10, "
        f"batch {args.batch_size}/rank (green: compute of the busiest rank)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def replot(args: argparse.Namespace) -> int:
    """Redraw the figure from ``--out``'s saved JSON (no cluster needed)."""
    rows = {}
    for name in ("algorithms", "overlap"):
        f = Path(args.out) / f"netem-{name}.json"
        if f.exists():
            saved = json.loads(f.read_text())
            rows[name] = saved["rows"]
            if name == "algorithms":
                args.bucket = saved["driver_args"]["bucket"]
    plot(rows.get("algorithms"), rows.get("overlap"), args, str(Path(args.out) / "netem.png"))
    if args.img:
        shutil.copy(Path(args.out) / "netem.png", Path(args.img) / "netem.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for d in (args.results, args.img):
        if d:
            Path(d).mkdir(parents=True, exist_ok=True)
    if args.parts == ["replot"]:
        return replot(args)
    env = environment(args)
    print(f"# {json.dumps(env)}", flush=True)
    t_start = time.time()
    rounds = ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    algo_rows = overlap_rows = None
    if "probe" in args.parts:
        part_bench(
            args,
            env,
            "probe",
            [
                "--experiment",
                "grid",
                "--algorithms",
                "ring,reduce-broadcast",
                "--bucket-bytes",
                args.bucket,
                "--steps",
                "3",
                "--rounds",
                "2",
            ],
        )
    if "algorithms" in args.parts:
        algo_rows = part_bench(
            args,
            env,
            "algorithms",
            ["--experiment", "grid", "--algorithms", args.algorithms, "--bucket-bytes", args.bucket, *rounds],
        )
    best = best_named(algo_rows) if algo_rows else "butterfly"
    if "overlap" in args.parts:
        alg = best if args.overlap_algorithm == "best" else args.overlap_algorithm
        overlap_rows = part_bench(
            args,
            env,
            "overlap",
            ["--experiment", "overlap", "--algorithm", alg, "--bucket-bytes", args.overlap_buckets, *rounds],
        )
    if algo_rows or overlap_rows:
        plot(algo_rows, overlap_rows, args, str(Path(args.out) / "netem.png"))
        if args.img:
            shutil.copy(Path(args.out) / "netem.png", Path(args.img) / "netem.png")
    traces = []
    if "trace" in args.parts:
        for item in args.traces.split(","):
            alg, _, bucket = item.partition(":")
            traces.append(part_trace(args, best if alg == "best" else alg, bucket or args.bucket))
    summary = {
        "environment": env,
        "best": best,
        "traces": traces,
        "wall_seconds": time.time() - t_start,
        "loadavg_end": os.getloadavg(),
    }
    if algo_rows:
        summary["algorithms"] = {
            train_bench.algorithm_label(r): {
                "step_ms": r["seconds"] * 1e3,
                "link_floor_ms": r.get("link_seconds", 0) * 1e3,
            }
            for r in algo_rows
        }
    save(args, "summary", summary)
    print(f"done in {time.time() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
