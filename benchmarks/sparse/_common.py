"""Shared by the sparse benchmarks: the cluster, interleaved timing with the
dense butterfly, bytes moved from a trace, checks on the workers, output files.

Every repetition runs every configuration once, in an order that rotates
from one repetition to the next, so the noise of a shared machine hits all
of them alike; rows report the median of the timed repetitions and the
speed-up over the dense butterfly: the median of the per-repetition ratios
(the two ran back to back in each repetition). The last
repetition of each configuration runs inside ``flowreduce.trace``: its bytes
moved (``summarize(tr).bytes_moved``, dask's sizes of every message between
workers) go into the row, with the plan's bytes (``describe(...).bytes_on_wire``).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sparse"


@dataclass
class Row:
    group: dict[str, Any]  # what the inputs are (density, pattern, k, ...)
    label: str  # the configuration (algorithm and options)
    plan: str = ""
    times: list[float] = field(default_factory=list)
    bytes_moved: int | None = None
    bytes_planned: float | None = None
    correct: bool = True

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def add_run_arguments(ap, name: str, default_size: float, quick: str) -> None:
    """The options both sparse benchmarks take: size, cluster, repetitions,
    ``--quick``, ``--render`` and the output name."""
    ap.add_argument("--size", type=float, default=default_size)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--memory-limit", default="6GiB", help="per worker (24 GiB machine / 4 workers)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help=f"1M elements, 2 runs, {quick}")
    ap.add_argument("--render", action="store_true", help="only redraw the table and plot from the JSON")
    ap.add_argument("--name", default=name, help="output files docs/sparse/<name>.*")


def parse_run_args(ap, argv, **quick) -> Any:
    """``ap.parse_args(argv)``; with ``--quick``, 1M elements, 2 runs, the
    script's own ``quick`` settings and ``-quick`` after the output name."""
    a = ap.parse_args(argv)
    if a.quick:
        a.size, a.repeat, a.name = 1 << 20, 2, a.name + "-quick"
        for k, v in quick.items():
            setattr(a, k, v)
    return a


def checksum(x) -> float:
    """Sum of all values in float64 (runs on a worker: nothing moves)."""
    if hasattr(x, "tocoo"):
        return float(np.sum(x.data, dtype=np.float64))
    return float(np.sum(x, dtype=np.float64))


def run_interleaved(client, group: dict, configs: list[tuple[str, Callable[[], list]]], expected: float, *,
                    repeat: int, warmup: int, progress: Callable[[str], None] = print) -> list[Row]:
    """Time every ``(label, call)`` ``warmup + repeat`` times, rotating the
    order; ``call()`` starts one all-reduce and returns its futures. Each
    result is checked on its worker: its sum must be ``expected``."""
    from distributed import wait

    import flowreduce
    from flowreduce.tracing import summarize

    rows = {label: Row(dict(group), label) for label, _ in configs}
    total = warmup + repeat
    for it in range(total):
        shift = it % len(configs)
        for label, call in configs[shift:] + configs[:shift]:
            row = rows[label]
            tr = flowreduce.trace(client).start() if it == total - 1 else None
            t0 = time.perf_counter()
            outs = call()
            wait(outs)
            elapsed = time.perf_counter() - t0
            info = flowreduce.describe(outs)
            if tr is not None:
                tr.stop()
                row.bytes_moved = summarize(tr, info.token).bytes_moved
            row.plan, row.bytes_planned = repr(info.plan), info.bytes_on_wire
            sums = client.gather([client.submit(checksum, o, pure=False, workers=list(client.who_has([o])[o.key]))
                                  for o in outs])
            row.correct &= all(np.isclose(s, expected, rtol=1e-3, atol=1e-3 * (abs(expected) + 1)) for s in sums)
            if it >= warmup:
                row.times.append(elapsed)
            del outs
        progress(f"  {group} repetition {it + 1}/{total}")
    return list(rows.values())


def machine() -> dict:
    import dask
    import distributed
    import scipy

    return {"python": platform.python_version(), "numpy": np.__version__, "scipy": scipy.__version__,
            "dask": dask.__version__, "distributed": distributed.__version__, "cpus": _cpus(),
            "when": time.strftime("%Y-%m-%d %H:%M")}


def _cpus() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def write_json(name: str, meta: dict, rows: list[Row]) -> Path:
    DOCS.mkdir(parents=True, exist_ok=True)
    path = DOCS / f"{name}.json"
    out = [{**asdict(r), "median": r.median} for r in rows]
    path.write_text(json.dumps({"meta": meta, "rows": out}, indent=1))
    return path


def speedups(rows: list[Row], baseline: str) -> dict[int, float]:
    """id(row) -> the median over repetitions of baseline time / row time,
    each ratio taken within one repetition (the two ran back to back, so a
    shared machine's drift cancels; more robust than a ratio of medians)."""
    base = {json.dumps(r.group, sort_keys=True): r.times for r in rows if r.label == baseline}
    return {id(r): statistics.median(b / t for b, t in zip(base[json.dumps(r.group, sort_keys=True)], r.times))
            for r in rows}


def read_json(name: str) -> tuple[dict, list[Row]]:
    """What :func:`write_json` wrote (to re-render tables and plots)."""
    doc = json.loads((DOCS / f"{name}.json").read_text())
    fields = set(Row.__dataclass_fields__)
    return doc["meta"], [Row(**{k: v for k, v in r.items() if k in fields}) for r in doc["rows"]]


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def report(name: str, meta: dict, rows: list[Row], render_table: Callable, plot: Callable) -> int:
    """Write ``docs/sparse/<name>.md`` (the table, also printed) and ``.png``;
    exit status 1 if any row was wrong."""
    table = render_table(rows, meta)
    (DOCS / f"{name}.md").write_text(table)
    print(table)
    plot(rows, DOCS / f"{name}.png", meta)
    return 0 if all(r.correct for r in rows) else 1
