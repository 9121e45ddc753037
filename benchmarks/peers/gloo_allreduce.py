"""torch.distributed (gloo) all-reduce peer benchmark, CPU only.

Run (after ``bash benchmarks/peers/install.sh``)::

    python benchmarks/peers/gloo_allreduce.py --ranks 4 \\
        --sizes 1e3,1e5,1e7,1e8 --dtype float64 --repeat 7 --warmup 2 \\
        --json /tmp/peers/gloo.json

Spawns ``--ranks`` processes with ``torch.multiprocessing``; they meet through
``init_method="tcp://127.0.0.1:PORT"`` (``--port``, default: a free port) with
``backend="gloo"`` on the loopback interface, each with
``torch.set_num_threads(1)``. Every rank ``r`` fills a numpy vector of
``size`` elements with ``r + 1``, wraps it with ``torch.from_numpy`` and calls
``dist.all_reduce(tensor)`` (SUM, in place; the input is refilled before each
repetition, outside the timed region). Every element of the result must equal
``p (p + 1) / 2``. Each repetition is timed as: ``dist.barrier()``, then
``time.perf_counter()`` around the ``all_reduce``; the repetition's time is the
maximum over ranks. Rank 0 prints the same nccl-tests style table and JSON
rows as ``mpi_allreduce.py`` (see ``_common.py`` and the README).

Expected growth: gloo moves data over TCP sockets even on one host, so small
vectors (1e3 elements) cost a few hundred microseconds or more of latency
(more with 4 ranks on 2 cores), flat up to ~1e5 elements. Large vectors are
bandwidth bound: time grows about linearly with bytes (1e7 -> 1e8 about 10x)
and busbw levels off at loopback-TCP speed, usually below MPI's shared-memory
transport (around 1 GB/s or less here).

Multi-host launch (the caller starts every rank, e.g. each in its own network
namespace: ``benchmarks/netem/spmd_vs_gloo.py``)::

    GLOO_SOCKET_IFNAME=fr-eth1 python benchmarks/peers/gloo_allreduce.py \\
        --rank 1 --world-size 4 --init-method tcp://10.77.0.10:29500 --sizes 1e3,1e6

With ``--rank`` this process is that one rank (nothing is spawned; ``--ranks``
and ``--port`` are ignored), meeting the others at ``--init-method`` (rank 0
listens there); gloo's interface is ``GLOO_SOCKET_IFNAME`` from the
environment (unset: gloo picks one from the hostname). Rank 0 prints the
table and writes ``--json``; timing and checks are as above.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.dont_write_bytecode = True  # keep __pycache__ out of the repo
import _common as C  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_size(n: int, dtype: str, repeat: int, warmup: int) -> tuple[list[float], bool]:
    rank, ranks = dist.get_rank(), dist.get_world_size()
    value = C.fill_value(rank)
    buf = C.make_input(n, dtype, rank)
    tensor = torch.from_numpy(buf)  # shares memory with buf

    for _ in range(warmup):
        tensor.fill_(value)
        dist.all_reduce(tensor)

    times, ok = [], True
    tmax = torch.zeros(1, dtype=torch.float64)
    for _ in range(repeat):
        tensor.fill_(value)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        dt = time.perf_counter() - t0
        tmax.fill_(dt)
        dist.all_reduce(tmax, op=dist.ReduceOp.MAX)
        times.append(float(tmax.item()))
        ok = C.is_correct(buf, ranks) and ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    del tensor, buf
    return times, bool(flag.item())


def worker(rank: int, ranks: int, port: int, args, init_method: str | None = None) -> None:
    torch.set_num_threads(1)
    init_method = init_method or f"tcp://127.0.0.1:{port}"
    dist.init_process_group(
        backend="gloo",
        init_method=init_method,
        world_size=ranks,
        rank=rank,
    )
    all_ok = True
    try:
        if rank == 0:
            C.print_banner("gloo", ranks, args,
                           info=f"torch {torch.__version__}, backend gloo, {init_method}, "
                                f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME', '')}")
        rows = []
        for n in args.sizes:
            times, ok = bench_size(n, args.dtype, args.repeat, args.warmup)
            all_ok = all_ok and ok
            if rank == 0:
                row = C.make_row("gloo", n, args.dtype, ranks, times, ok)
                rows.append(row)
                print(C.format_row(row), flush=True)
        if rank == 0 and args.json:
            C.write_json(args.json, rows)
            print(f"# wrote {args.json}", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if not all_ok:
        raise SystemExit(1)  # mp.spawn reports it as a failed process


def main(argv: list[str] | None = None) -> int:
    parser = C.make_parser(__doc__.split("\n\n")[0], spawns_ranks=True)
    parser.add_argument("--rank", type=int, default=None,
                        help="be this one rank (multi-host launch; the caller starts every rank)")
    parser.add_argument("--world-size", type=int, default=None, help="ranks in all (with --rank)")
    parser.add_argument("--init-method", default=None,
                        help="rendezvous URL (with --rank), e.g. tcp://10.77.0.10:29500")
    args = parser.parse_args(argv)
    C.check_args(args)
    if args.rank is not None:
        if args.world_size is None or args.init_method is None:
            raise SystemExit("--rank needs --world-size and --init-method")
        if not 0 <= args.rank < args.world_size:
            raise SystemExit(f"--rank must be in 0..{args.world_size - 1}")
        try:
            worker(args.rank, args.world_size, 0, args, init_method=args.init_method)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    if args.ranks < 1:
        raise SystemExit("--ranks must be >= 1")
    # Keep gloo on the loopback interface (no dependence on hostname lookup).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = args.port or free_port()
    try:
        mp.spawn(worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)
    except mp.ProcessExitedException as e:
        print(f"# gloo benchmark failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
