"""All-reduce latency inside an SPMD job, side by side with torch gloo and Open MPI, in one run.

    python benchmarks/warm_memory.py --gib 8      # once after boot: first writes to a page are slow here
    python benchmarks/spmd_latency.py --sizes 1e3,1e5,1e6 --repeat 1000 --big 1e7 --big-repeat 50 \\
        --out benchmarks/results/spmd_latency-$(date -u +%F).txt

Four ranks on one host, float64 sum; every system measured the same way
(benchmarks/peers/_common.py): rank ``r`` fills its vector with ``r + 1``;
each repetition is a barrier, then the wall time of one all-reduce on each
rank, and the repetition's time is the maximum over the ranks; the table
gives the median over all repetitions and checks every result.

* ``flowreduce``: ``flowreduce.spmd`` on a LocalCluster of 4 single-threaded
  worker processes, one rank each, ``comm.allreduce(x)`` (shared memory:
  one step below 128 KiB, ``SPLIT_BYTES``, else reduce-scatter + all-gather); the per-rank
  times are kept in the job and maxed at its end (no collective between
  repetitions but the barrier).
* ``flowreduce-dask`` (optional, ``--systems``): the same with every rank alone
  (``flowreduce.spmd.transport: dask``), each collective a plan over Dask's
  comm between the worker processes: the route between hosts, on one host.
* ``gloo``: ``benchmarks/peers/gloo_allreduce.py`` (torch.distributed, 4 processes).
* ``mpi``: ``mpirun -np 4 benchmarks/peers/mpi_allreduce.py`` (Open MPI's shared-memory transport).

Systems alternate over ``--rounds`` rounds (order reversed every other round),
each round running ``repeat / rounds`` repetitions of every size, so that load
from elsewhere on the machine falls on all of them alike.

Expected growth: flat (latency-bound) to ~1e4 elements, then linear in bytes;
at 1e3 the floor is a synchronisation through shared memory between
processes (tens of microseconds), not Python.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
#: flowreduce-dask and flowreduce-worker (the dask config flowreduce.spmd.transport) may be added: the
#: route between hosts, measured on one host
SYSTEMS = ("flowreduce", "gloo", "mpi")


def parse_sizes(text: str) -> list[int]:
    return [int(float(t)) for t in text.split(",") if t.strip()]


# -- flowreduce ------------------------------------------------------------------------------------------------
def _rank(comm, sizes, repeat, warmup):
    import time as _time

    import numpy as _np

    out = {}
    for n in sizes:
        x = _np.full(n, comm.rank + 1, dtype=_np.float64)
        for _ in range(warmup):
            comm.allreduce(x)
        times, ok = _np.empty(repeat), True
        for i in range(repeat):
            comm.barrier()
            t0 = _time.perf_counter()
            y = comm.allreduce(x)
            times[i] = _time.perf_counter() - t0
            if i % 97 == 0 or i == repeat - 1:
                ok = ok and bool(_np.all(y == comm.size * (comm.size + 1) // 2))
        worst = _np.max(_np.stack(comm.allgather(times)), axis=0)
        out[n] = (worst.tolist(), bool(_np.all(comm.allgather(_np.array([ok])))))
    return out


def run_flowreduce(sizes: list[int], repeat: int, warmup: int,
                   transport: str = "auto") -> dict[int, tuple[list[float], bool]]:
    import dask
    from distributed import Client, LocalCluster

    import flowreduce

    with dask.config.set({"flowreduce.spmd.transport": transport}), \
            LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=":0",
                         # a rank's RSS counts the peers' shared pages it reads: at 1e8 (4.7 GB) the nanny's
                         # default limit (a quarter of the machine) would restart it mid-job
                         memory_limit=0) as cluster, \
            Client(cluster) as client:
        futures = flowreduce.spmd(client, _rank, ranks=4, sizes=sizes, repeat=repeat, warmup=warmup)
        return client.gather(futures)[0]


# -- peers --------------------------------------------------------------------------------------------------------
def run_peer(system: str, sizes: list[int], repeat: int, warmup: int) -> dict[int, tuple[list[float], bool]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{system}.json")
        common = ["--sizes", ",".join(map(str, sizes)), "--repeat", str(repeat), "--warmup", str(warmup),
                  "--json", out]
        if system == "gloo":
            cmd = [sys.executable, str(PEERS / "gloo_allreduce.py"), "--ranks", "4", *common]
        else:
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable,
                   str(PEERS / "mpi_allreduce.py"), *common]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = json.loads(Path(out).read_text())
    return {row["size"]: (row["times"], row["correct"]) for row in rows}


def available(system: str) -> str | None:
    """Why ``system`` cannot run here, or None."""
    if system == "gloo":
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch is not installed (pip install torch==2.13.0)"
    if system == "mpi":
        if shutil.which("mpirun") is None:
            return "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            return "mpi4py is not installed (pip install mpi4py)"
    return None


def measure(systems: list[str], sizes: list[int], repeat: int, warmup: int, rounds: int) -> dict:
    times: dict[str, dict[int, list[float]]] = {s: {n: [] for n in sizes} for s in systems}
    correct: dict[str, dict[int, bool]] = {s: {n: True for n in sizes} for s in systems}
    per_round = max(1, -(-repeat // rounds))
    for r in range(rounds):
        order = systems if r % 2 == 0 else systems[::-1]
        for system in order:
            if system.startswith("flowreduce"):  # flowreduce-dask: every rank alone, all over Dask's comm
                got = run_flowreduce(sizes, per_round, warmup, system.partition("-")[2] or "auto")
            else:
                got = run_peer(system, sizes, per_round, warmup)
            for n in sizes:
                times[system][n].extend(got[n][0])
                correct[system][n] = correct[system][n] and got[n][1]
            print(f"# round {r + 1}/{rounds} {system} done {time.strftime('%H:%M:%S')}", file=sys.stderr, flush=True)
    return {"times": times, "correct": correct}


def table(result: dict, systems: list[str], sizes: list[int]) -> list[str]:
    head = f"{'size':>10} {'bytes':>11} " + " ".join(f"{s + ' ms':>14}" for s in systems)
    if "mpi" in systems:
        head += " " + " ".join(f"{s + '/mpi':>15}" for s in systems if s != "mpi")
    lines = [head]
    for n in sizes:
        med = {s: statistics.median(result["times"][s][n]) for s in systems}
        line = f"{n:>10d} {n * 8:>11d} " + " ".join(
            f"{med[s] * 1e3:>11.3f}{'' if result['correct'][s][n] else ' !!':>3}" for s in systems)
        if "mpi" in systems:
            line += " " + " ".join(f"{med[s] / med['mpi']:>14.2f}x" for s in systems if s != "mpi")
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1e3,1e5,1e6"))
    p.add_argument("--repeat", type=int, default=1000, help="timed repetitions per size (all rounds together)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--big", type=parse_sizes, default=[], help="big sizes, timed --big-repeat times (e.g. 1e7)")
    p.add_argument("--big-repeat", type=int, default=50)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--out", default=None, help="also write the table here")
    args = p.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    skipped = {s: why for s in systems if (why := available(s))}
    systems = [s for s in systems if s not in skipped]
    lines = [f"$ python benchmarks/spmd_latency.py {' '.join(argv if argv is not None else sys.argv[1:])}",
             f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores; 4 ranks on one host, "
             "float64 sum; median of the per-repetition maximum over ranks"]
    lines += [f"# {s} skipped: {why}" for s, why in skipped.items()]
    for sizes, repeat in ((args.sizes, args.repeat), (args.big, args.big_repeat)):
        if not sizes:
            continue
        res = measure(systems, sizes, repeat, args.warmup if repeat >= 100 else 2, args.rounds)
        lines.append(f"# {repeat} timed repetitions per size and system, {args.rounds} rounds")
        lines += table(res, systems, sizes)
    lines.append(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
