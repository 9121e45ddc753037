"""The flowreduce sweep on the emulated multi-host network.

Run inside the head namespace with ``DASK_SCHEDULER_ADDRESS`` set, e.g.::

    python benchmarks/netem/cluster.py --hosts 8 --workers-per-host 1 --rate 400mbit -- \\
        benchmarks/netem/bench_allreduce.py --rate 400mbit --sizes 1e5,1e6,5e6 --json /tmp/net8.json

One ``flowreduce.bench`` sweep per size (every algorithm at 1 chunk and at
``--chunks`` chunks, against the hand-written baseline, interleaved), with
the machine's CPU use over each size, so a reader can check that the links,
not the two cores, were the bottleneck. Rows get ``link_fraction``: busbw
over the link rate (the physical limit of a bandwidth-optimal all-reduce).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def rate_bytes(text: str) -> float:
    """'400mbit' -> bytes/s (tc's units: kbit, mbit, gbit)."""
    t = text.lower()
    for unit, f in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * f / 8
    return float(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", required=True, help="the emulated link rate, as given to cluster.py (e.g. 400mbit)")
    ap.add_argument("--sizes", default="1e5,1e6,5e6")
    ap.add_argument("--algorithms", default="reduce-broadcast,tree,recursive-doubling,butterfly,ring,hierarchical")
    ap.add_argument("--chunks", type=int, default=8, help="the chunked variant of every algorithm (default 8)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    import psutil
    from distributed import Client

    from flowreduce import bench

    link = rate_bytes(args.rate)
    rows = []
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as client:
        nworkers = len(client.nthreads())
        print(f"# {nworkers} workers, links {args.rate} ({link / 1e6:.1f} MB/s each way)", flush=True)
        print(bench.HEADER + "   cpu  link%", flush=True)
        for n in bench.parse_sizes(args.sizes):
            psutil.cpu_percent(None)  # start the interval
            got = bench.bench(client, [n], args.algorithms.split(","), chunks=[1, args.chunks],
                              repeat=args.repeat, warmup=args.warmup, progress=False)
            cpu = psutil.cpu_percent(None)
            for r in got:
                r["cpu_percent"] = cpu
                r["link_fraction"] = r["busbw"] / link
                print(bench.format_row(r)[:118] + f" {cpu:5.0f} {100 * r['link_fraction']:5.0f}", flush=True)
            rows += got
    with open(args.json, "w") as f:
        json.dump({"rate": args.rate, "link_bytes_per_s": link, "workers": nworkers, "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
