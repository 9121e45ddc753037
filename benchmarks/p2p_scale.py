"""method="tasks" vs "p2p" vs the hand-written baseline as ranks grow (issue #25's scale targets).

1e3 float64 per rank on a 4-worker LocalCluster (1 thread each), ranks 4, 64 and 256 (so ranks share
workers), butterfly / ring / tree / reduce-broadcast; each configuration run ``--warmup`` times then
``--repeat`` times, in a rotating order, with fresh inputs made untimed and checked to sit on their
own worker (as ``flowreduce bench`` does: :mod:`flowreduce.cli.bench`); every result checked.
Times are the call plus waiting for every rank's result; tasks are those of every graph the call sent
to the scheduler (counted there, by a scheduler plugin), and each call's ``describe().method`` is checked. A configuration whose warm-up run takes
longer than ``--cap`` seconds is reported from that one run; task graphs of more than ``--max-tasks``
tasks (ring at 256 ranks: 196,096) are not run.

Expected: tasks grows with the plan's tasks (ranks x steps x chunks); p2p with its messages and the
engine's per-node work, its graph a hand-in per worker, a barrier and an output per rank. Targets: 64 ranks < 100 ms, 256 < 300 ms.

    python benchmarks/p2p_scale.py [--ranks 4 64 256] [--repeat 5] [--algorithms ...] [--methods p2p] \
        > benchmarks/results/p2p-scale-DATE.txt
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import numpy as np
from distributed import Client, LocalCluster, SchedulerPlugin, wait

import flowreduce
from flowreduce.cli.bench import check, check_placed, check_workers, make_input, run_baseline

ALGORITHMS = ("butterfly", "ring", "tree", "reduce-broadcast")
METHODS = ("tasks", "p2p")


class GraphSizes(SchedulerPlugin):
    """The new tasks of every graph the scheduler receives (the tasks column: what a call really sent; the
    inputs it depends on, in memory already, are not counted)."""

    name = "p2p-scale-graph-sizes"

    def __init__(self):
        self.sizes = []

    def update_graph(self, scheduler, *, tasks, **kwargs):
        self.sizes.append(sum(scheduler.tasks[k].state != "memory" for k in tasks))


def graph_sizes(dask_scheduler=None):
    """The graph sizes received since the last ask."""
    plugin = dask_scheduler.plugins[GraphSizes.name]
    sizes, plugin.sizes = plugin.sizes, []
    return sizes


def one_run(client, workers, ranks, n, what):
    inputs = [client.submit(make_input, n, r, "float64", workers=[workers[r % len(workers)]], pure=False)
              for r in range(ranks)]
    wait(inputs)
    check_placed(client, inputs, workers)
    client.run_on_scheduler(graph_sizes)
    t0 = time.perf_counter()
    if what == "baseline":
        outs = run_baseline(client, inputs, workers)
    else:
        method, algorithm = what
        outs = flowreduce.allreduce(client, inputs, algorithm=algorithm, method=method, chunks=1)
        if flowreduce.describe(outs).method != method:
            raise RuntimeError(f"{what} ran as method {flowreduce.describe(outs).method!r}")
    wait(outs)
    elapsed = time.perf_counter() - t0
    tasks = sum(client.run_on_scheduler(graph_sizes))  # every graph the call sent
    ok = all(client.gather([client.submit(check, o, n, ranks, "float64", "sum", pure=False, workers=[w])
                            for o in outs for w in client.who_has([o])[o.key]]))
    check_workers(client, workers)
    return elapsed, ok, tasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 64, 256])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cap", type=float, default=20.0, help="seconds: a slower warm-up is the only run")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), help="dense algorithms to run")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--max-tasks", type=int, default=20000, help="method='tasks' graphs larger than this are not run")
    args = ap.parse_args()
    print(f"# p2p_scale {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores, n={args.n} float64, "
          f"4 workers x 1 thread, medians of {args.repeat} after {args.warmup} warm-up", flush=True)
    print(f"{'ranks':>5} {'method':>8} {'algorithm':>17} {'tasks':>7} {'median ms':>10} {'min ms':>9} "
          f"{'max ms':>9} {'runs':>4} ok", flush=True)
    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        workers = sorted(client.nthreads())
        client.register_plugin(GraphSizes())
        for ranks in args.ranks:
            configs = ["baseline"] + [(m, a) for a in args.algorithms for m in args.methods]
            for a in args.algorithms if "tasks" in args.methods else ():  # graphs too big to submit are not run
                tasks = flowreduce.plan(a, ranks).cost().tasks
                if tasks > args.max_tasks:
                    configs.remove(("tasks", a))
                    print(f"{ranks:>5} {'tasks':>8} {a:>17} {tasks:>7} not run (over --max-tasks)", flush=True)
            times: dict = {c: [] for c in configs}
            info: dict = {}
            capped = set()
            for it in range(args.warmup + args.repeat):
                shift = it % len(configs)
                for c in configs[shift:] + configs[:shift]:
                    if c in capped:
                        continue
                    elapsed, ok, tasks = one_run(client, workers, ranks, args.n, c)
                    info[c] = (tasks, info.get(c, (0, True))[1] and ok)
                    if it < args.warmup:
                        if elapsed > args.cap:
                            capped.add(c)
                            times[c].append(elapsed)
                        continue
                    times[c].append(elapsed)
            for c in configs:
                method, algorithm = ("baseline", "submit+replicate") if c == "baseline" else c
                ts = times[c]
                tasks, ok = info[c]
                print(f"{ranks:>5} {method:>8} {algorithm:>17} {tasks:>7} {statistics.median(ts)*1e3:>10.1f} "
                      f"{min(ts)*1e3:>9.1f} {max(ts)*1e3:>9.1f} {len(ts):>4} {'yes' if ok else 'NO'}", flush=True)
    print(f"# load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
