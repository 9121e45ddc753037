"""Draw a trace: one horizontal lane per rank, time to the right.

Each lane has four rows, top to bottom: computation (split, fusion, reduce,
copy, user-compute), waiting (wait-for-input, other), transfers received, and
(de)serialisation. A thin line joins the sending rank's lane (at the
transfer's start) to the receiving rank's transfer row (at its end).
Workers that hold no rank get a lane of their own, below the ranks. Each
rank of an SPMD job gets a lane too (``job <token> rank r``): its task on
the computation row, its collectives (``allreduce``, ``broadcast``,
``allgather``, ``barrier``) on the transfers row.

Needs matplotlib (``pip install flowreduce[viz]``); uses ``Figure``
directly, never pyplot's global state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flowreduce.phases import TASK_PHASES
from flowreduce.tracing.events import PHASES, Event

COLORS: dict[str, str] = {
    "wait-for-input": "#bdbdbd",
    "split": "#9ecae1",
    "fusion": "#e7ba52",
    "serialise": "#fdae6b",
    "transfer": "#e6550d",
    "deserialise": "#fd8d3c",
    "shm-copy": "#d6616b",
    "reduce": "#31a354",
    "copy": "#756bb1",
    "user-compute": "#636363",
    "other": "#f0f0f0",
    # SPMD collectives (flowreduce.spmd)
    "allreduce": "#3182bd",
    "broadcast": "#6baed6",
    "allgather": "#9e9ac8",
    "barrier": "#cedb9c",
}
ROW: dict[str, int] = {"split": 0, "fusion": 0, "reduce": 0, "copy": 0, "user-compute": 0, "wait-for-input": 1, "other": 1,
                       "transfer": 2, "shm-copy": 2, "serialise": 3, "deserialise": 3,
                       "allreduce": 2, "broadcast": 2, "allgather": 2, "barrier": 2}
ROW_HEIGHT = 0.2


@dataclass(frozen=True)
class Rect:
    lane: int
    row: int
    phase: str
    start: float  # ms after the drawing's origin
    stop: float
    key: str = ""


@dataclass(frozen=True)
class Line:
    src_lane: int
    dst_lane: int
    x0: float
    x1: float
    nbytes: int = 0


@dataclass
class Drawing:
    """What was drawn, for checking without looking at pixels."""

    lanes: list[str]
    rects: list[Rect] = field(default_factory=list)
    lines: list[Line] = field(default_factory=list)
    legend: list[str] = field(default_factory=list)
    origin: float = 0.0  # absolute time of x = 0
    paths: list[str] = field(default_factory=list)


def layout(trace: Any, token: str | None = None) -> Drawing:
    """The drawing's content (lanes, rectangles, lines) without drawing it."""
    events: list[Event] = [e for e in trace.events if token is None or e.token in (token, "")]
    if token is not None:
        mine = [e for e in events if e.token == token]
        if mine:
            lo, hi = min(e.start for e in mine), max(e.stop for e in mine)
            events = [e for e in events if e.token == token or (e.stop > lo and e.start < hi)]
    lane_rank: dict[str, int] = {}
    spmd: dict[tuple[str, int | None], int] = {}  # an SPMD job's rank: a lane of its own, after the call's ranks
    for e in events:
        if e.job:
            spmd.setdefault((e.job.partition("/")[0], e.rank), 0)
        elif e.rank is not None and e.phase in TASK_PHASES:
            lane_rank[e.worker] = min(lane_rank.get(e.worker, e.rank), e.rank)
    ranks = sorted(set(lane_rank.values()) | {e.rank for e in events if e.rank is not None and not e.job})
    lanes = [f"rank {r}" for r in ranks]
    index = {f"rank {r}": i for i, r in enumerate(ranks)}
    for job, r in sorted(spmd, key=lambda jr: (jr[0], jr[1] if jr[1] is not None else -1)):
        spmd[job, r] = len(lanes)
        lanes.append(f"job {job[:8]} rank {r}")
    for e in events:
        if e.worker and e.worker not in lane_rank and e.rank is None and not e.job and e.worker not in index:
            index[e.worker] = len(lanes)
            lanes.append(e.worker)

    def lane_of(e: Event, worker: str | None = None) -> int | None:
        if e.job and worker is None:
            return spmd[e.job.partition("/")[0], e.rank]
        w = worker or e.worker
        if w in lane_rank:
            return index[f"rank {lane_rank[w]}"]
        if worker is None and e.rank is not None:
            return index[f"rank {e.rank}"]
        return index.get(w)

    x0 = min((e.start for e in events), default=trace.origin)
    d = Drawing(lanes=lanes, legend=list(PHASES), origin=x0)
    for e in events:
        lane = lane_of(e)
        if lane is None:
            continue
        d.rects.append(Rect(lane, ROW[e.phase], e.phase, (e.start - x0) * 1e3, (e.stop - x0) * 1e3, e.key))
        if e.phase == "transfer" and e.source:
            src = lane_of(e, e.source)
            if src is not None:
                d.lines.append(Line(src, lane, (e.start - x0) * 1e3, (e.stop - x0) * 1e3, e.nbytes))
    return d


def plot_timeline(
    trace: Any,
    path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    token: str | None = None,
    title: str | None = None,
    width: float = 12.0,
) -> Drawing:
    """Draw ``trace`` (or only call ``token`` and what overlapped it) and
    save it to ``path`` (PNG, SVG, PDF by suffix; a list saves several).

    Returns
    -------
    Drawing
        The lanes, rectangles (ms after ``origin``), transfer lines and
        legend entries that were drawn.
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("plot_timeline needs matplotlib: pip install flowreduce[viz]") from e
    d = layout(trace, token)
    n = max(1, len(d.lanes))
    fig = Figure(figsize=(width, 1.0 + 0.9 * n))
    ax = fig.add_subplot()

    def y(lane: int, row: int) -> float:
        return lane + row * ROW_HEIGHT

    for r in d.rects:
        ax.broken_barh([(r.start, max(r.stop - r.start, 1e-3))], (y(r.lane, r.row), ROW_HEIGHT * 0.9),
                       facecolors=COLORS[r.phase], edgecolors="black", linewidth=0.2)
    for ln in d.lines:
        ax.plot([ln.x0, ln.x1], [y(ln.src_lane, 0) + ROW_HEIGHT / 2, y(ln.dst_lane, 2) + ROW_HEIGHT / 2],
                color="#e6550d", linewidth=0.6, alpha=0.6)
    ax.set_yticks([i + 2 * ROW_HEIGHT for i in range(n)], d.lanes)
    ax.set_ylim(n, -0.2)
    ax.set_xlabel("ms")
    ax.grid(axis="x", linewidth=0.3)
    ax.legend(handles=[Patch(facecolor=COLORS[p], edgecolor="black", label=p) for p in d.legend],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    paths = [] if path is None else [path] if isinstance(path, (str, os.PathLike)) else list(path)
    for p in paths:
        fig.savefig(p, dpi=110)
        d.paths.append(os.fspath(p))
    return d
