"""MPI all-reduce peer benchmark (Open MPI + mpi4py).

Run (after ``bash benchmarks/peers/install.sh``)::

    mpirun --allow-run-as-root --oversubscribe -np 4 \\
        python benchmarks/peers/mpi_allreduce.py \\
        --sizes 1e3,1e5,1e7,1e8 --dtype float64 --repeat 7 --warmup 2 \\
        --json /tmp/peers/mpi.json

Every rank ``r`` fills a numpy vector of ``size`` elements with ``r + 1`` and
calls ``comm.Allreduce(sendbuf, recvbuf, op=MPI.SUM)``; every element of the
result must equal ``p (p + 1) / 2`` (checked after every timed repetition,
outside the timed region). Each repetition is timed as: ``Barrier``, then
``MPI.Wtime()`` around the ``Allreduce``; the repetition's time is the maximum
over ranks. Rank 0 prints an nccl-tests style table (see ``_common.py`` and
the README for the columns) and writes the JSON rows.

Expected growth: small vectors (1e3 elements = 8 KB) are latency bound --
tens of microseconds over Open MPI's shared-memory transport on an idle
machine, more when ranks outnumber cores (4 ranks on 2 cores here), so time is
nearly flat from 1e3 to ~1e5. Large vectors are bandwidth bound: time grows
about linearly with bytes (1e7 -> 1e8 about 10x) and busbw levels off at a
fraction of memory bandwidth (about 1-2 GB/s busbw on this shared 2-core
machine; more on an idle multi-core node).
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

sys.dont_write_bytecode = True  # keep __pycache__ out of the repo
import _common as C  # noqa: E402


def bench_size(comm: MPI.Comm, n: int, dtype: str, repeat: int, warmup: int) -> tuple[list[float], bool]:
    rank, ranks = comm.Get_rank(), comm.Get_size()
    send = C.make_input(n, dtype, rank)
    recv = np.zeros(n, dtype=dtype)  # zero-filled so pages are touched and a no-op is caught

    for _ in range(warmup):
        comm.Allreduce(send, recv, op=MPI.SUM)

    times, ok = [], True
    for _ in range(repeat):
        recv.fill(0)
        comm.Barrier()
        t0 = MPI.Wtime()
        comm.Allreduce(send, recv, op=MPI.SUM)
        dt = MPI.Wtime() - t0
        times.append(comm.allreduce(dt, op=MPI.MAX))
        ok = C.is_correct(recv, ranks) and ok
    ok = bool(comm.allreduce(ok, op=MPI.LAND))
    del send, recv
    return times, ok


def main(argv: list[str] | None = None) -> int:
    args = C.make_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    C.check_args(args)
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()

    if rank == 0:
        lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
        import mpi4py
        C.print_banner("mpi", ranks, args, info=f"{lib}, mpi4py {mpi4py.__version__}")

    rows = []
    for n in args.sizes:
        times, ok = bench_size(comm, n, args.dtype, args.repeat, args.warmup)
        if rank == 0:
            row = C.make_row("mpi", n, args.dtype, ranks, times, ok)
            rows.append(row)
            print(C.format_row(row), flush=True)

    if rank == 0 and args.json:
        C.write_json(args.json, rows)
        print(f"# wrote {args.json}", flush=True)
    all_ok = all(r["correct"] for r in rows) if rank == 0 else True
    return 0 if comm.bcast(all_ok, root=0) else 1


if __name__ == "__main__":
    sys.exit(main())
