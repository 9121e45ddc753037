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
from flowreduce.reproducible import TreeNode, tree_leaf, tree_merge, tree_root


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


def tree_nodes(plan: Plan) -> list[tuple[TreeNode, ...]]:
    """Under ``deterministic=True``, the partial sums each node's value
    carries (the one walk that decides them: :func:`carried` counts them,
    the ordered lowering lays them out and adds them,
    :func:`flowreduce.lower.graph.tree_nodes`): a view its rank's leaf, a
    reduce its inputs' partials merged by
    :func:`~flowreduce.reproducible.tree_merge` (as the ordered lowering
    adds them), a gather its inputs' partials, which must be the same. Each
    is the :func:`~flowreduce.reproducible.tree_cover` of the ranks the
    node combines (the maximal nodes of the reference tree inside them), in
    its order.

    Raises ValueError when a reduce combines some rank twice or a gather
    puts together values of different ranks."""
    p = plan.ranks
    covers: list[tuple[TreeNode, ...]] = []
    merged: dict[tuple[TreeNode, ...], tuple[TreeNode, ...]] = {}  # inputs' partials, sorted -> merged
    for n in plan.nodes:
        if n.kind == VIEW:
            cover: tuple[TreeNode, ...] = (tree_leaf(p, n.rank),)
        elif n.kind == REDUCE:
            parts = tuple(sorted(t for i in n.inputs for t in covers[i]))
            if parts not in merged:
                if not _disjoint(p, parts):
                    raise ValueError(f"{plan!r}: node {n.id} combines some rank twice")
                merged[parts] = tuple(tree_merge(p, dict.fromkeys(parts), _none))
            cover = merged[parts]
        elif n.kind == GATHER:
            cover = covers[n.inputs[0]]
            if any(covers[i] != cover for i in n.inputs):  # one cover per set of ranks
                raise ValueError(f"{plan!r}: gather node {n.id} puts together values of different ranks")
        else:
            raise ValueError(f"unknown node kind {n.kind!r}")
        covers.append(cover)
    return covers


def carried(plan: Plan) -> Carried:
    """What ``plan``'s values carry under ``deterministic=True``: a view its
    rank's one value, a reduce the :func:`~flowreduce.reproducible.tree_cover`
    of the ranks it combines over its whole range (:func:`tree_nodes`), a
    gather its inputs' pieces within its range (as the ordered lowering lays
    them out)."""
    p, nodes = plan.ranks, plan.nodes
    covers = tree_nodes(plan)
    pieces: list[list[tuple[int, int, int]]] = []  # per node: (lo, hi, partial sums over [lo, hi))
    for n in nodes:
        if n.kind == GATHER:
            pieces.append(_runs((max(a, n.lo), min(b, n.hi), k) for i in n.inputs for a, b, k in pieces[i]
                                if max(a, n.lo) < min(b, n.hi)))
        else:
            pieces.append([(n.lo, n.hi, len(covers[n.id]))])
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


def _ranks(p: int, node: TreeNode) -> list[tuple[int, int]]:
    """The ranks the reference tree's ``node`` sums, as ranges: a leaf its
    rank; level ``l``'s node ``i`` the ``y`` over ``[i 2**l, (i+1) 2**l)``,
    ranks there and ``c`` above (those that exist, ``c`` the largest power
    of two at most ``p``)."""
    level, i = node
    if level < 0:
        return [(i, i + 1)]
    c = 1 << tree_root(p)[0]
    lo, hi = i << level, (i + 1) << level
    return [(lo, hi), (c + lo, min(c + hi, p))] if c + lo < p else [(lo, hi)]


def _disjoint(p: int, parts: Iterable[TreeNode]) -> bool:
    """Whether the reference tree's nodes ``parts`` sum disjoint sets of ranks."""
    spans = sorted(r for t in parts for r in _ranks(p, t))
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


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
