"""Reduce to one root, then broadcast: what users write by hand today.

::

    step 1   r1 --\\
             r2 ---> root: reduce all p vectors
             r3 --/
    step 2   root --> r1, r2, r3 (the whole result to each)

Cost: 2 steps; the root's link carries (p-1)·n in and (p-1)·n out;
the root combines (p-1)·n bytes alone. Tasks: 2p per chunk.
"""

from __future__ import annotations

from flowreduce.algorithms.ir import Draft, Plan

NAME = "reduce-broadcast"


def plan(ranks: int, *, root: int = 0) -> Plan:
    if not 0 <= root < ranks:
        raise ValueError(f"root must be a rank in 0..{ranks - 1}, got {root}")
    d = Draft(NAME, ranks, 1, root=root)
    views = [d.view(r) for r in range(ranks)]
    total = d.reduce(root, 0, 1, views, 1, "reduce")
    finals = [
        total if r == root else d.gather(r, 0, 1, [total], 2, "broadcast")
        for r in range(ranks)
    ]
    return d.finish(finals)
