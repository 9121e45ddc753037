"""Lower ``hierarchical`` with ``inner="shm-direct"`` over shared memory
inside each host, Dask's comm between hosts. Imports dask, never distributed.

The plan (:func:`flowreduce.algorithms.hierarchical.direct_inner`) lists
views and pre-reductions per range so that any lowering moves exact ranges;
here they fuse into one task per worker, as in
:mod:`flowreduce.lower.shm_direct`:

1. per worker, its ranks' inputs reduced into a pooled segment (``write``);
2. per worker and range it owns, that range reduced over its host's
   segments, read in place (``reduce_range``): the plan's reduce-scatter
   nodes, whose values go to other hosts as plain copies;
3. the inter-host algorithm's nodes, as :func:`flowreduce.lower.graph.build_graph`
   lowers them (Dask's comm: they cross hosts);
4. per worker, its finished slice copied into a segment (``publish_slice``),
   or reduced straight into one when the inter-host algorithm ends in one
   reduction there (``reduce_published``: a level and a copy fewer);
5. per rank, its result copied from its host's finished slices (``gather``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from dask.task_spec import List, Task, TaskRef

from flowreduce import keys
from flowreduce.algorithms.hierarchical import direct_fused
from flowreduce.algorithms.ir import VIEW, Plan
from flowreduce.kernels import shm as shm_kernels
from flowreduce.lower.graph import Graph, build_graph, chunk_bounds, contributions
from flowreduce.ops import Op


def node_keys(plan: Plan, token: str) -> list[Any]:
    """The key of every node, as :func:`flowreduce.lower.graph.lower` names
    them (one chunk; a final read by nobody else is its rank's output)."""
    out = []
    merged = {f: r for r, f in enumerate(plan.finals) if not plan.output_is_separate(r)}
    for n in plan.nodes:
        r = merged.get(n.id)
        out.append(keys.output_key(plan.algorithm, token, r) if r is not None
                   else keys.node_key(plan.algorithm, n.phase, token, n.step, n.rank, 0, n.id))
    return out


def build_hierarchical(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], *, size: int,
                       shape: tuple[int, ...], dtype: np.dtype, op: Op, in_place: bool = True,
                       accumulate: Any = None, token: str | None = None) -> Graph:
    """The graph of ``plan`` (hierarchical, ``inner="shm-direct"``, one
    chunk) for rank inputs ``inputs`` held on ``workers``; each host's
    workers must share memory (the caller decides: :mod:`flowreduce.schedule.routes`)."""
    if plan.options.get("inner") != "shm-direct" or plan.chunks != 1:
        raise ValueError(f"{plan!r} is not hierarchical with inner='shm-direct' on one chunk")
    procs = plan.options.get("workers") or [[r] for r in range(plan.ranks)]
    held_by = {w[0]: list(w) for w in procs}
    if any(len({workers[r] for r in w}) != 1 for w in procs) or len({workers[w[0]] for w in procs}) != len(procs):
        raise ValueError(f"plan's workers {procs} are not the ranks of each worker {list(workers)}")
    token = token or keys.new_token()
    generic = build_graph(plan, inputs, workers, size=size, shape=shape, op=op, token=token, in_place=in_place,
                          accumulate=accumulate)
    name, p, nodes = plan.algorithm, plan.ranks, plan.nodes
    wdtype = np.dtype(accumulate or dtype)
    final_dtype = op.finish(np.zeros(1, wdtype), p, owned=False).dtype
    key_of = node_keys(plan, token)
    count = contributions(plan)
    host_of = {r: h for h, g in enumerate(plan.options["groups"]) for r in g}
    last = max(n.step for n in nodes)
    bounds = chunk_bounds(size, 1)[0]
    S = plan.segments

    def elem(s: int) -> int:
        return bounds[0] + (bounds[1] - bounds[0]) * s // S

    tasks = dict(generic.tasks)
    placement = dict(generic.placement)
    fused = direct_fused(plan)  # publishes the outer algorithm's last reduction does itself
    written: dict[int, Any] = {}
    for leader, ranks in held_by.items():  # level 1
        key = keys.node_key(name, "reduce", token, 1, leader, 0, -1 - leader)
        shares = sum(1 for w in procs if host_of[w[0]] == host_of[leader]) > 1
        tasks[key] = Task(key, shm_kernels.write, op, wdtype, List(*(inputs[r] for r in ranks)), shares,
                          repr(key), token)
        placement[key] = workers[leader]
        written[leader] = key
    for n in nodes:
        key = key_of[n.id]
        if n.kind == VIEW or n.step == 1:  # fused into the worker's write
            del tasks[key], placement[key]
        elif n.step == 2:  # the host's part of a range, read in place
            order = [nodes[i].rank for i in n.inputs]
            tasks[key] = Task(key, shm_kernels.reduce_range, op, p, elem(n.lo), elem(n.hi), count[n.id] == p,
                              List(*(TaskRef(written[w]) for w in order)), repr(key))
        elif n.step == last - 1 and n.id in fused:  # the reduction writes into the segment itself
            src = key_of[fused[n.id]]
            tasks[src] = Task(src, shm_kernels.reduce_published, *generic.tasks[src].args, repr(src), token)
            del tasks[key], placement[key]
        elif n.step == last - 1:  # a worker's finished slice, published to its host
            site = generic.tasks[key]
            tasks[key] = Task(key, shm_kernels.publish_slice, *_deps_and_picks(site), repr(key), token)
        elif n.step == last:  # a rank's result
            slices = [key_of[fused.get(i, i)] for i in n.inputs]
            tasks[key] = Task(key, shm_kernels.gather, op, p, shape, final_dtype,
                              List(*(TaskRef(k) for k in slices)), repr(key), False)
    return Graph(tasks, generic.outputs, placement, token)


def _deps_and_picks(task: Task) -> tuple[Any, Any]:
    """A generic gather task's inputs and picks (``kernels.gather(shape, deps, picks)``)."""
    return task.args[1], task.args[2]
