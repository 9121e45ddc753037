"""Draw an all-reduce: its plan as ranks × steps, or the Dask task graph it lowers to.

::

    flowreduce draw butterfly --ranks 8 -o butterfly-8.svg           # the plan
    flowreduce draw ring --ranks 4 --chunks 2 --tasks -o ring.svg     # its Dask tasks
    python -m flowreduce.draw --regenerate graphs                     # the gallery

The plan drawing has one lane (row) per rank and one column per step. Every
plan node is a box coloured by phase and labelled with its segment range
(``seg 2-3`` = segments 2 and 3 of the plan's ``segments``; ``all`` = the
whole chunk). Every :class:`~flowreduce.algorithms.ir.Transfer` is one black arrow
labelled with the segments it carries; local dependencies are grey, and a
message read by a second task on the receiving rank is a dotted arrow.

The task drawing lowers the plan with :func:`flowreduce.lower.graph.build_graph`
on stand-in inputs and worker names (no cluster needed) and draws it with
:func:`dask.dot.to_graphviz`: one node per task, coloured by phase, boxed by
worker.

Both need the ``graphviz`` Python package (``pip install flowreduce[viz]``);
rendering SVG or PNG also needs the Graphviz ``dot`` program
(``apt-get install graphviz``). Writing ``.dot`` needs only the package.
DOT output depends on nothing but the plan, so the gallery in ``graphs/`` is
checked for staleness by comparing DOT text. Rendered files depend on the
Graphviz version too, so ``--regenerate`` records in ``graphs/manifest.json``
the sha256 of the DOT text each SVG was rendered from (and of the SVG), and
the test checks those against the current DOT instead of re-rendering.
"""

from __future__ import annotations

import hashlib
import html
import json
import sys
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowreduce import keys, phases
from flowreduce.algorithms import ALGORITHMS
from flowreduce.algorithms import plan as make_plan
from flowreduce.algorithms.ir import VIEW, Plan

if TYPE_CHECKING:  # graphviz is optional; imported lazily by _graphviz()
    import graphviz

__all__ = ["CANONICAL", "Drawing", "draw_plan", "draw_tasks", "regenerate", "segment_label"]

#: The command that rebuilds ``graphs/``; quoted by the staleness test.
REGENERATE_COMMAND = "python -m flowreduce.draw --regenerate graphs"

FORMATS = ("svg", "png", "pdf", "dot")
#: What ``graphs/`` holds of every drawing: DOT (checked for staleness) and SVG (to look at).
GALLERY_FORMATS = ("dot", "svg")
#: The gallery's record of which DOT text each rendered file was made from.
MANIFEST = "manifest.json"

#: Fill colour per key phase (:data:`flowreduce.phases.KEY_PHASES`; reductions
#: warm, data movement cool), in legend order.
PHASE_COLOURS: dict[str, str] = {
    phases.SPLIT: "#e0e0e0",
    phases.REDUCE_SCATTER: "#fdae6b",
    phases.REDUCE: "#fd8d3c",
    phases.EXCHANGE: "#fdd0a2",
    phases.READ_REDUCE: "#e6550d",
    phases.ALL_GATHER: "#9ecae1",
    phases.BROADCAST: "#a1d99b",
    phases.OUTPUT: "#bcbddc",
    phases.COMPACT: "#c8c8c8",
    phases.AGGREGATE: "#f16913",
    phases.PACK: "#e7ba52",
    phases.UNPACK: "#f3d98c",
    phases.HAND_IN: "#d9d9d9",
    phases.BARRIER: "#f0f0f0",
    phases.ARRIVE: "#d9d9d9",
}
_OTHER_PHASE = "#ffffff"
TRANSFER_COLOUR = "#222222"
LOCAL_COLOUR = "#b0b0b0"
_FONT = "Helvetica"
_INSTALL_HINT = (
    "drawing needs the graphviz Python package: pip install flowreduce[viz] "
    "(or pip install graphviz); rendering SVG/PNG also needs the Graphviz programs: "
    "apt-get install graphviz (conda install graphviz, brew install graphviz)"
)


def _graphviz():
    """Import the optional graphviz package, or say how to install it."""
    try:
        import graphviz
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return graphviz


