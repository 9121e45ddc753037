"""What a rank's own work costs the one-host all-reduce: four plain processes, no Dask.

    python benchmarks/host_group_probe.py --size 1e3 --repeat 3000
    python benchmarks/host_group_probe.py --size 1e3 --variants host,spin2+host --yield-seconds 1e-5

Each process is one rank of a host group (``flowreduce.shm.host_group``) and of a
communicator over it (``flowreduce.spmd.Communicator`` with a stand-in for the worker's
mailbox). Every repetition runs each variant in turn after a barrier; its time is the
maximum over the ranks; the table gives the 10th, 50th and 90th percentiles in
microseconds.

* ``barrier``: the host group's barrier (one step, no data).
* ``host``: ``HostGroup.allreduce`` (one step through the small slots below ``SPLIT_BYTES``).
* ``comm``: ``Communicator.allreduce``, the same step and the communicator's Python around it.
* ``spinN+host``: a busy wait of N microseconds on every rank, then ``host``.

Results and their reading: benchmarks/results/spmd_onehost-2026-11-29-probe.txt (a
microsecond of one rank's work cost the call 5-10 microseconds of wall time on a 2-core VM).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import time

import numpy as np


class _Mailbox:
    """What a communicator asks of its worker's mailbox on one host: nothing failed, a log."""

    def __init__(self) -> None:
        from flowreduce.schedule.spmd_log import Log

        self.failed: dict[str, str] = {}
        self.log = Log()

    def open(self, *args: object) -> None:
        pass

    def why(self, run: str) -> str | None:
        return None


def _rank(rank: int, directory: str, size: int, repeat: int, variants: list[str], yield_seconds: float | None,
          out: mp.Queue) -> None:
    from flowreduce.ops import resolve_op
    from flowreduce.spmd.comm import Communicator
    from flowreduce.spmd.layout import Layout

    comm = Communicator(Layout("probe", 0, ("a", "b", "c", "d"), (0, 0, 0, 0), directory=directory), rank, _Mailbox())
    host = comm._shm()
    assert host is not None
    if yield_seconds is not None:
        host.yield_seconds = yield_seconds
    x = np.full(size, rank + 1.0)
    op, acc = resolve_op("sum"), np.dtype(np.float64)

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def variant(name: str):
        if name == "barrier":
            return lambda: host.barrier("probe", None)
        if name == "comm":
            return lambda: comm.allreduce(x)
        if name == "host":
            return lambda: host.allreduce(x, op, acc, "probe", None)
        if name.startswith("spin") and name.endswith("+host"):
            us = float(name[4:-5]) * 1e-6
            return lambda: (spin(us), host.allreduce(x, op, acc, "probe", None))
        raise SystemExit(f"unknown variant {name!r}")

    calls = [variant(v) for v in variants]
    times = np.empty((len(calls), repeat))
    for _ in range(200):
        for f in calls:
            f()
    for i in range(repeat):
        for j, f in enumerate(calls):
            host.barrier("probe", None)
            t0 = time.perf_counter()
            f()
            times[j, i] = time.perf_counter() - t0
    worst = np.max(np.stack(host.allgather(times.ravel(), "probe", None)), axis=0).reshape(times.shape)
    host.barrier("probe", None)
    host.close(False)
    if rank == 0:
        out.put({v: [round(float(np.percentile(worst[j], p)) * 1e6, 1) for p in (10, 50, 90)]
                 for j, v in enumerate(variants)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=lambda s: int(float(s)), default=1000)
    p.add_argument("--repeat", type=int, default=3000)
    p.add_argument("--variants", default="barrier,host,comm,spin2+host")
    p.add_argument("--yield-seconds", type=float, default=None,
                   help="how long a waiting rank yields before it sleeps (default: the host group's)")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as directory:
        procs = [ctx.Process(target=_rank, args=(r, directory, args.size, args.repeat, variants, args.yield_seconds, out))
                 for r in range(4)]
        for proc in procs:
            proc.start()
        result = out.get()
        for proc in procs:
            proc.join()
    print(f"# size {args.size} float64, 4 ranks, {args.repeat} repetitions; load {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<14} {'p10 us':>8} {'p50 us':>8} {'p90 us':>8}")
    for v, (a, b, c) in result.items():
        print(f"{v:<14} {a:8.1f} {b:8.1f} {c:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
