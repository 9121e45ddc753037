"""The flowreduce sweep on the emulated multi-host network.

Run inside the head namespace with ``DASK_SCHEDULER_ADDRESS`` set, e.g.::

    python benchmarks/netem/cluster.py --hosts 8 --no-nanny --rate 100mbit -- \\
        benchmarks/netem/bench_allreduce.py --rate 100mbit --sizes 1e5,1e6,1e7 --json /tmp/net8.json

One ``flowreduce.cli.bench`` sweep per size: every algorithm at one chunk, the
``--chunked`` ones also at ``--chunks`` chunks, against the hand-written
baseline, interleaved (rotating order, fresh inputs every run). Around each
size it records the CPU seconds of the cluster's own processes (workers
and scheduler) and the whole machine's CPU use, so a reader can check that
the links, not the two cores, were the bottleneck. Rows get
``link_fraction``: busbw over the link rate (the physical limit of a
bandwidth-optimal all-reduce), and ``predicted``: the cost model's time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from cluster import rate_bytes  # benchmarks/netem/cluster.py (this script's directory)


def _cpu_seconds(dask_worker=None, dask_scheduler=None) -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def cluster_cpu(client) -> float:
    """CPU seconds used so far by every worker process and the scheduler."""
    return sum(client.run(_cpu_seconds).values()) + client.run_on_scheduler(_cpu_seconds)


def interleaved(workers: list[str], host_of) -> list[str]:
    """Workers in round-robin order over hosts: rank r's neighbours sit on other hosts."""
    hosts: dict[str, list[str]] = {}
    for w in workers:
        hosts.setdefault(host_of(w), []).append(w)
    out = []
    for i in range(max(map(len, hosts.values()))):
        out += [ws[i] for ws in hosts.values() if i < len(ws)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", required=True, help="the emulated link rate, as given to cluster.py (e.g. 100mbit)")
    ap.add_argument("--sizes", default="1e5,1e6,1e7")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--algorithms", default="reduce-broadcast,tree,recursive-doubling,butterfly,ring,hierarchical")
    ap.add_argument("--chunked", default="reduce-broadcast,butterfly",
                    help="algorithms that also run at --chunks chunks (the ablation), or 'none'")
    ap.add_argument("--chunks", type=int, default=8, help="the chunked variant (default 8)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--order", choices=("host", "interleaved"), default="host",
                    help="rank order: by host (default) or round-robin over hosts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs of every row at 1e4 elements before the sweep (connections, imports)")
    ap.add_argument("--cost-model", help="cost model file for auto and the predictions (flowreduce calibrate)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    import psutil
    from distributed import Client

    from flowreduce.cli import bench
    from flowreduce.cost import CostModel
    from flowreduce.grouping import host_of
    from flowreduce.launch import ranked_workers

    link = rate_bytes(args.rate)
    model = CostModel.from_file(args.cost_model) if args.cost_model else None
    algorithms = args.algorithms.split(",")
    chunked = [] if args.chunked == "none" else args.chunked.split(",")
    # auto picks its own chunk count; every other algorithm runs at one chunk (and the chunked ones at --chunks)
    configs = [(a, None if a == "auto" else 1) for a in algorithms] + [(a, args.chunks) for a in chunked]
    rows = []
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as client:
        workers = ranked_workers(client)
        if args.order == "interleaved":
            workers = interleaved(workers, host_of)
        hosts = len({host_of(w) for w in workers})
        print(f"# {len(workers)} workers on {hosts} hosts ({args.order} order), links {args.rate} "
              f"({link / 1e6:.2f} MB/s each way), {args.dtype}", flush=True)
        print(bench.HEADER[:118] + "  pred ms  cl-cores mach%  link%", flush=True)
        if args.warmup:
            bench.bench(client, [10_000], [], extra=configs, repeat=args.warmup, warmup=0, progress=False,
                        dtype=args.dtype, baseline=not args.no_baseline, model=model, workers=workers)
        for n in bench.parse_sizes(args.sizes):
            psutil.cpu_percent(None)  # start the machine-wide interval
            cpu0, t0 = cluster_cpu(client), time.monotonic()
            got = bench.bench(client, [n], [], extra=configs,
                              repeat=args.repeat, warmup=0, progress=False,
                              dtype=args.dtype, baseline=not args.no_baseline, model=model, workers=workers)
            cores = (cluster_cpu(client) - cpu0) / (time.monotonic() - t0)
            machine = psutil.cpu_percent(None)
            for r in got:
                r.update(cluster_cores=cores, machine_cpu_percent=machine, link_fraction=r["busbw"] / link,
                         hosts=hosts, order=args.order, rate=args.rate)
                pred = f"{r['predicted'] * 1e3:8.0f}" if r.get("predicted") else "       -"
                print(bench.format_row(r)[:118] + f" {pred} {cores:9.2f} {machine:5.0f} "
                      f"{100 * r['link_fraction']:5.0f}  {r['plan']}", flush=True)
            rows += got
            with open(args.json, "w") as f:  # after every size: a later failure keeps what was measured
                json.dump({"rate": args.rate, "link_bytes_per_s": link, "workers": len(workers), "hosts": hosts,
                           "order": args.order, "dtype": args.dtype, "cost_model": args.cost_model,
                           "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