def segment_label(lo: int, hi: int, segments: int) -> str:
    """``"all"`` for the whole range, ``"seg 2"`` for one segment,
    ``"seg 2-3"`` for segments 2 to 3 inclusive (the half-open ``[2, 4)``)."""
    if (lo, hi) == (0, segments):
        return "all"
    return f"seg {lo}" if hi - lo == 1 else f"seg {lo}-{hi - 1}"


def _describe(plan: Plan) -> str:
    opts = "".join(f" · {k}={v}" for k, v in plan.options.items())
    chunks = f" · {plan.chunks} chunks" if plan.chunks > 1 else ""
    return f"{plan.algorithm} · {plan.ranks} ranks{opts}{chunks}"


def _legend(phases: Iterable[str], title: str, subtitle: str, notes: Sequence[tuple[str, str]]) -> str:
    """An HTML-like graph label: title, subtitle, phase swatches, edge notes."""
    phases = list(phases)
    cells = "".join(
        f'<td bgcolor="{PHASE_COLOURS.get(p, _OTHER_PHASE)}" border="1">{html.escape(p)}</td>' for p in phases
    )
    width = max(len(phases), 1)
    note_rows = "".join(
        f'<tr><td colspan="{width}" align="left"><font color="{colour}">{html.escape(text)}</font></td></tr>'
        for colour, text in notes
    )
    return (
        f'<<table border="0" cellspacing="4" cellpadding="3">'
        f'<tr><td colspan="{width}"><font point-size="16"><b>{html.escape(title)}</b></font></td></tr>'
        f'<tr><td colspan="{width}">{html.escape(subtitle)}</td></tr>'
        f"<tr>{cells}</tr>{note_rows}</table>>"
    )


def _ordered_phases(found: Iterable[str]) -> list[str]:
    found = set(found)
    known = [p for p in PHASE_COLOURS if p in found]
    return known + sorted(found - set(known))


def _order_lanes(g: graphviz.Digraph, heads: Sequence[str]) -> None:
    """Stack the lanes top to bottom in the order of ``heads`` (one node per
    lane, all in one column): an invisible spine whose out-edges keep their
    order. Without it dot's crossing minimisation reorders whole lanes."""
    g.node("spine", label="", style="invis", width="0", height="0", ordering="out")
    for h in heads:
        g.edge("spine", h, style="invis")


# -- the plan --------------------------------------------------------------------------------------


