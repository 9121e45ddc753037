"""Shared helpers for the peer all-reduce benchmarks (MPI, gloo).

Both ``mpi_allreduce.py`` and ``gloo_allreduce.py`` use the same command line,
the same deterministic input (rank ``r`` contributes a vector filled with
``r + 1``), the same statistics and the same nccl-tests style table / JSON rows,
so their numbers can be compared one to one (and with flowreduce's own runs).

Definitions (as in nccl-tests):

* ``time``  -- wall time of one all-reduce; per repetition, the maximum over
  ranks of each rank's elapsed time after a barrier (the collective is done
  only when the slowest rank is done).
* ``algbw`` -- ``nbytes / median_time`` (bytes per second; printed in GB/s,
  1 GB = 1e9 bytes), with ``nbytes`` the size of one rank's vector.
* ``busbw`` -- ``algbw * 2 (p - 1) / p``: the bandwidth each link would need in
  a bandwidth-optimal (ring) all-reduce, comparable across rank counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Iterable, Sequence

import numpy as np

DTYPES = ("float64", "float32", "int64", "int32")

HEADER = (
    f"{'size':>12} {'bytes':>13} {'ranks':>5} {'dtype':>8} "
    f"{'median(ms)':>11} {'min(ms)':>10} {'max(ms)':>10} "
    f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'correct':>7}"
)


def parse_sizes(text: str) -> list[int]:
    """Parse ``"1e3,1e5,4096"`` into element counts ``[1000, 100000, 4096]``."""
    sizes = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        val = float(tok)
        n = int(val)
        if n != val or n <= 0:
            raise argparse.ArgumentTypeError(f"size must be a positive integer, got {tok!r}")
        sizes.append(n)
    if not sizes:
        raise argparse.ArgumentTypeError("no sizes given")
    return sizes


def make_parser(description: str, *, spawns_ranks: bool = False) -> argparse.ArgumentParser:
    """Command line shared by the peer benchmarks.

    ``spawns_ranks`` adds ``--ranks``/``--port`` for launchers that start their
    own processes (gloo); MPI takes the rank count from ``mpirun -np``.
    """
    p = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1e3,1e5,1e7"),
                   help="comma-separated element counts per rank, e.g. 1e3,1e5,1e7,1e8")
    p.add_argument("--dtype", choices=DTYPES, default="float64")
    p.add_argument("--repeat", type=int, default=7, help="timed repetitions per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions per size")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the result rows as a JSON list to PATH")
    if spawns_ranks:
        p.add_argument("--ranks", type=int, default=4, help="number of processes")
        p.add_argument("--port", type=int, default=0,
                       help="TCP port for the rendezvous on 127.0.0.1 (0: pick a free one)")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    if args.warmup < 0:
        raise SystemExit("--warmup must be >= 0")


def fill_value(rank: int) -> int:
    """Value every element of rank ``rank``'s input holds."""
    return rank + 1


def expected_sum(ranks: int) -> int:
    """Closed-form value of every element after a SUM all-reduce."""
    return ranks * (ranks + 1) // 2


def make_input(n: int, dtype: str, rank: int) -> np.ndarray:
    return np.full(n, fill_value(rank), dtype=dtype)


def is_correct(result: np.ndarray, ranks: int) -> bool:
    """True when every element equals the closed-form sum (exact: integer-valued)."""
    return bool(np.all(result == result.dtype.type(expected_sum(ranks))))


def make_row(system: str, size: int, dtype: str, ranks: int,
             times: Sequence[float], correct: bool) -> dict:
    """One result row (the JSON schema shared by all peers)."""
    nbytes = int(size) * np.dtype(dtype).itemsize
    times = [float(t) for t in times]
    median = statistics.median(times)
    algbw = nbytes / median if median > 0 else float("inf")
    busbw = algbw * 2 * (ranks - 1) / ranks
    return {
        "system": system,
        "size": int(size),
        "nbytes": nbytes,
        "dtype": dtype,
        "ranks": int(ranks),
        "times": times,
        "median": median,
        "min": min(times),
        "max": max(times),
        "algbw": algbw,
        "busbw": busbw,
        "correct": bool(correct),
    }


def format_row(row: dict) -> str:
    return (
        f"{row['size']:>12d} {row['nbytes']:>13d} {row['ranks']:>5d} {row['dtype']:>8} "
        f"{row['median'] * 1e3:>11.3f} {row['min'] * 1e3:>10.3f} {row['max'] * 1e3:>10.3f} "
        f"{row['algbw'] / 1e9:>11.3f} {row['busbw'] / 1e9:>11.3f} "
        f"{'yes' if row['correct'] else 'NO':>7}"
    )


def format_table(rows: Iterable[dict]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in rows])


def print_banner(system: str, ranks: int, args: argparse.Namespace, info: str = "") -> None:
    print(f"# {system} all-reduce (SUM), ranks={ranks}, dtype={args.dtype}, "
          f"repeat={args.repeat}, warmup={args.warmup}", flush=True)
    if info:
        for line in info.splitlines():
            print(f"# {line}", flush=True)
    print(HEADER, flush=True)


def write_json(path: str, rows: list[dict]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
