"""Drawings: the DOT text of a plan and of its task graph, the gallery's freshness.

Structure is checked on the DOT text (no Graphviz programs needed); only the
rendering tests need the ``dot`` binary and skip, saying so, without it.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("graphviz", reason="drawing needs the graphviz package: pip install flowreduce[viz]")

import flowreduce  # noqa: E402
from flowreduce import draw  # noqa: E402

GRAPHS = Path(__file__).resolve().parents[1] / "graphs"
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="the Graphviz 'dot' binary is missing: apt-get install graphviz"
)

_EDGE = re.compile(r"^\s*(\S+) -> (\S+)(?: \[(.*)\])?$")
_NODE = re.compile(r"^\s*([\w\"-]+)(?: \[(.*)\])?$")
_KEYWORDS = {"graph", "node", "edge", "subgraph", "digraph", "}", "{"}


def parse_dot(source: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
    """Node ids -> attributes (first declaration) and edges (tail, head, attributes)
    of DOT text written by the graphviz package (one statement per line)."""
    nodes: dict[str, str] = {}
    edges = []
    for line in source.splitlines():
        if m := _EDGE.match(line):
            edges.append((m[1], m[2], m[3] or ""))
        elif (m := _NODE.match(line)) and m[1] not in _KEYWORDS and "=" not in line.split("[")[0]:
            nodes.setdefault(m[1], m[2] or "")
    return nodes, edges


def edges_of_class(edges, cls: str) -> list[tuple[str, str, str]]:
    return [e for e in edges if f"class={cls}" in e[2] or f'class="{cls}"' in e[2]]


CASES = [(a, r) for a in flowreduce.ALGORITHMS if a != "auto" for r in (1, 3, 4, 8)]


@pytest.mark.parametrize(("algorithm", "ranks"), CASES, ids=[f"{a}-{r}" for a, r in CASES])
def test_plan_dot_has_a_node_per_plan_node_and_an_arrow_per_transfer(algorithm, ranks):
    plan = flowreduce.plan(algorithm, ranks)
    nodes, edges = parse_dot(draw.draw_plan(plan).source)

    plan_nodes = {n for n, attrs in nodes.items() if "plan-node" in attrs}
    assert plan_nodes == {f"n{n.id}" for n in plan.nodes}
    transfers = edges_of_class(edges, "transfer")
    assert len(transfers) == len(plan.transfers())
    local = sum(plan.nodes[i].rank == n.rank for n in plan.nodes for i in n.inputs)
    assert len(edges_of_class(edges, "local")) == local


def test_butterfly_4_dot_edges_and_labels():
    plan = flowreduce.plan("butterfly", 4)
    _, edges = parse_dot(draw.draw_plan(plan).source)
    consumers = plan.consumers()
    expected = set()
    for t in plan.transfers():
        first = next(c for c in consumers[t.src] if plan.nodes[c].rank == t.dest)
        expected.add((f"n{t.src}", f"n{first}", draw.segment_label(t.lo, t.hi, plan.segments)))
    got = set()
    for tail, head, attrs in edges_of_class(edges, "transfer"):
        label = re.search(r'headlabel="([^"]*)"', attrs)[1]
        got.add((tail, head, label))
    assert got == expected
    assert len(plan.transfers()) == 16  # 4 ranks x (2 reduce-scatter + 2 all-gather steps)
    assert {label for *_, label in got} == {"seg 0-1", "seg 2-3", "seg 0", "seg 1", "seg 2", "seg 3"}


@pytest.mark.parametrize(
    ("lo", "hi", "segments", "label"),
    [(0, 4, 4, "all"), (0, 1, 1, "all"), (2, 3, 4, "seg 2"), (2, 4, 4, "seg 2-3"), (0, 2, 8, "seg 0-1")],
)
def test_segment_label(lo, hi, segments, label):
    assert draw.segment_label(lo, hi, segments) == label


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "tree"])
def test_tasks_dot_has_one_node_per_task(algorithm, chunks):
    plan = flowreduce.plan(algorithm, 4, chunks=chunks)
    tasks = draw.task_graph(plan)
    nodes, edges = parse_dot(draw.draw_tasks(plan).source)

    task_nodes = {n for n in nodes if n != "spine"}
    assert len(task_nodes) == len(tasks) == plan.cost().tasks
    deps = sum(len([d for d in t.dependencies if d in tasks]) for t in tasks.values())
    assert len([e for e in edges if "invis" not in e[2]]) == deps


def test_tasks_dot_is_the_same_in_every_process():
    """dask.dot names nodes by hash(); string hashes change per process."""
    code = ("import flowreduce, flowreduce.draw as d; "
            "print(d.draw_tasks(flowreduce.plan('butterfly', 4, chunks=2)).source)")
    out = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("1", "2")
    ]
    assert out[0] == out[1]


def test_gallery_is_fresh(tmp_path):
    draw.regenerate(tmp_path, formats=("dot",))
    fresh = sorted(p.name for p in tmp_path.iterdir())
    committed = sorted(p.name for p in GRAPHS.glob("*.dot")) + ["README.md"]
    stale = sorted(set(fresh) ^ set(committed))
    stale += [name for name in fresh if name in committed
              and not filecmp.cmp(tmp_path / name, GRAPHS / name, shallow=False)]
    assert not stale, f"graphs/ is stale: run {draw.REGENERATE_COMMAND} (differs: {', '.join(sorted(stale))})"
    # every SVG was rendered from the current DOT: the manifest written with the SVGs
    # records the DOT's hash (and the SVG's), so Graphviz's exact output need not match
    manifest = draw.read_manifest(GRAPHS)
    svgs = {p.name for p in GRAPHS.glob("*.svg")}
    wanted = {n.removesuffix(".dot") + ".svg" for n in fresh if n.endswith(".dot")}
    stale = [f"{n} (no such drawing)" for n in sorted(svgs - wanted)]
    stale += [f"{n} (missing)" for n in sorted(wanted - svgs)]
    stale += [f"{n} (not in {draw.MANIFEST})" for n in sorted(svgs & wanted - set(manifest))]
    stale += [f"{n} (in {draw.MANIFEST}, no file)" for n in sorted(set(manifest) - svgs - wanted)]
    for name in sorted(svgs & wanted & set(manifest)):
        entry, dot = manifest[name], name.removesuffix(".svg") + ".dot"
        if (entry["from"], entry["dot_sha256"]) != (dot, draw.content_hash((tmp_path / dot).read_bytes())):
            stale.append(f"{name} (rendered from another DOT)")
        elif entry["sha256"] != draw.content_hash((GRAPHS / name).read_bytes()):
            stale.append(f"{name} (not the file that was rendered)")
    assert not stale, f"graphs/ is stale: run {draw.REGENERATE_COMMAND} (SVGs: {', '.join(stale)})"


@needs_dot
def test_svg_rendering_is_deterministic_and_tagged(tmp_path):
    plan = flowreduce.plan("butterfly", 4)
    a, b = draw.draw_plan(plan, tmp_path / "a.svg"), draw.draw_plan(plan, tmp_path / "b.svg")
    assert a.source == b.source
    svg = (tmp_path / "a.svg").read_bytes()
    assert svg == (tmp_path / "b.svg").read_bytes()
    text = svg.decode()
    assert text.count('class="node plan&#45;node"') == len(plan.nodes)
    assert text.count('class="edge transfer"') == len(plan.transfers())


@needs_dot
@pytest.mark.parametrize("suffix", [".svg", ".png", ".dot"])
def test_cli_writes_by_extension(tmp_path, suffix):
    from flowreduce.cli import main

    out = tmp_path / f"drawing{suffix}"
    assert main(["draw", "butterfly", "--ranks", "4", "--radix", "2", "-o", str(out)]) == 0
    assert out.stat().st_size > 0


def test_cli_tasks_and_options(tmp_path):
    from flowreduce.cli.draw import main

    out = tmp_path / "tree.dot"
    assert main(["tree", "--ranks", "5", "--fan-in", "3", "--chunks", "2", "--tasks", "-o", str(out)]) == 0
    nodes, _ = parse_dot(out.read_text())
    assert len(nodes) - 1 == flowreduce.plan("tree", 5, chunks=2, fan_in=3).cost().tasks


def test_cli_reports_a_bad_option(tmp_path, capsys):
    from flowreduce.cli.draw import main

    assert main(["ring", "--radix", "4", "-o", str(tmp_path / "x.dot")]) == 2
    assert "bad option for algorithm 'ring'" in capsys.readouterr().err


def test_unknown_format_names_the_choices(tmp_path):
    with pytest.raises(ValueError, match="cannot tell the output format.*svg, png, pdf, dot"):
        draw.draw_plan(flowreduce.plan("ring", 2), tmp_path / "ring.gif")


def test_missing_graphviz_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    with pytest.raises(ImportError, match=r"pip install flowreduce\[viz\].*apt-get install graphviz"):
        draw.draw_plan(flowreduce.plan("ring", 2))