def plan_graph(plan: Plan) -> graphviz.Digraph:
    """The plan as a graphviz ``Digraph`` (nothing is rendered or written)."""
    gv = _graphviz()
    nodes, S = plan.nodes, plan.segments
    transfers = plan.transfers()
    card = plan.cost()
    subtitle = (
        f"{S} segment{'s' if S > 1 else ''} per chunk · {card.steps} steps · {len(nodes)} tasks and "
        f"{len(transfers)} messages per chunk"
        + (f" (each of the {plan.chunks} chunks repeats this plan)" if plan.chunks > 1 else "")
    )
    notes = [
        (TRANSFER_COLOUR, "black arrow: one message, labelled with the segments it carries (seg 2-3 = segments 2 and 3)"),
        (TRANSFER_COLOUR, "dotted arrow: the same message read by another task on the receiving rank"),
        ("#808080", "grey arrow: a local dependency (same rank, no transfer)"),
    ]
    g = gv.Digraph(
        name=f"flowreduce-{plan.algorithm}",
        graph_attr={
            "rankdir": "LR", "newrank": "true", "nodesep": "0.06", "ranksep": "0.8",
            "fontname": _FONT, "labelloc": "t", "tooltip": repr(plan),
            "label": _legend(_ordered_phases(n.phase for n in nodes), _describe(plan), subtitle, notes),
        },
        node_attr={
            "shape": "box", "style": "rounded,filled", "fontname": _FONT, "fontsize": "9",
            "height": "0.3", "margin": "0.05,0.02",
        },
        edge_attr={"fontname": _FONT, "fontsize": "8", "arrowsize": "0.5"},
    )

    # a node's column is its step, except that a split (a zero-copy slice,
    # free to take at any time) sits just before its first reader
    consumers = plan.consumers()
    column = {
        n.id: (max(0, min(nodes[c].step for c in consumers[n.id]) - 1)
               if n.kind == VIEW and consumers[n.id] else n.step)
        for n in nodes
    }
    columns = sorted(set(column.values()))

    # lanes: one cluster per rank
    for rank in range(plan.ranks):
        with g.subgraph(name=f"cluster_rank{rank}") as lane:
            lane.attr(label="", style="filled", color="#d0d0d0",
                      fillcolor="#f3f3f3" if rank % 2 else "#ffffff")
            lane.node(f"lane{rank}", f"rank {rank}", shape="plaintext", style="", fontsize="11")
            lane.node(f"lane{rank}end", "", shape="point", style="invis", width="0")
            for n in nodes:
                if n.rank == rank:
                    lane.node(
                        f"n{n.id}", f"{n.phase}\\n{segment_label(n.lo, n.hi, S)}",
                        fillcolor=PHASE_COLOURS.get(n.phase, _OTHER_PHASE), group=f"rank{rank}",
                        tooltip=f"node {n.id}: {n.kind} on rank {n.rank}, step {n.step}, segments [{n.lo}, {n.hi})",
                        **{"class": "plan-node"},
                    )
    with g.subgraph(name="cluster_steps") as head:
        head.attr(label="", style="invis")
        head.node("corner", "", shape="plaintext", style="")
        head.node("end", "", shape="point", style="invis", width="0")
        for c in columns:
            head.node(f"step{c}", f"step {c}", shape="plaintext", style="", fontsize="11")

    # columns: the lane labels, then one per step, each with its header
    stacks = [["corner", *(f"lane{r}" for r in range(plan.ranks))]]
    for c in columns:
        here = sorted((n for n in nodes if column[n.id] == c), key=lambda n: (n.rank, n.lo, n.id))
        stacks.append([f"step{c}", *(f"n{n.id}" for n in here)])
    stacks.append(["end", *(f"lane{r}end" for r in range(plan.ranks))])
    for stack in stacks:
        with g.subgraph() as col:
            col.attr(rank="same")
            for name in stack:
                col.node(name)
    _order_lanes(g, stacks[0])
    for rank in range(plan.ranks):
        first = min((n for n in nodes if n.rank == rank), key=lambda n: (column[n.id], n.lo, n.id))
        g.edge(f"lane{rank}", f"n{first.id}", style="invis")
    for a, b in pairwise(stacks):
        g.edge(a[0], b[0], style="invis")

    # edges: local dependencies, then one arrow per message. Messages do not
    # constrain the layout, so crossing minimisation cannot reorder the lanes
    # (a ring's wrap-around would otherwise fold them 15, 0, 14, 1, ...).
    for n in nodes:
        for i in n.inputs:
            if nodes[i].rank == n.rank:
                g.edge(f"n{i}", f"n{n.id}", color=LOCAL_COLOUR, **{"class": "local"})
    for t in transfers:
        readers = [c for c in consumers[t.src] if nodes[c].rank == t.dest]
        tip = f"rank {t.source} -> rank {t.dest}: node {t.src}, segments [{t.lo}, {t.hi})"
        g.edge(f"n{t.src}", f"n{readers[0]}", headlabel=segment_label(t.lo, t.hi, S), labelfontsize="7", labeldistance="2.5", color=TRANSFER_COLOUR,
               tooltip=tip, constraint="false", **{"class": "transfer"})
        for c in readers[1:]:
            g.edge(f"n{t.src}", f"n{c}", color=TRANSFER_COLOUR, style="dotted", tooltip=tip,
                   constraint="false", **{"class": "reuse"})
    return g


def draw_plan(plan: Plan, path: str | Path | None = None, fmt: str | None = None) -> graphviz.Digraph:
    """Draw ``plan`` as ranks × steps; write it to ``path`` if given.

    Parameters
    ----------
    plan
        From :func:`flowreduce.plan`.
    path
        Where to write; the format comes from the extension (``.svg``,
        ``.png``, ``.pdf``, ``.dot``) unless ``fmt`` is given.
    fmt
        One of :data:`FORMATS`, overriding the extension.

    Returns
    -------
    graphviz.Digraph
        Displays inline in Jupyter; ``.source`` is the DOT text.

    Raises
    ------
    ImportError
        The graphviz package is missing (the message says what to install).
    RuntimeError
        Rendering needs the Graphviz ``dot`` program and it is missing.
    ValueError
        Unknown output format.

    Examples
    --------
    >>> import flowreduce
    >>> from flowreduce.draw import draw_plan
    >>> g = draw_plan(flowreduce.plan("butterfly", 4))  # doctest: +SKIP
    >>> draw_plan(flowreduce.plan("ring", 8), "ring-8.svg")  # doctest: +SKIP
    """
    g = plan_graph(plan)
    if path is not None:
        write(g, path, fmt)
    return g


