"""What a plan's messages carry under ``deterministic=True``.

Under True every value a plan moves is the set of partial sums of the
reference tree that cover the ranks it combines
(:func:`flowreduce.reproducible.tree_cover`), each a whole array over the
value's range. Plans whose merges are always siblings of the tree move one
per value, the default's bytes; the others move several on some messages
(docs/reproducibility.md, "Cost of ``True``"). :func:`carried` counts them
once per plan, for the cost model (``auto`` prices them:
:attr:`flowreduce.cost.CostModel.partials`) and for
``benchmarks/reproducible.py --bytes`` (:func:`wire_factor`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flowreduce.algorithms.ir import GATHER, REDUCE, VIEW, Plan
from flowreduce.reproducible import TreeNode, tree_leaf, tree_merge


@dataclass(frozen=True)
class Carried:
    """A plan's bytes under True, in segments of one chunk, each segment
    counted once per partial sum it carries: what :class:`~flowreduce.algorithms.ir.Structure`
    counts for the default (``wire_width``, ``max_rank_width``,
    ``chain_width``), with each node's value weighed (``widths``)."""

    widths: tuple[int, ...]  # per node: the segments a transfer of its value carries
    wire_width: int  # all messages
    max_rank_width: int  # the busiest rank's, sent + received
    chain_width: int  # moved one after another on the longest chain


def carried(plan: Plan) -> Carried:
    """What ``plan``'s values carry under ``deterministic=True``: a view its
    rank's one value, a reduce the :func:`~flowreduce.reproducible.tree_cover`
    of the ranks it combines over its whole range (its inputs' partials
    merged by :func:`~flowreduce.reproducible.tree_merge`), a gather its
    inputs' pieces within its range (as the ordered lowering lays them out)."""
    p, nodes = plan.ranks, plan.nodes
    covers: list[tuple[TreeNode, ...]] = []  # per node: the partial sums of the ranks it combines
    pieces: list[list[tuple[int, int, int]]] = []  # per node: (lo, hi, partial sums over [lo, hi))
    for n in nodes:
        if n.kind == VIEW:
            cover: tuple[TreeNode, ...] = (tree_leaf(p, n.rank),)
            pieces.append([(n.lo, n.hi, 1)])
        elif n.kind == REDUCE:  # the inputs' partials merged, as the ordered lowering adds them
            cover = tuple(tree_merge(p, {t: None for i in n.inputs for t in covers[i]}, _none))
            pieces.append([(n.lo, n.hi, len(cover))])
        elif n.kind == GATHER:
            cover = covers[n.inputs[0]]
            pieces.append(_runs((max(a, n.lo), min(b, n.hi), k) for i in n.inputs for a, b, k in pieces[i]
                                if max(a, n.lo) < min(b, n.hi)))
        else:
            raise ValueError(f"unknown node kind {n.kind!r}")
        covers.append(cover)
    widths = tuple(sum((b - a) * k for a, b, k in ps) for ps in pieces)
    per_rank = [0] * p
    for t in plan.structure.transfers:
        per_rank[t.source] += widths[t.src]
        per_rank[t.dest] += widths[t.src]
    chain = [0] * len(nodes)
    for n in nodes:  # topologically ordered
        chain[n.id] = max((chain[i] + (widths[i] if nodes[i].rank != n.rank else 0) for i in n.inputs), default=0)
    return Carried(widths, sum(widths[t.src] for t in plan.structure.transfers), max(per_rank, default=0),
                   max((chain[f] for f in plan.finals), default=0))


def _none(a: None, b: None) -> None:
    return None


def _runs(pieces: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``pieces`` with neighbours carrying as many partial sums joined (the
    same bytes; a gather of gathers stays a few runs, not one piece per rank)."""
    out: list[tuple[int, int, int]] = []
    for a, b, k in pieces:
        if out and out[-1][1] == a and out[-1][2] == k:
            out[-1] = (out[-1][0], b, k)
        else:
            out.append((a, b, k))
    return out


def wire_factor(plan: Plan) -> float:
    """``plan``'s bytes on the wire under ``deterministic=True`` over the
    default's (1.0 for a plan with no message)."""
    plain = plan.structure.wire_width
    return carried(plan).wire_width / plain if plain else 1.0
