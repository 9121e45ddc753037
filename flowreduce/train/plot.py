"""Pictures of training steps from a trace: one lane per rank, the training
tasks (forward, backward, update) coloured apart from the all-reduce's
phases (fusion, reduction, copies, transfers), so the interleaving shows.

Needs matplotlib (``pip install flowreduce[viz]``); uses ``Figure``
directly, never pyplot's global state.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

#: category -> (colour, row in the lane: 0 compute, 1 transfers)
CATEGORIES: dict[str, tuple[str, int]] = {
    "forward": ("#6baed6", 0),
    "backward": ("#31a354", 0),
    "update": ("#756bb1", 0),
    "fusion": ("#e7ba52", 0),
    "all-reduce tasks": ("#d62728", 0),
    "other": ("#636363", 0),
    "transfer": ("#fd8d3c", 1),
    "wait-for-input": ("#d9d9d9", 1),
}


def category(e: Any) -> str | None:
    """What a trace event was, in the training's terms."""
    if e.phase == "user-compute":
        head = e.key.split(",", 1)[0]
        for name, cat in (("train-forward", "forward"), ("train-grad", "backward"), ("train-delta", "backward"),
                          ("train-gather", "backward"), ("train-update", "update"),
                          ("torch-backward", "backward"), ("torch-update", "update"),
                          ("torch-step", "backward")):  # flowreduce.torch's (a step: update fused before backward)
            if name in head:
                return cat
        return "other"
    if e.phase == "fusion":
        return "fusion"
    if e.phase in ("split", "reduce", "copy"):
        return "all-reduce tasks"
    if e.phase in ("transfer", "wait-for-input"):
        return e.phase
    return None


def plot_steps(trace: Any, workers: Sequence[str], path: Any = None, *, title: str | None = None,
               width: float = 13.0) -> dict[str, float]:
    """Draw the trace's events per rank (``workers[r]`` is rank r's worker).

    Returns
    -------
    dict
        Seconds per category over all ranks (what was drawn).
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("plot_steps needs matplotlib: pip install flowreduce[viz]") from e
    lane = {w: r for r, w in enumerate(workers)}
    events = [(ev, c) for ev in trace.events if (c := category(ev)) is not None and ev.worker in lane]
    x0 = min((ev.start for ev, _ in events), default=0.0)
    span = max((ev.stop for ev, _ in events), default=x0) - x0
    least = span * 1e3 * 0.0015  # ms: the shortest bar still shows its colour
    fig = Figure(figsize=(width, 1.2 + 0.8 * len(workers)))
    ax = fig.add_subplot()
    totals: dict[str, float] = {}
    for ev, c in events:
        colour, row = CATEGORIES[c]
        y = lane[ev.worker] + row * 0.35
        ax.broken_barh([((ev.start - x0) * 1e3, max(ev.duration * 1e3, least))], (y, 0.3), facecolors=colour,
                       linewidth=0)
        totals[c] = totals.get(c, 0.0) + ev.duration
    ax.set_yticks([r + 0.3 for r in range(len(workers))], [f"rank {r}" for r in range(len(workers))])
    ax.set_ylim(len(workers), -0.2)
    ax.set_xlabel("ms")
    ax.grid(axis="x", linewidth=0.3)
    ax.legend(handles=[Patch(facecolor=CATEGORIES[c][0], edgecolor="black", label=c) for c in CATEGORIES
                       if c in totals], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    paths = [] if path is None else [path] if isinstance(path, (str, os.PathLike)) else list(path)
    for p in paths:
        fig.savefig(p, dpi=110)
    return totals
