"""``flowreduce calibrate``: measure α and β of each link class on a running
cluster (:mod:`flowreduce.calibration`) and write them to a cost model file.

Example::

    flowreduce calibrate --scheduler tcp://head:8786 -o cost-model.json
    flowreduce bench --scheduler tcp://head:8786 --cost-model cost-model.json

or once for all calls, in the dask config: ``flowreduce: {cost-model:
/path/cost-model.json}``.
"""

from __future__ import annotations

import argparse
import datetime

from flowreduce.calibration import LARGE, SMALL, calibrate
from flowreduce.cost import CostModel


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flowreduce.launch import add_cluster_arguments

    p.add_argument("-o", "--output", required=True, help="the cost model file to write (JSON)")
    p.add_argument("--small", default=",".join(map(str, SMALL)), help="ping-pong sizes in bytes")
    p.add_argument("--large", default=",".join(map(str, LARGE)), help="bandwidth-run sizes in bytes")
    p.add_argument("--hops", type=int, default=8, help="dependent hops per chain (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="chains per size; the median counts (default 3)")
    p.add_argument("--base", metavar="PATH", help="start from this cost model file (default: built-in constants)")
    add_cluster_arguments(p, workers_default=2)


def run(args: argparse.Namespace) -> int:
    from flowreduce.launch import from_args

    def sizes(text: str) -> list[int]:
        return [int(float(s)) for s in text.split(",") if s.strip()]

    base = CostModel.from_file(args.base) if args.base else None

    def show(cls: str, n: int, t: float) -> None:
        print(f"{cls:>6} {n:>12} bytes  {t * 1e3:9.3f} ms/hop  {n / t / 1e6:10.1f} MB/s", flush=True)

    with from_args(args, progress=False) as client:
        model, meta = calibrate(client, small=sizes(args.small), large=sizes(args.large), hops=args.hops,
                                repeat=args.repeat, base=base, progress=show)
    for cls, f in meta["fits"].items():
        print(f"# {cls}: alpha {f['alpha'] * 1e3:.3f} ms, beta {f['beta']:.3g} s/B "
              f"({f['bandwidth'] / 1e6:.1f} MB/s), rms relative error {f['rms_rel_error']:.1%}")
    meta["created"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model.to_file(args.output, measured=meta)
    print(f"# wrote {args.output}; use it with --cost-model {args.output} or the dask config key "
          "flowreduce.cost-model")
    return 0