# -- the task graph --------------------------------------------------------------------------------


def task_graph(plan: Plan, *, size: int | None = None, op: str = "sum") -> dict[Hashable, Any]:
    """The Dask tasks ``plan`` lowers to, built on stand-in inputs
    ``TaskRef(("input", rank))`` and workers ``"worker-<rank>"`` with a fixed
    token, so the keys are the same on every call. ``size`` (elements per
    rank) defaults to one element per segment per chunk. ``direct`` in one
    chunk is lowered as the front door lowers it (:mod:`flowreduce.lower.direct`:
    a task per worker, reading its peers' inputs itself)."""
    from dask.task_spec import TaskRef

    from flowreduce.lower.direct import build_direct
    from flowreduce.lower.graph import build_graph
    from flowreduce.ops import resolve_op

    size = plan.segments * plan.chunks if size is None else size
    if plan.fused_views and plan.chunks == 1:
        refs = [TaskRef(("input", r)) for r in range(plan.ranks)]
        return build_direct(plan, refs, [f"worker-{r}" for r in range(plan.ranks)],
                            input_keys=[ref.key for ref in refs], op=resolve_op(op), read=None, token="0" * 32).tasks
    return build_graph(
        plan, [TaskRef(("input", r)) for r in range(plan.ranks)], [f"worker-{r}" for r in range(plan.ranks)],
        size=size, shape=(size,), op=resolve_op(op), token="0" * 32,
    ).tasks


def _task_label(key: Hashable) -> tuple[str, str, int]:
    """(phase, label, rank) of one flowreduce key."""
    part = keys.parse(key)
    if part is None:
        raise ValueError(f"not a flowreduce key: {key!r}")
    if part["phase"] == phases.OUTPUT:
        return phases.OUTPUT, f"output\\nrank {part['rank']}", part["rank"]
    return part["phase"], f"{part['phase']}\\nstep {part['step']} · chunk {part['chunk']}", part["rank"]


def _stand_in(tasks: dict[Hashable, Any]) -> dict[int, Any]:
    """The same graph keyed by position. dask.dot names nodes by ``hash(key)``
    and lists dependencies from a set, both of which change between processes
    for string keys; integer keys hash to themselves, so the drawing (and its
    DOT text) is the same on every run."""
    from dask.task_spec import Task, TaskRef

    index = {k: i for i, k in enumerate(tasks)}
    out = {}
    for k, t in tasks.items():
        deps = sorted(index[d] for d in t.dependencies if d in index)
        out[index[k]] = Task(index[k], _draw_only, *(TaskRef(d) for d in deps))
    return out


def _draw_only(*args: Any) -> None:  # pragma: no cover - never executed
    """The callable of the stand-in tasks: the graph is drawn, never run."""


