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
(:mod:`flowreduce.lower.shm_direct` lowers the plan that way: the pre-reduce
writes into a pooled segment, so three dependent tasks in all); with
``transport="dask"`` the same plan runs over Dask's comm, an all-to-all.

Cost: 3 levels (4 with ranks sharing a worker), (G-1)/G·n bytes per
worker each way (as ring), G(G-1) messages per phase. The plan has a view
per rank and segment (so over Dask's comm a peer fetches only its segment);
lowered over shared memory, the views and the pre-reduce fuse into one task
per worker: 2 tasks per worker and one per rank, 3 levels in all.
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
    # per-segment views, so over Dask's comm each peer fetches only its segment
    views = {r: [d.view(r, s, s + 1) for s in range(G)] for r in range(p)}
    local = [[views[g[0]][s] if len(g) == 1 else d.reduce(g[0], s, s + 1, [views[r][s] for r in g], 1, "reduce")
              for s in range(G)] for g in groups]
    scattered = [d.reduce(g[0], s, s + 1, [local[h][s] for h in range(G)], 2, "reduce-scatter")
                 for s, g in enumerate(groups)]
    finals = [d.gather(r, 0, G, scattered, 3, "all-gather") for r in range(p)]
    return d.finish(finals)
