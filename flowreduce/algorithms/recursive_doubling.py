"""Recursive doubling: full vectors are exchanged, lg p steps.

At step s each rank swaps its whole partial result with the partner whose
rank differs in bit s, and both combine::

    step 1:  0 <-> 1    2 <-> 3        (every rank now holds a pair's sum)
    step 2:  0 <-> 2    1 <-> 3        (every rank holds all four)

``radix=k`` exchanges within groups of k at once (⌈log_k p⌉ steps, k-1
messages per rank per step); ``radix >= p`` is the direct all-to-all
exchange in a single step, the lowest latency a task graph can reach.
Ranks beyond the largest size that factors into stages of at most ``radix``
are folded: they join their partner's first step and copy its last.

Cost: ⌈log_k p⌉ steps, (k-1)·n bytes per rank per step on the wire,
(k-1)·n combined per step. Tasks: p·(log_k p + 1) per chunk. Best for small
vectors (MPICH uses it below a few KiB).

:func:`all_reduce` runs the pattern over any subset of ranks and segment
range (:mod:`~flowreduce.algorithms.patterns`), as
:mod:`~flowreduce.algorithms.hierarchical` does across hosts; :func:`plan`
runs it over all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan, folded, mixed_radix, with_digit
from flowreduce.algorithms.patterns import Source, Tiles, finish, view_source

NAME = "recursive-doubling"


def plan(ranks: int, *, radix: int = 2) -> Plan:
    d = Draft(NAME, ranks, 1, radix=radix)
    tiles, step = all_reduce(d, range(ranks), 0, 1, view_source(d), radix=radix)
    return finish(d, tiles, step)


def all_reduce(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
               radix: int = 2, step: int = 0) -> tuple[Tiles, int]:
    """Exchange whole ``[lo, hi)`` partials among ``members`` in
    ⌈log_k g⌉ steps; folded members join their partner's first step and
    repeat its last combine. One member alone makes a fresh copy."""
    members = tuple(members)
    core, factors = mixed_radix(len(members), radix)
    riders = folded(len(members), core)
    holding = {q: [n for r in [q, *riders[q]] for n in source(members[r], lo, hi)] for q in range(core)}
    if not factors:  # one member: a fresh copy
        return {members[0]: [d.reduce(members[0], lo, hi, holding[0], step + 1, phases.EXCHANGE)]}, step + 1
    last = dict(holding)
    for s, f in enumerate(factors):
        nxt = {}
        for q in range(core):
            last[q] = [n for g in (with_digit(q, factors, s, j) for j in range(f)) for n in holding[g]]
            nxt[q] = [d.reduce(members[q], lo, hi, last[q], step + s + 1, phases.EXCHANGE)]
        holding = nxt
    end = step + len(factors)
    out: Tiles = {members[q]: holding[q] for q in range(core)}
    for q in range(core):
        for e in riders[q]:  # a folded member repeats its partner's last combine
            out[members[e]] = [d.reduce(members[e], lo, hi, last[q], end, phases.EXCHANGE)]
    return out, end
