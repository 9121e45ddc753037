"""Where the time of ``hierarchical`` goes with shared memory inside hosts
and with ``transport="dask"``: traced calls, alternating, per-phase seconds
summed over the ranks (medians over the calls).

Run inside the head namespace with ``DASK_SCHEDULER_ADDRESS`` set, e.g.::

    python benchmarks/netem/cluster.py --hosts 2 --workers-per-host 2 --rate 10gbit -- \\
        benchmarks/netem/hier_shm_trace.py --size 1e7 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1e7)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    import numpy as np
    from distributed import Client, wait

    import flowreduce
    from flowreduce.launch import ranked_workers
    from flowreduce.tracing import summarize

    n = int(args.size)
    out: dict[str, dict[str, list[float]]] = {"auto": {}, "dask": {}}
    plans = {}
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as client:
        workers = ranked_workers(client)
        for it in range(args.repeat + 1):
            for transport in ("auto", "dask"):
                arrays = [np.random.default_rng(r).random(n) for r in range(len(workers))]
                inputs = [client.scatter(a, workers=[w], hash=False) for a, w in zip(arrays, workers)]
                wait(inputs)
                with flowreduce.trace(client) as tr:
                    res = flowreduce.allreduce(client, inputs, algorithm="hierarchical", transport=transport)
                    wait(res)
                plans[transport] = repr(flowreduce.describe(res).plan)
                del res, inputs
                if it == 0:
                    continue  # warm-up: connections, segments
                s = summarize(tr)
                got = out[transport]
                got.setdefault("wall", []).append(s.measured)
                for phase, seconds in s.total.items():
                    got.setdefault(phase, []).append(seconds)
    table = {t: {p: statistics.median(v) for p, v in got.items()} for t, got in out.items()}
    print(f"# {len(workers)} workers, {n} float64, medians of {args.repeat} traced calls each (s; phases summed "
          "over ranks)")
    phases = sorted(set(table["auto"]) | set(table["dask"]), key=lambda p: (p != "wall", p))
    print(f"{'phase':>16} {'shm inside':>11} {'dask':>8}")
    for p in phases:
        print(f"{p:>16} {table['auto'].get(p, 0):11.3f} {table['dask'].get(p, 0):8.3f}")
    print(json.dumps({"plans": plans, "medians": table}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
