"""Shared-memory direct: the one-level intra-host collective.

Ranks that share a worker are first reduced on it (one task); then, with G
workers on one host, the vector is cut into G segments and every worker
reduces its own segment by reading every peer's buffer at once
(reduce-scatter in one level), and every rank copies all G finished
segments (all-gather in one level)::

    worker:     w0        w1        w2        w3
    reduce:   r0+r4     r1+r5     r2+r6     r3+r7     (ranks sharing a worker)
    scatter:  seg0<-*   seg1<-*   seg2<-*   seg3<-*   (reads every peer)
    gather:   r0,r4<-*  r1,r5<-*  r2,r6<-*  r3,r7<-*  (reads every segment)

On one host the peers' buffers are POSIX shared memory
(:mod:`flowreduce.build.shm_direct` lowers the plan that way: the pre-reduce
writes into a pooled segment, so three dependent tasks in all); with
``transport="dask"`` the same plan runs over Dask's comm, an all-to-all.

Cost: 3 levels (the views and the pre-reduce fuse into one task when
lowered over shared memory), (G-1)/G·n bytes per worker each way (as ring),
G(G-1) messages per phase; tasks: one per worker per phase plus one per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowreduce.algorithms.ir import Draft, Plan

NAME = "shm-direct"


def plan(ranks: int, *, groups: Sequence[Sequence[int]] | None = None) -> Plan:
    """``groups``: the ranks of each worker (default: a worker per rank).
    The first rank of a group holds its worker's partial results."""
    p = ranks
    groups = [list(g) for g in groups] if groups is not None else [[r] for r in range(p)]
    if sorted(r for g in groups for r in g) != list(range(p)) or any(not g for g in groups):
        raise ValueError(f"groups must split ranks 0..{p - 1} into non-empty groups, got {groups}")
    G = len(groups)
    d = Draft(NAME, p, G, **({"groups": groups} if G < p else {}))
    views = {r: d.view(r) for r in range(p)}
    local = [views[g[0]] if len(g) == 1 else d.reduce(g[0], 0, G, [views[r] for r in g], 1, "reduce")
             for g in groups]
    scattered = [d.reduce(g[0], s, s + 1, local, 2, "reduce-scatter") for s, g in enumerate(groups)]
    finals = [d.gather(r, 0, G, scattered, 3, "all-gather") for r in range(p)]
    return d.finish(finals)