def draw_tasks(
    plan: Plan,
    path: str | Path | None = None,
    fmt: str | None = None,
    *,
    size: int | None = None,
    op: str = "sum",
) -> graphviz.Digraph:
    """Draw the Dask task graph of ``plan`` (all chunks, plus the outputs)
    with :func:`dask.dot.to_graphviz`: one node per task, coloured by phase,
    boxed by the worker it is pinned to. Arguments, result and errors as in
    :func:`draw_plan`; ``size`` and ``op`` as in :func:`task_graph`.

    Examples
    --------
    >>> import flowreduce
    >>> from flowreduce.draw import draw_tasks
    >>> draw_tasks(flowreduce.plan("butterfly", 4, chunks=2), "tasks.svg")  # doctest: +SKIP
    """
    _graphviz()
    from dask.dot import name as dot_name
    from dask.dot import to_graphviz

    tasks = task_graph(plan, size=size, op=op)
    dsk = _stand_in(tasks)
    attrs: dict[int, dict[str, str]] = {}
    lanes: dict[int, list[int]] = defaultdict(list)
    phases = []
    for i, key in enumerate(tasks):
        phase, label, rank = _task_label(key)
        phases.append(phase)
        lanes[rank].append(i)
        attrs[i] = {"label": label, "shape": "box", "fillcolor": PHASE_COLOURS.get(phase, _OTHER_PHASE),
                    "tooltip": str(key), "class": phase}
    subtitle = (f"{len(tasks)} Dask tasks on {plan.ranks} workers "
                f"(keys as built by flowreduce.lower.graph.build_graph; inputs not drawn)")
    notes = [("#808080", "a box per worker: the tasks pinned to it")]
    g = to_graphviz(
        dsk, function_attributes=attrs, collapse_outputs=True, rankdir="LR",
        node_attr={"shape": "box", "style": "rounded,filled", "fontsize": "9", "height": "0.3",
                   "margin": "0.05,0.02"},
        edge_attr={"arrowsize": "0.5", "color": "#606060"},
        newrank="true", nodesep="0.06", ranksep="0.35", fontname=_FONT, labelloc="t",
        label=_legend(_ordered_phases(phases), f"{_describe(plan)} · Dask tasks", subtitle, notes),
    )
    for rank in range(plan.ranks):
        with g.subgraph(name=f"cluster_worker{rank}") as lane:
            lane.attr(label=f"worker-{rank} (rank {rank})", labeljust="l", style="filled", color="#d0d0d0",
                      fillcolor="#f3f3f3" if rank % 2 else "#ffffff", fontname=_FONT, fontsize="10")
            for i in lanes[rank]:
                lane.node(dot_name(i))
    _order_lanes(g, [dot_name(lanes[r][0]) for r in range(plan.ranks)])
    if path is not None:
        write(g, path, fmt)
    return g


# -- output ----------------------------------------------------------------------------------------


def write(g: graphviz.Digraph, path: str | Path, fmt: str | None = None) -> Path:
    """Write ``g`` to ``path`` as DOT text or rendered by Graphviz, by ``fmt``
    or the extension. Returns the path written."""
    path = Path(path)
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise ValueError(
            f"cannot tell the output format of {str(path)!r}; use an extension or fmt= among {', '.join(FORMATS)}"
        )
    if fmt == "dot":
        path.write_text(g.source, encoding="utf-8")
        return path
    gv = _graphviz()
    try:
        data = g.pipe(format=fmt)
    except gv.ExecutableNotFound as e:
        raise RuntimeError(
            f"rendering {fmt} needs the Graphviz 'dot' program: apt-get install graphviz "
            "(or write .dot and render it elsewhere)"
        ) from e
    path.write_bytes(data)
    return path


# -- the gallery -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drawing:
    """One drawing of the gallery in ``graphs/``."""

    algorithm: str
    ranks: int
    options: dict[str, int] = field(default_factory=dict)
    chunks: int = 1
    tasks: bool = False
    note: str = ""

    @property
    def stem(self) -> str:
        opts = "".join(f"-{k.replace('_', '')}{v}" for k, v in self.options.items())
        chunks = f"-chunks{self.chunks}" if self.chunks > 1 else ""
        return f"{self.algorithm}-{self.ranks}{opts}{chunks}{'-tasks' if self.tasks else ''}"

    def plan(self) -> Plan:
        return make_plan(self.algorithm, self.ranks, chunks=self.chunks, **self.options)

    def graph(self) -> graphviz.Digraph:
        return draw_tasks(self.plan()) if self.tasks else draw_plan(self.plan())


#: Every algorithm at 4 and 8 ranks, the bandwidth-optimal two at 16, and a few variants.
CANONICAL: tuple[Drawing, ...] = (
    *(Drawing(a, r) for a in ALGORITHMS if a != "auto" for r in (4, 8)),
    Drawing("butterfly", 6, note="non-power of two: ranks 4 and 5 fold into 0 and 1"),
    Drawing("butterfly", 16),
    Drawing("butterfly", 16, {"radix": 4}, note="4-way splits: half the steps of radix 2"),
    Drawing("ring", 16),
    Drawing("recursive-doubling", 8, {"radix": 8}, note="direct all-to-all exchange in one step"),
    Drawing("tree", 8, {"fan_in": 3}),
    Drawing("butterfly", 4, chunks=2, tasks=True, note="the Dask task graph, 2 chunks"),
    Drawing("direct", 4, tasks=True, note="one task per rank, reading its peers' inputs itself: one level"),
)


