"""k-ary tree reduce, then the same tree in reverse as a broadcast.

Ranks sit in a heap: rank i's children are i·k+1 … i·k+k (``fan_in`` = k)::

                 0            reduce: leaves send up, each parent combines
              /  |  \\          its own vector with its children's partials
            1    2    3       broadcast: the root's result flows back down
           /|\\
          4 5 6 ...

Cost with depth h = ⌈log_k((k-1)p+1)⌉-1: 2h steps, 2(p-1) messages of n
bytes; an inner rank's link carries k·n in and k·n out. Tasks ≈ 2p per chunk.
``fan_in=p`` is reduce-broadcast; ``fan_in=2`` the classic binary tree.
Registered as ``"tree"``; the module says ``kary_tree`` so that it is never
taken for a pytree (:mod:`flowreduce.pytree`). :func:`all_reduce` runs the
pattern over any subset of ranks and segment range
(:mod:`~flowreduce.algorithms.patterns`); :func:`plan` runs it over all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan
from flowreduce.algorithms.patterns import Source, Tiles, finish, view_source

NAME = "tree"


def plan(ranks: int, *, fan_in: int = 2) -> Plan:
    if fan_in < 1:
        raise ValueError(f"tree fan_in must be at least 1, got {fan_in}")
    d = Draft(NAME, ranks, 1, fan_in=fan_in)
    tiles, step = all_reduce(d, range(ranks), 0, 1, view_source(d), fan_in=fan_in)
    return finish(d, tiles, step)


def all_reduce(d: Draft, members: Sequence[int], lo: int, hi: int, source: Source, *,
               fan_in: int = 2, step: int = 0) -> tuple[Tiles, int]:
    """Reduce ``[lo, hi)`` up the heap of ``members`` (member i's children
    are members i·k+1 … i·k+k), then broadcast the first member's result
    back down the same tree."""
    members = tuple(members)
    g = len(members)
    views = [source(members[i], lo, hi) for i in range(g)]
    children = {i: [c for c in range(i * fan_in + 1, i * fan_in + fan_in + 1) if c < g] for i in range(g)}
    partial: dict[int, list[int]] = {}
    height: dict[int, int] = {}
    for i in reversed(range(g)):  # children before parents
        kids = children[i]
        if kids or i == 0:  # the root always makes a fresh result
            height[i] = 1 + max((height[c] for c in kids), default=0)
            partial[i] = [d.reduce(members[i], lo, hi, [*views[i], *(n for c in kids for n in partial[c])],
                                   step + height[i], phases.REDUCE)]
        else:
            height[i], partial[i] = 0, views[i]
    final = {0: partial[0]}
    depth = {0: height[0]}
    for i in range(g):  # parents before children
        for c in children[i]:
            depth[c] = depth[i] + 1
            final[c] = [d.gather(members[c], lo, hi, final[i], step + depth[c], phases.BROADCAST)]
    return {members[i]: final[i] for i in range(g)}, step + max(depth.values())
