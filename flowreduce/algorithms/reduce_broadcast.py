"""Reduce to one root, then broadcast: what users write by hand today.

::

    step 1   r1 --\\
             r2 ---> root: reduce all p vectors
             r3 --/
    step 2   root --> r1, r2, r3 (the whole result to each)

Cost: 2 steps; the root's link carries (p-1)·n in and (p-1)·n out;
the root combines (p-1)·n bytes alone. Tasks: 2p per chunk.

:func:`all_reduce` runs the pattern over any subset of ranks and segment
range (:mod:`~flowreduce.algorithms.patterns`), as
:mod:`~flowreduce.algorithms.hierarchical` does across hosts; :func:`plan`
runs it over all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan
from flowreduce.algorithms.patterns import Source, Tiles, finish, view_source

NAME = "reduce-broadcast"


def plan(ranks: int, *, root: int = 0) -> Plan:
    if not 0 <= root < ranks:
        raise ValueError(f"root must be a rank in 0..{ranks - 1}, got {root}")
    d = Draft(NAME, ranks, 1, root=root)
    tiles, step = all_reduce(d, range(ranks), 0, 1, view_source(d), root=root)
    return finish(d, tiles, step)


def all_reduce(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
               root: int | None = None, step: int = 0) -> tuple[Tiles, int]:
    """``root`` (default: the first member) reduces every member's
    ``[lo, hi)`` and sends the result back to each (2 steps)."""
    members = tuple(members)
    root = members[0] if root is None else root
    total = d.reduce(root, lo, hi, [n for r in members for n in source(r, lo, hi)], step + 1, phases.REDUCE)
    out: Tiles = {root: [total]}
    for r in members:
        if r != root:
            out[r] = [d.gather(r, lo, hi, [total], step + 2, phases.BROADCAST)]
    return out, step + 2
