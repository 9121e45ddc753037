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

``--method tasks,p2p`` runs every row once per method, all interleaved in the
same sweep (one baseline): the row ``butterfly`` is run as ``butterfly+tasks``
and ``butterfly+p2p`` (``allreduce(..., method=...)``). Rows carry ``method``
(what was asked; without ``--method``: null, the call's default, the dask
config ``flowreduce.method``) and ``ran`` (what ``describe`` says ran).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

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


@contextmanager
def methods_by_suffix():
    """``flowreduce.cli.bench.bench`` interleaves its (algorithm, chunks)
    rows but has no method option: while this is open an algorithm word
    ``NAME+METHOD`` (e.g. ``ring+p2p``, ``ring+p2p@dask``) is planned as
    ``NAME`` and run with ``method=METHOD``. Yields ``{word: set of
    describe(...).method}``: what actually ran for each word (also without
    a suffix; keyed by the word and any transport other than auto, e.g. ``ring+p2p@dask``)."""
    import flowreduce
    import flowreduce.algorithms as algorithms

    parse0, allreduce0, describe0 = algorithms.parse_spec, flowreduce.allreduce, flowreduce.describe
    now: dict = {"word": None, "method": None, "key": None}
    ran: dict[str, set] = {}

    def parse_spec(text):
        name, plus, method = text.rpartition("+")
        now.update(word=text, method=method if plus else None)
        return parse0(name if plus else text)

    def allreduce(*a, **kw):
        transport = kw.get("transport", "auto")
        now["key"] = now["word"] + ("" if transport in (None, "auto") else f"@{transport}")
        if now["method"] is not None:
            kw["method"] = now["method"]
        return allreduce0(*a, **kw)

    def describe(outs):
        info = describe0(outs)
        ran.setdefault(now["key"], set()).add(getattr(info, "method", None))
        return info

    algorithms.parse_spec, flowreduce.allreduce, flowreduce.describe = parse_spec, allreduce, describe
    try:
        yield ran
    finally:
        algorithms.parse_spec, flowreduce.allreduce, flowreduce.describe = parse0, allreduce0, describe0


def with_method(alg: str, method: str | None) -> str:
    """``ring@dask`` with ``p2p`` -> ``ring+p2p@dask``."""
    if method is None:
        return alg
    spec, at, transport = alg.partition("@")
    return f"{spec}+{method}{at}{transport}"


def split_method(alg: str) -> tuple[str, str | None]:
    spec, at, transport = alg.partition("@")
    name, plus, method = spec.rpartition("+")
    return (f"{name}{at}{transport}", method) if plus else (alg, None)


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
    ap.add_argument("--method", help="comma-separated methods (tasks, p2p, auto) to run every row with, "
                    "interleaved, e.g. tasks,p2p; default: none given, each call's default (dask config "
                    "flowreduce.method), as before")
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
    methods = args.method.split(",") if args.method else [None]
    configs = [(with_method(a, m), c) for m in methods for a, c in configs]
    rows = []
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as client, methods_by_suffix() as ran:
        workers = ranked_workers(client)
        if args.order == "interleaved":
            workers = interleaved(workers, host_of)
        hosts = len({host_of(w) for w in workers})
        print(f"# {len(workers)} workers on {hosts} hosts ({args.order} order), links {args.rate} "
              f"({link / 1e6:.2f} MB/s each way), {args.dtype}, method {args.method or 'default'}, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        print(bench.HEADER[:118] + "  pred ms  cl-cores mach%  link% method   ran", flush=True)
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
            load = os.getloadavg()
            for r in got:
                r.update(cluster_cores=cores, machine_cpu_percent=machine, link_fraction=r["busbw"] / link,
                         hosts=hosts, order=args.order, rate=args.rate, loadavg=load)
                pred = f"{r['predicted'] * 1e3:8.0f}" if r.get("predicted") else "       -"
                word = r["algorithm"]
                r["algorithm"], r["method"] = split_method(word)
                r["ran"] = sorted(map(str, ran.get(word, set())))
                print(bench.format_row(r)[:118] + f" {pred} {cores:9.2f} {machine:5.0f} "
                      f"{100 * r['link_fraction']:5.0f} {r['method'] or '-':>6} {','.join(r['ran']) or '-':>5}  "
                      f"{r['plan']}", flush=True)
            print(f"# load average after {n:g}: {' '.join(f'{x:.2f}' for x in load)}", flush=True)
            rows += got
            with open(args.json, "w") as f:  # after every size: a later failure keeps what was measured
                json.dump({"rate": args.rate, "link_bytes_per_s": link, "workers": len(workers), "hosts": hosts,
                           "order": args.order, "dtype": args.dtype, "cost_model": args.cost_model,
                           "methods": methods,
                           "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
