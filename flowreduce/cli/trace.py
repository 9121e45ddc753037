"""``flowreduce trace``: run one all-reduce on random inputs and write its
trace (``trace.json`` for Perfetto, ``trace.csv``), pictures
(``timeline.png``, ``timeline.svg``) and summary (``summary.txt``,
``summary.json``) to a directory.

Example::

    flowreduce trace --algorithm butterfly --ranks 4 --size 1e7 -o out/
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from flowreduce.cli.args import add_cost_model_argument, model_from_args, spec_from_arg
from flowreduce.cli.trace_files import write_all


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithm", default="butterfly", help="algorithm name, with options as "
                        "NAME:OPTION=VALUE[:...], e.g. butterfly:radix=4 (default: butterfly)")
    parser.add_argument("--ranks", type=int, default=4, help="number of ranks = workers (default: 4)")
    parser.add_argument("--size", type=float, default=1e6, help="elements per rank (default: 1e6)")
    parser.add_argument("--chunks", type=int, default=None, help="chunks (default: flowreduce's choice)")
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--warmup", type=int, default=1, help="untraced calls first (default: 1)")
    parser.add_argument("--straggler", default=None, metavar="RANK:SECONDS",
                        help="make RANK's input arrive SECONDS late (to see a straggler)")
    parser.add_argument("--align", default="auto", choices=("auto", "host", "dask"), help="clock alignment")
    parser.add_argument("-o", "--output", required=True, help="directory to write into")
    from flowreduce.launch import add_cluster_arguments

    add_cluster_arguments(parser, workers_default=None)
    add_cost_model_argument(parser)


def _make_input(n: int, dtype: str, seed: int, delay: float = 0.0):
    import numpy as np

    if delay:
        time.sleep(delay)
    return np.random.default_rng(seed).random(n).astype(dtype, copy=False)


def _inputs(client: Any, workers: list[str], n: int, dtype: str, delays: dict[int, float], salt: int):
    return [client.submit(_make_input, n, dtype, 1000 * salt + r, delays.get(r, 0.0), workers=[w],
                          allow_other_workers=False, pure=False)
            for r, w in enumerate(workers)]


def run_traced(client: Any, args: argparse.Namespace) -> tuple[Any, Any]:
    """Warm up, then trace one all-reduce; returns ``(trace, output futures)``."""
    import flowreduce
    from flowreduce.launch import ranked_workers
    from flowreduce.tracing.capture import trace

    workers = ranked_workers(client)
    if len(workers) < args.ranks:
        raise SystemExit(f"need {args.ranks} workers, the cluster has {len(workers)}")
    workers = workers[: args.ranks]
    n = int(args.size)
    delays: dict[int, float] = {}
    if args.straggler:
        r, _, s = args.straggler.partition(":")
        delays[int(r)] = float(s or 0.5)
    name, options = spec_from_arg(args.algorithm)
    kw: dict[str, Any] = {"algorithm": name, "model": model_from_args(args), **options}
    if args.chunks:
        kw["chunks"] = args.chunks
    for i in range(args.warmup):
        xs = _inputs(client, workers, n, args.dtype, {}, i + 1)
        client.gather(flowreduce.allreduce(client, xs, **kw))
        del xs
    with trace(client, align=args.align) as tr:
        xs = _inputs(client, workers, n, args.dtype, delays, 0)
        out = flowreduce.allreduce(client, xs, **kw)  # noted by the open trace
        client.gather(out)
    return tr, out


def run(args: argparse.Namespace) -> int:
    from flowreduce.launch import from_args

    spec_from_arg(args.algorithm)  # a bad name or option fails before any cluster starts
    with from_args(args, workers=args.ranks) as client:
        tr, _ = run_traced(client, args)
        title = f"{args.algorithm}, {args.ranks} ranks, {args.size:g} x {args.dtype}"
        paths = write_all(tr, args.output, title)
        with open(paths["summary.txt"]) as f:
            print(f.read())
        print("wrote", ", ".join(paths.values()))
    return 0