def content_hash(data: str | bytes) -> str:
    """sha256 of a file's text with line endings normalised to LF (so a
    checkout that converts them does not look stale)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data.replace(b"\r\n", b"\n")).hexdigest()


def regenerate(directory: str | Path, formats: Sequence[str] = GALLERY_FORMATS,
               drawings: Sequence[Drawing] = CANONICAL) -> list[Path]:
    """Write every drawing in ``drawings`` to ``directory`` in each of
    ``formats``, plus a ``README.md`` listing them and, when anything is
    rendered (not DOT), a :data:`MANIFEST` giving for each rendered file the
    sha256 of the DOT text it was rendered from and its own. Returns the
    paths written. ``formats=("dot",)`` needs no Graphviz programs (the
    staleness test)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    rendered: dict[str, dict[str, str]] = {}
    for d in drawings:
        g = d.graph()
        for fmt in formats:
            path = write(g, directory / f"{d.stem}.{fmt}", fmt)
            written.append(path)
            if fmt != "dot":
                rendered[path.name] = {"from": f"{d.stem}.dot", "dot_sha256": content_hash(g.source),
                                       "sha256": content_hash(path.read_bytes())}
    readme = directory / "README.md"
    readme.write_text(gallery_readme(drawings), encoding="utf-8")
    written.append(readme)
    if rendered:
        manifest = directory / MANIFEST
        manifest.write_text(json.dumps({
            "about": f"Written by `{REGENERATE_COMMAND}`: for each rendered drawing, the sha256 of the DOT "
                     "text it was rendered from and of the file itself (line endings as LF). "
                     "tests/test_draw.py checks both against the current DOT.",
            "rendered": dict(sorted(rendered.items())),
        }, indent=1) + "\n", encoding="utf-8")
        written.append(manifest)
    return written


def read_manifest(directory: str | Path) -> dict[str, dict[str, str]]:
    """``rendered file name -> {"from", "dot_sha256", "sha256"}`` of a
    gallery written by :func:`regenerate` (empty if it has no manifest)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))["rendered"]


def gallery_readme(drawings: Sequence[Drawing] = CANONICAL, formats: Sequence[str] = GALLERY_FORMATS) -> str:
    """The text of ``graphs/README.md``: a table of the drawings."""
    lines = [
        "# Drawings of the all-reduce plans",
        "",
        f"Generated by `{REGENERATE_COMMAND}`; do not edit by hand. `tests/test_draw.py` fails when",
        "these files no longer match the planners: it compares the DOT files with freshly generated ones, and",
        f"every SVG with the sha256 of the DOT it was rendered from, recorded in [{MANIFEST}]({MANIFEST}).",
        "How to read them: [docs/drawing.md](../docs/drawing.md).",
        "",
        "| drawing | algorithm | ranks | options | chunks | steps | tasks | messages | files |",
        "|---|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for d in drawings:
        p = d.plan()
        card = p.cost()
        opts = ", ".join(f"{k}={v}" for k, v in p.options.items()) or "-"
        kind = "Dask tasks" if d.tasks else "plan"
        files = " ".join(f"[{fmt}]({d.stem}.{fmt})" for fmt in formats)
        note = f" ({d.note})" if d.note else ""
        lines.append(
            f"| {kind}{note} | {d.algorithm} | {d.ranks} | {opts} | {d.chunks} | {card.steps} "
            f"| {card.tasks} | {card.messages} | {files} |"
        )
    lines += [
        "",
        "Steps, tasks and messages are the plan's cost card (`flowreduce.plan(...).cost()`), all chunks.",
        "",
    ]
    return "\n".join(lines)


# `python -m flowreduce.draw` (the gallery's regenerate command) runs the command; its
# arguments live with the other commands in flowreduce.cli.draw
if __name__ == "__main__":
    from flowreduce.cli.draw import main

    sys.exit(main())
