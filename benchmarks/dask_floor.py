"""What Dask itself costs at small sizes: the floor under any all-reduce
written as a task graph, beside the hand-written baseline's pieces.

On a LocalCluster of ``--workers`` single-threaded processes, with one
small input per worker (made and waited for before the clock starts),
times, interleaved and in rotating order:

``submit``
    one ``client.submit`` of a task reading one local input, until done;
``graph-L`` (L = 1, 2, 3)
    a graph of L dependent levels of one task per worker, pinned like
    flowreduce's (``dask.annotate(workers=...)``), level 1 reading the
    local input, every later task reading all tasks of the level before
    (all-to-all, as a one-step recursive doubling does);
``local-L``
    the same, but every task reads only its own worker's task of the level
    before (no transfers: what a level costs without data moving);
``run`` / ``run-on-scheduler``
    a no-op ``client.run`` (one broadcast to the workers: what flowreduce
    pays to check the inputs) and ``client.run_on_scheduler``;
``replicate``
    ``client.replicate`` of one small computed key to every worker (the
    second half of the baseline);
``baseline`` / ``flowreduce``
    the bench's hand-written baseline and ``flowreduce.allreduce`` with
    ``algorithm="auto"``;
``direct-reads``
    the shortest all-reduce a task graph can be, as a lower bound (not a
    flowreduce algorithm): one task per worker that depends on its own
    input only and reads the other ranks' inputs itself, worker to worker
    (distributed's ``get_data_from_worker``, as a dependency fetch does),
    then sums. One level, no input check, in the worker's thread pool;
``direct-reads-async``
    the same task as a coroutine, run on the worker's event loop (as
    flowreduce's ``direct`` runs).

Expected: ``graph-(L+1) - graph-L`` is the price of one dependent level
(the scheduler's 5 ms batching window to a worker, the worker's 2 ms one
back, a fetch round trip, on shared cores); the baseline is about
``submit`` + ``replicate``; flowreduce's shortest plan is ``run`` +
``graph-2``.

    python benchmarks/dask_floor.py --size 1e3 --reps 25 --json floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import dask
from dask.task_spec import Task, TaskRef
from distributed import wait

import flowreduce
from flowreduce.cli.bench import make_input, run_baseline
from flowreduce.launch import cluster
from flowreduce.lower.graph import named_graph


def _first(*xs):
    return xs[0]


def _sum_with_direct_reads(own, peers):
    """Sum ``own`` and the arrays of ``peers`` ((worker, key) pairs), read
    from their workers by this task itself."""
    import asyncio

    from distributed import get_worker
    from distributed.utils import sync
    from distributed.worker import get_data_from_worker

    worker = get_worker()

    async def read(address, key):
        while True:  # "busy": the peer serves too many transfers; ask again
            reply = await get_data_from_worker(worker.rpc, [key], address, who=worker.address)
            if reply["status"] == "OK":
                return reply["data"][key]
            await asyncio.sleep(0.001)

    async def read_all():
        return await asyncio.gather(*(read(a, k) for a, k in peers))

    total = own.copy()
    for x in sync(worker.loop, read_all):
        total += x
    return total


async def _sum_with_direct_reads_async(own, peers):
    """:func:`_sum_with_direct_reads` as a coroutine: the worker runs it on
    its event loop, where the reads go (no hand-off to a thread and back)."""
    import asyncio

    from distributed import get_worker
    from distributed.worker import get_data_from_worker

    worker = get_worker()

    async def read(address, key):
        while True:
            reply = await get_data_from_worker(worker.rpc, [key], address, who=worker.address)
            if reply["status"] == "OK":
                return reply["data"][key]
            await asyncio.sleep(0.001)

    total = own.copy()
    for x in await asyncio.gather(*(read(a, k) for a, k in peers)):
        total += x
    return total


def submit_pinned(client, tasks: dict, placement: dict, token: str, keys: list):
    """Submit ``tasks`` with every key pinned to its worker, as flowreduce does."""
    with dask.annotate(workers=placement.get, allow_other_workers=False):
        return client.get(named_graph(tasks, token), keys, sync=False)


def direct_reads_graph(client, inputs, workers, reads=_sum_with_direct_reads):
    token = uuid.uuid4().hex
    tasks, placement = {}, {}
    for r, w in enumerate(workers):
        key = (f"floor-direct-{token}", r)
        peers = [(workers[s], inputs[s].key) for s in range(len(inputs)) if s != r]
        tasks[key] = Task(key, reads, TaskRef(inputs[r].key), peers)
        placement[key] = w
    return submit_pinned(client, tasks, placement, token, list(tasks))


def levels_graph(client, inputs, workers, levels: int, all_to_all: bool):
    """``levels`` dependent levels of one task per worker, pinned."""
    token = uuid.uuid4().hex
    tasks, placement = {}, {}
    previous = [TaskRef(f.key) for f in inputs]
    for level in range(levels):
        current = []
        for r, w in enumerate(workers):
            key = (f"floor-{token}", level, r)
            deps = previous if (all_to_all and level > 0) else [previous[r]]
            tasks[key] = Task(key, _first, *deps)
            placement[key] = w
            current.append(TaskRef(key))
        previous = current
    return submit_pinned(client, tasks, placement, token, [t.key for t in previous])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1e3, help="elements per input (default 1e3)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write medians and raw timings here")
    a = ap.parse_args(argv)
    n = int(a.size)
    names = ["submit", "graph-1", "graph-2", "graph-3", "local-2", "local-3", "run", "run-on-scheduler",
             "replicate", "baseline", "flowreduce", "direct-reads", "direct-reads-async"]
    times: dict[str, list[float]] = {k: [] for k in names}
    with cluster("local", workers=a.workers, memory_limit="2GiB") as client:
        workers = sorted(client.nthreads())
        for it in range(a.warmup + a.reps):
            shift = it % len(names)
            for name in names[shift:] + names[:shift]:
                inputs = [client.submit(make_input, n, r, "float64", workers=[w], pure=False)
                          for r, w in enumerate(workers)]
                wait(inputs)
                if name == "replicate":  # the key to replicate exists before the clock starts
                    one = client.submit(_first, inputs[0], workers=[workers[0]], pure=False)
                    wait(one)
                t0 = time.perf_counter()
                if name == "submit":
                    out = [client.submit(_first, inputs[0], workers=[workers[0]], pure=False)]
                elif name.startswith(("graph-", "local-")):
                    out = levels_graph(client, inputs, workers, int(name[-1]), name.startswith("graph"))
                elif name == "run":
                    out = client.run(_first, 0)
                elif name == "run-on-scheduler":
                    out = client.run_on_scheduler(_first, 0)
                elif name == "replicate":
                    client.replicate([one], n=len(workers))
                    out = None
                elif name == "baseline":
                    out = run_baseline(client, inputs, workers)
                elif name == "flowreduce":
                    out = flowreduce.allreduce(client, inputs)
                elif name == "direct-reads":
                    out = direct_reads_graph(client, inputs, workers)
                else:
                    out = direct_reads_graph(client, inputs, workers, _sum_with_direct_reads_async)
                if isinstance(out, list):
                    wait(out)
                elapsed = time.perf_counter() - t0
                if it >= a.warmup:
                    times[name].append(elapsed)
                del out, inputs
                one = None
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"# Dask's floor at {n} float64 elements, {a.workers} workers, median of {a.reps} interleaved runs "
          f"(load average {os.getloadavg()[0]:.2f})")
    for k in names:
        print(f"{k:>18} {medians[k] * 1e3:8.2f} ms")
    level = medians["graph-3"] - medians["graph-2"]
    print(f"# one dependent all-to-all level: {level * 1e3:.2f} ms (graph-3 - graph-2), "
          f"{(medians['graph-2'] - medians['graph-1']) * 1e3:.2f} ms (graph-2 - graph-1); "
          f"a local level {(medians['local-3'] - medians['local-2']) * 1e3:.2f} ms")
    result = {"size": n, "workers": a.workers, "reps": a.reps, "median": medians, "times": times,
              "versions": {"dask": dask.__version__, "flowreduce": flowreduce.__version__}}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
