"""Measure one worker-to-worker transfer across the emulated network.

Run inside the head namespace (``EmulatedCluster.run`` or ``cluster.py -- ...``)
with ``DASK_SCHEDULER_ADDRESS`` set.  Creates an incompressible numpy array of
``--mbytes`` MB on a worker of host ``--src-host``, then times a worker of host
``--dst-host`` computing its checksum (pinned there, so the array has to cross
both hosts' shaped links).  Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def make_payload(nbytes: int, seed: int):
    import numpy as np

    # random bytes: incompressible, so comm compression cannot shrink them
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def checksum(a) -> int:
    import numpy as np

    return int(a.sum(dtype=np.uint64))


def _host_of(addr: str) -> str:
    return addr.split("://", 1)[-1].rsplit(":", 1)[0]


def pick_worker(workers: dict, host_index: int, exclude=()) -> str:
    want = f"10.77.0.{10 + host_index}"
    for addr in sorted(workers):
        if _host_of(addr) == want and addr not in exclude:
            return addr
    raise SystemExit(f"no worker on host {host_index} ({want}); workers: {sorted(workers)}")


def incoming_log(dask_worker):
    return [
        {"who": e["who"], "total": e["total"], "duration": e["duration"]}
        for e in dask_worker.transfer_incoming_log
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mbytes", type=float, default=100.0, help="payload size in MB (1e6 bytes)")
    ap.add_argument("--src-host", type=int, default=0)
    ap.add_argument("--dst-host", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="independent transfers (fresh array each)")
    ap.add_argument("--scheduler", default=os.environ.get("DASK_SCHEDULER_ADDRESS"))
    ap.add_argument("--timeout", type=float, default=300.0)
    ns = ap.parse_args(argv)
    if not ns.scheduler:
        ap.error("DASK_SCHEDULER_ADDRESS not set and --scheduler not given")

    from distributed import Client, wait

    nbytes = int(ns.mbytes * 1e6)
    with Client(ns.scheduler, timeout=30) as client:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        src = pick_worker(workers, ns.src_host)
        dst = pick_worker(workers, ns.dst_host, exclude=(src,))
        pin = dict(allow_other_workers=False, pure=False)

        # warm-up: open the src->dst worker connection with a tiny transfer
        w = client.submit(make_payload, 1024, 0, workers=[src], **pin)
        client.submit(checksum, w, workers=[dst], **pin).result(timeout=ns.timeout)
        del w

        runs = []
        for r in range(ns.repeat):
            seed = 1000 + r
            data = client.submit(make_payload, nbytes, seed, workers=[src], **pin)
            wait(data, timeout=ns.timeout)
            expected = client.submit(checksum, data, workers=[src], **pin).result(ns.timeout)
            n_log = len(client.run(incoming_log, workers=[dst])[dst])

            t0 = time.perf_counter()
            got = client.submit(checksum, data, workers=[dst], **pin).result(ns.timeout)
            seconds = time.perf_counter() - t0

            new = client.run(incoming_log, workers=[dst])[dst][n_log:]
            wire = [e for e in new if e["who"] == src]
            holders = sorted(client.who_has(data)[data.key])
            runs.append(
                {
                    "seconds": seconds,
                    "gbit_per_s": nbytes * 8 / seconds / 1e9,
                    "worker_transfer_seconds": sum(e["duration"] for e in wire) or None,
                    "checksum": got,
                    "expected_checksum": expected,
                    "ok": got == expected,
                    "holders_after": holders,
                }
            )
            del data

    secs = [r["seconds"] for r in runs]
    med = statistics.median(secs)
    result = {
        "src_worker": src,
        "dst_worker": dst,
        "src_host": _host_of(src),
        "dst_host": _host_of(dst),
        "bytes": nbytes,
        "seconds": med,
        "gbit_per_s": nbytes * 8 / med / 1e9,
        "ok": all(r["ok"] for r in runs),
        "repeat": ns.repeat,
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
