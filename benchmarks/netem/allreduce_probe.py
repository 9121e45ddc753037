"""One traced flowreduce all-reduce across the emulated hosts; prints JSON.

Run inside the head namespace (``EmulatedCluster.run`` or ``cluster.py -- ...``)
with ``DASK_SCHEDULER_ADDRESS`` set. One rank per worker, integer inputs,
``--algorithm`` (default hierarchical: its groups come from the workers'
addresses, i.e. the emulated hosts). Reports whether every rank got the
numpy sum, the plan, the bytes each worker pair moved, measured (from
the trace) and planned, and the bytes every host's shaped link sent during
the all-reduce (the tbf qdisc's own counter, read with ``tc -s`` before and
after, so between the inputs' scatter and the results' check).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys


def link_sent_bytes(hosts: int) -> list[int]:
    """Bytes each host's tbf qdisc (host -> switch) has sent so far."""
    out = []
    for i in range(hosts):
        text = subprocess.run(["tc", "-s", "-n", f"fr-h{i}", "qdisc", "show", "dev", f"fr-eth{i}"],
                              capture_output=True, text=True, check=True).stdout
        out.append(int(re.search(r"Sent (\d+) bytes", text).group(1)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithm", default="hierarchical")
    ap.add_argument("--size", type=float, default=1e5)
    args = ap.parse_args(argv)

    import numpy as np
    from distributed import Client, wait

    import flowreduce
    from flowreduce.grouping import host_of
    from flowreduce.launch import ranked_workers
    from flowreduce.tracing import summarize

    n = int(args.size)
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"]) as client:
        workers = ranked_workers(client)
        arrays = [np.arange(n, dtype=np.int64) * (r + 1) for r in range(len(workers))]
        inputs = [client.scatter(a, workers=[w], hash=False) for a, w in zip(arrays, workers)]
        wait(inputs)
        hosts = len({host_of(w) for w in workers})
        before = link_sent_bytes(hosts)
        with flowreduce.trace(client) as tr:
            out = flowreduce.allreduce(client, inputs, algorithm=args.algorithm)
            wait(out)
        link_sent = [b - a for a, b in zip(before, link_sent_bytes(hosts))]
        expected = np.sum(arrays, axis=0)
        ok = all(np.array_equal(f.result(), expected) for f in out)
        placed = all(client.who_has([f])[f.key] == (w,) for f, w in zip(out, workers))
        s = summarize(tr)
        info = flowreduce.describe(out)
        print(json.dumps({
            "ok": ok, "placed": placed, "workers": workers, "plan": repr(info.plan),
            "groups": info.plan.options.get("groups"), "nbytes": info.nbytes,
            "links": [{"source": a, "dest": b, "bytes": v} for (a, b), v in s.links.items()],
            "planned_links": [{"source": a, "dest": b, "bytes": v} for (a, b), v in s.planned_links.items()],
            "link_sent": link_sent,
        }))
    return 0 if ok and placed else 1


if __name__ == "__main__":
    sys.exit(main())
