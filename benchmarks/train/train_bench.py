"""Step time of data-parallel training, side by side in one run.

Experiments (``--experiment``):

``grid``
    every algorithm x every bucket size (overlap on): the five flat
    algorithms, ``hierarchical`` over groups of ``--group-size`` ranks
    (default 2: 2x2 on 4 ranks; one machine has one host, so the groups
    are passed explicitly, else hierarchical would be its flat inner
    algorithm) and ``auto`` (the table names what it chose per bucket);
``overlap``
    every bucket size x overlap on/off (one algorithm);
``straggler``
    one rank's backward delayed by each of ``--delays`` seconds, overlap
    on/off: how much of the delay the step hides
    (``hidden = 1 - (T(d) - T(0)) / d``).

Every configuration is its own trainer (own weights on the workers) on one
cluster. A run is ``--rounds`` rounds; in each round every configuration
runs ``--steps`` steps, in an order that rotates from round to round, so the
machine's noise hits all of them alike. The first round is warm-up; of each
round's steps the first two are dropped (the two-step pipeline filling up).
Rows report medians over the remaining steps (>= 5 per row with the
defaults). Step time, compute and comm are defined in
:mod:`flowreduce.train.timing`.

Expected: with a small model (the default 64-128-64-10) a step is dominated
by the all-reduce's dependent task levels, so fewer buckets (one big bucket)
are faster and overlap gains little; with a wide model the backward pass
takes long enough to hide some of the first buckets' reduction.

Example::

    python benchmarks/train/train_bench.py --experiment grid --json grid.json --plot grid.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

ALGORITHMS = ["reduce-broadcast", "tree", "recursive-doubling", "butterfly", "ring", "hierarchical", "auto"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from flowreduce.cli.train import parse_bucket_bytes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", choices=("grid", "overlap", "straggler"), default="grid")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--algorithms", default=",".join(ALGORITHMS))
    p.add_argument("--algorithm", default="ring", help="the algorithm of the overlap and straggler experiments")
    p.add_argument("--group-size", type=int, default=2,
                   help="hierarchical: ranks per group (emulated host), e.g. 2 = 2x2 on 4 ranks")
    p.add_argument("--bucket-bytes", default="0,16kB,25MB",
                   help="comma-separated bucket sizes (0: no fusion)")
    p.add_argument("--bucket", default="16kB", help="the bucket size of the straggler experiment")
    p.add_argument("--delays", default="0,0.02,0.05,0.1,0.2", help="straggler delays in seconds")
    p.add_argument("--straggler-rank", type=int, default=2)
    p.add_argument("--hidden", default="128,64")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=6, help="steps per configuration per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the first of them warm-up")
    p.add_argument("--scheduler", default=None, help="address of a running scheduler (default: a LocalCluster)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG/SVG path of the figure (comma-separated: several)")
    p.add_argument("--replot", default=None, metavar="JSON", help="redraw the table and figure of a saved run")
    args = p.parse_args(argv)
    args.bucket_list = [parse_bucket_bytes(b) for b in args.bucket_bytes.split(",")]
    return args


def configurations(args: argparse.Namespace) -> list[tuple[dict, Any]]:
    from flowreduce.cli.train import parse_bucket_bytes
    from flowreduce.train.config import TrainConfig

    hidden = tuple(int(h) for h in args.hidden.split(","))
    base = TrainConfig(ranks=args.ranks, hidden=hidden, batch=args.batch_size, dtype=args.dtype, epochs=1000,
                       algorithm=args.algorithm, options=algorithm_options(args.algorithm, args))
    out = []
    if args.experiment == "grid":
        for a in args.algorithms.split(","):
            for b in args.bucket_list:
                out.append(({"algorithm": a, "bucket_bytes": b},
                            replace(base, algorithm=a, bucket_bytes=b, options=algorithm_options(a, args))))
    elif args.experiment == "overlap":
        for b in args.bucket_list:
            for ov in (True, False):
                out.append(({"bucket_bytes": b, "overlap": ov}, replace(base, bucket_bytes=b, overlap=ov)))
    else:
        bucket = parse_bucket_bytes(args.bucket)
        for d in (float(x) for x in args.delays.split(",")):
            for ov in (True, False):
                out.append(({"delay": d, "overlap": ov},
                            replace(base, bucket_bytes=bucket, overlap=ov,
                                    straggler=(args.straggler_rank, d) if d else None)))
    return out


def algorithm_options(algorithm: str, args: argparse.Namespace) -> dict:
    """The all-reduce options of ``algorithm``: hierarchical gets groups of
    ``--group-size`` consecutive ranks."""
    return {"group_size": args.group_size} if algorithm == "hierarchical" else {}


def plans_ran(tokens: tuple[str, ...]) -> dict[str, str]:
    """What a step's bucket all-reduces ran: ``{"ran": "ring, tree"}`` (in
    bucket order, repeats dropped) and, for hierarchical plans, ``{"groups":
    "2+2"}`` (ranks per group)."""
    from flowreduce.tracing.registry import lookup

    plans = [c.plan for c in map(lookup, tokens) if c is not None]
    out = {"ran": ", ".join(dict.fromkeys(p.algorithm for p in plans))}
    groups = {"+".join(str(len(g)) for g in p.options["groups"]) for p in plans if p.options.get("groups")}
    if groups:
        out["groups"] = ", ".join(sorted(groups))
    return out


def run(args: argparse.Namespace, describe: Callable[[tuple[str, ...]], dict] | None = None) -> list[dict]:
    """Every configuration, ``--steps`` steps per round in a rotating order;
    each row records what its last step's buckets ran: ``describe(tokens)``
    (default :func:`plans_ran`)."""
    from flowreduce.launch import cluster, ranked_workers
    from flowreduce.train import timing
    from flowreduce.train.loop import DataParallel

    configs = configurations(args)
    rows: list[dict] = [{**label, "timings": []} for label, _ in configs]
    with cluster("local", workers=args.ranks) if not args.scheduler else _connect(args.scheduler) as client:
        workers = ranked_workers(client)[:args.ranks]
        trainers = [DataParallel(client, cfg, workers) for _, cfg in configs]
        position = [0] * len(trainers)
        for rnd in range(args.rounds):
            order = list(range(len(trainers)))
            order = order[rnd % len(order):] + order[:rnd % len(order)]
            for i in order:
                dp = trainers[i]
                since = time.time() - 1.0
                steps = []
                for _ in range(args.steps):
                    n = position[i]
                    steps.append(dp.step(n // dp.steps_per_epoch, n % dp.steps_per_epoch))
                    position[i] += 1
                dp.finish()
                if rnd == 0:
                    continue
                ts = timing.read(client, dp, steps, since)[2:]
                rows[i]["timings"] += [t.as_dict() for t in ts]
                rows[i]["buckets"] = len(steps[-1].tokens)
                rows[i].update((describe or plans_ran)(steps[-1].tokens))
            print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    for row in rows:
        ts = row["timings"]
        for k in ("seconds", "compute", "comm", "allreduce_work"):
            row[k] = statistics.median(t[k] for t in ts) if ts else float("nan")
        row["comm_share"] = statistics.median(t["comm_share"] for t in ts) if ts else float("nan")
        row["steps"] = len(ts)
    return rows


def _connect(address: str) -> Any:
    from distributed import Client

    return Client(address)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    keys = [k for k in ("algorithm", "bucket_bytes", "overlap", "delay") if k in rows[0]]
    print("| " + " | ".join(keys) + " | buckets | step ms | compute ms | comm ms | comm share | all-reduce tasks ms |"
          " steps |")
    print("|" + "---|" * (len(keys) + 7))
    for r in rows:
        label = " | ".join(algorithm_label(r) if k == "algorithm" else _fmt(k, r[k]) for k in keys)
        print(f"| {label} | {r.get('buckets', '')} | {r['seconds'] * 1e3:.1f} | {r['compute'] * 1e3:.1f} | "
              f"{r['comm'] * 1e3:.1f} | {r['comm_share']:.0%} | {r['allreduce_work'] * 1e3:.1f} | {r['steps']} |")
    if args.experiment == "straggler":
        for ov in (True, False):
            base = next(r["seconds"] for r in rows if r["delay"] == 0 and r["overlap"] == ov)
            for r in rows:
                if r["overlap"] == ov and r["delay"] > 0:
                    hidden = 1 - (r["seconds"] - base) / r["delay"]
                    print(f"overlap {'on ' if ov else 'off'} delay {r['delay'] * 1e3:5.0f} ms: step +"
                          f"{(r['seconds'] - base) * 1e3:6.1f} ms, hidden {hidden:.0%}")


def algorithm_label(row: dict) -> str:
    """``auto (chose tree)``, ``hierarchical (groups 2+2)``, or the name
    (rows saved before the benchmark recorded what ran have the name only)."""
    label = row["algorithm"]
    if row["algorithm"] == "auto" and row.get("ran"):
        label += f" (chose {row['ran']})"
    if row.get("groups"):
        label += f" (groups {row['groups']})"
    return label


def _fmt(key: str, value: Any) -> str:
    if key == "bucket_bytes":
        from dask.utils import format_bytes

        return "off (per tensor)" if not value else format_bytes(value)
    if key == "overlap":
        return "on" if value else "off"
    if key == "delay":
        return f"{value * 1e3:g} ms"
    return str(value)


def plot(rows: list[dict], args: argparse.Namespace, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2))
    ax = fig.add_subplot()
    if args.experiment == "straggler":
        for ov, colour in ((True, "#31a354"), (False, "#d62728")):
            pts = sorted((r["delay"] * 1e3, r["seconds"] * 1e3) for r in rows if r["overlap"] == ov)
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=colour,
                    label=f"overlap {'on' if ov else 'off'}")
        base = min(r["seconds"] for r in rows if r["delay"] == 0) * 1e3
        xs = sorted({r["delay"] * 1e3 for r in rows})
        ax.plot(xs, [base + x for x in xs], ":", color="grey", label="step(0) + delay (nothing hidden)")
        ax.set_xlabel(f"delay of rank {args.straggler_rank}'s backward (ms)")
        ax.set_ylabel("median step time (ms)")
        ax.legend(frameon=False)
    else:
        group_key, bar_key = ("algorithm", "bucket_bytes") if args.experiment == "grid" else ("bucket_bytes", "overlap")
        groups = list(dict.fromkeys(r[group_key] for r in rows))
        bars = list(dict.fromkeys(r[bar_key] for r in rows))
        colours = ["#fd8d3c", "#6baed6", "#74c476", "#9e9ac8", "#fdd0a2"]
        width = 0.8 / len(bars)
        for j, b in enumerate(bars):
            xs, comp, comm = [], [], []
            for i, g in enumerate(groups):
                r = next((r for r in rows if r[group_key] == g and r[bar_key] == b), None)
                if r is None:
                    continue
                xs.append(i - 0.4 + width * (j + 0.5))
                comp.append(r["compute"] * 1e3)
                comm.append(r["comm"] * 1e3)
            ax.bar(xs, comm, width * 0.95, bottom=comp, color=colours[j % len(colours)],
                   label=f"{_fmt(bar_key, b)}" if bar_key != "overlap" else f"overlap {_fmt(bar_key, b)}")
            ax.bar(xs, comp, width * 0.95, color="#31a354")
        ticks = [algorithm_label(next(r for r in rows if r["algorithm"] == g)).replace(" (", "\n(")
                 if group_key == "algorithm" else _fmt(group_key, g) for g in groups]
        ax.set_xticks(range(len(groups)), ticks, fontsize=8)
        ax.set_ylabel("median step time (ms)\n(green: compute of the busiest rank)")
        ax.legend(frameon=False, title="bucket size" if bar_key == "bucket_bytes" else None, fontsize=8)
    ax.set_title(f"{args.experiment}: {args.ranks} ranks, MLP 64-{args.hidden.replace(',', '-')}-10, "
                 f"batch {args.batch_size}/rank", fontsize=10)
    ax.grid(axis="y", linewidth=0.3)
    fig.tight_layout()
    for p in path.split(","):
        fig.savefig(p, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:  # redraw a saved run: --replot RUN.json --plot OUT.png
        saved = json.load(open(args.replot))
        vars(args).update({k: v for k, v in saved["args"].items() if k not in ("plot", "replot", "json")})
        rows = saved["rows"]
        print_table(rows, args)
        if args.plot:
            plot(rows, args, args.plot)
        return 0
    rows = run(args)
    print_table(rows, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "bucket_list"}, "rows": rows}, f,
                      indent=1)
    if args.plot:
        plot(rows, args, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
