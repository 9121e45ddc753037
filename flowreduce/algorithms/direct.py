"""Direct: every rank reads every other rank's input and reduces them all,
in one dependent level (the shortest all-reduce a task graph can be).

::

    rank:    0          1          2          3
    read:  1,2,3 ->   0,2,3 ->   0,1,3 ->   0,1,2 ->   (each reads its peers' inputs)
    reduce: x0+x1+x2+x3, the same sum in the same order on every rank

The plan is recursive doubling of radix p (a view per rank, then one
exchange), but it is lowered differently (:mod:`flowreduce.lower.direct`):
the reducing task depends only on its own rank's input and reads its peers'
inputs itself, worker to worker, as Dask's dependency fetch would, so the
views are not tasks and no scheduler round trip separates them from the
reduction. Ranks that share a worker are summed once by one task on that
worker, whose key is the result of all of them.

Every task sums all p inputs in one order, fixed by the ranks' workers
(each worker's ranks in rank order, then the workers in the order of their
first ranks; rank order when each rank has its own worker), so all results
are bitwise identical. The reducing task sees every input, so it also checks that the
ranks agree (shape, dtype, the op's dtype rules) and fails the call naming
the ranks: nothing has to be asked of the workers before the graph is
submitted.

Cost (:meth:`Plan.cost`, views fused into the reduction): one level, p
tasks (one per worker when ranks share workers), p-1 reads of n bytes per rank ((p-1)·n in and out), p·n bytes
combined per rank. Best for small vectors, where the level is all the cost;
the bytes grow as p²·n in total.
"""

from __future__ import annotations

from flowreduce import phases
from flowreduce.algorithms.ir import Draft, Plan

NAME = "direct"


def plan(ranks: int) -> Plan:
    d = Draft(NAME, ranks, 1)
    views = [d.view(r) for r in range(ranks)]
    finals = [d.reduce(r, 0, 1, views, 1, phases.READ_REDUCE) for r in range(ranks)]
    return d.finish(finals, fused_views=True)
