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
"""

from __future__ import annotations

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan

NAME = "tree"


def plan(ranks: int, *, fan_in: int = 2) -> Plan:
    if fan_in < 1:
        raise ValueError(f"tree fan_in must be at least 1, got {fan_in}")
    d = Draft(NAME, ranks, 1, fan_in=fan_in)
    views = [d.view(r) for r in range(ranks)]
    children = {i: [c for c in range(i * fan_in + 1, i * fan_in + fan_in + 1) if c < ranks]
                for i in range(ranks)}
    partial: dict[int, int] = {}
    height: dict[int, int] = {}
    for i in reversed(range(ranks)):  # children before parents
        kids = children[i]
        if kids or i == 0:  # the root always makes a fresh result
            height[i] = 1 + max((height[c] for c in kids), default=0)
            partial[i] = d.reduce(i, 0, 1, [views[i]] + [partial[c] for c in kids], height[i], phases.REDUCE)
        else:
            height[i], partial[i] = 0, views[i]
    final = {0: partial[0]}
    depth = {0: height[0]}
    for i in range(ranks):  # parents before children
        for c in children[i]:
            depth[c] = depth[i] + 1
            final[c] = d.gather(c, 0, 1, [final[i]], depth[c], phases.BROADCAST)
    return d.finish([final[r] for r in range(ranks)])
