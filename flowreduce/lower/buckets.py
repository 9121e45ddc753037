"""Lower an all-reduce of many tensors per rank to one Dask graph. Imports
dask, never distributed.

Per bucket (:mod:`flowreduce.fusion`), per rank: a ``pack`` task copies the
bucket's tensors into one flat buffer; the bucket's dense all-reduce is the
ordinary lowered plan (:func:`flowreduce.lower.graph.build_graph`) over those
buffers; an ``unpack`` task per rank and input future cuts the reduced
buffers back into that future's structure (views, no copy). A bucket of one
tensor needs neither: its plan reads the tensor directly (through a small
inline task that takes it out of its future's value and, with a template,
checks it) and its output is the tensor's result.

Each pack depends only on the futures its tensors come from, so a bucket's
all-reduce starts as soon as those exist, whatever the rest of the call is
still waiting for.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from dask.task_spec import List, Task, TaskRef
from dask.typing import Key

from flowreduce import keys
from flowreduce.algorithms.ir import Plan
from flowreduce.fusion import Bucket, Layout
from flowreduce.kernels import fusion as _fusion_kernels
from flowreduce.lower.graph import build_graph
from flowreduce.ops import Op
from flowreduce.pytree import paths
from flowreduce.reproducible import tree_ordered


@dataclass
class BucketGraph:
    """One bucket's all-reduce inside a pytree graph."""

    bucket: Bucket
    plan: Plan
    token: str
    inputs: list[Hashable]  # per rank: the key whose value is the bucket's input (a user key or a pack key)
    outputs: list[Hashable]  # per rank: the reduced bucket


@dataclass
class PytreeGraph:
    """A lowered all-reduce of a pytree per rank: the tasks, the key of each
    rank's result per input future (``outputs[rank][j]``), where every task
    runs, and the buckets."""

    tasks: dict[Hashable, Task] = field(default_factory=dict)
    placement: dict[Hashable, str] = field(default_factory=dict)
    outputs: list[list[Hashable]] = field(default_factory=list)
    buckets: list[BucketGraph] = field(default_factory=list)


def build_pytree_graph(
    layout: Layout,
    buckets: Sequence[Bucket],
    plans: Sequence[Plan],
    inputs: Sequence[Sequence[Any]],
    workers: Sequence[str],
    *,
    op: Op,
    check: bool = False,
    in_place: bool = True,
    ordered: bool = False,
) -> PytreeGraph:
    """Lower buckets ``buckets`` (each with its plan in ``plans``) for rank
    inputs ``inputs[rank][j]`` (futures or TaskRefs, one per input future
    of the layout, in flatten order) on ``workers`` (one address per rank).

    ``check=True``: the first task that reads each input checks it against
    the layout (the caller's template) and raises, naming the rank and the
    tensor, on a mismatch. ``ordered``: ``deterministic=True``, buckets whose
    reduction depends on the order are summed in the reference tree's
    (:func:`flowreduce.reproducible.tree_ordered`)."""
    p = len(workers)
    if len(inputs) != p:
        raise ValueError(f"{len(inputs)} inputs for {p} workers")
    opaths = paths(layout.outer)
    specs_of = [tuple(layout.tensors[i].spec for i in layout.tensors_of(j)) for j in range(len(layout.inner))]
    where = {t: layout.tensors[t] for t in range(len(layout.tensors))}
    g = PytreeGraph(outputs=[[] for _ in range(p)])  # filled in input order, below
    located: dict[int, tuple[int, int]] = {}  # tensor -> (bucket, offset)

    for b, (bucket, plan) in enumerate(zip(buckets, plans)):
        token = keys.new_token()
        refs, in_keys = [], []
        for r in range(p):
            if not bucket.fused:
                t = where[bucket.tensors[0]]
                src = inputs[r][t.outer]
                if layout.inner[t.outer].is_leaf and not check and t.spec.native is None:
                    refs.append(src)  # the user's array itself, as in the plain all-reduce
                else:
                    refs.append(Task(None, _fusion_kernels.extract, src, t.inner, layout.inner[t.outer],
                                     specs_of[t.outer] if check else None, r, opaths[t.outer]))
                in_keys.append(src.key)
                continue
            outers, picks, sources = pack_sources(layout, bucket, specs_of, opaths, check)
            key = keys.pack_key(plan.algorithm, token, r)
            g.tasks[key] = Task(key, _fusion_kernels.pack, bucket.dtype, bucket.size,
                                List(*(inputs[r][j] for j in outers)), picks, sources, r)
            g.placement[key] = workers[r]
            refs.append(TaskRef(key))
            in_keys.append(key)
        shape = where[bucket.tensors[0]].spec.shape if not bucket.fused else (bucket.size,)
        graph = build_graph(plan, refs, workers, size=bucket.size, shape=shape, op=op, token=token,
                            in_place=in_place, accumulate=op.accumulator(np.dtype(bucket.dtype)),
                            ordered=ordered and tree_ordered(op.name, bucket.dtype))
        g.tasks.update(graph.tasks)
        g.placement.update(graph.placement)
        g.buckets.append(BucketGraph(bucket, plan, token, in_keys, graph.outputs))
        for i, off in zip(bucket.tensors, bucket.offsets):
            located[i] = (b, off)

    for j, structure in enumerate(layout.inner):
        mine = layout.tensors_of(j)
        first = located[mine[0]][0] if mine else 0
        if structure.is_leaf and not buckets[first].fused and layout.tensors[mine[0]].spec.native is None:
            for r in range(p):
                g.outputs[r].append(g.buckets[first].outputs[r])
            continue
        used, parts = unpack_cuts(layout, located, j)
        bg = g.buckets[used[0]] if used else g.buckets[0]
        for r in range(p):
            key = keys.unpack_key(bg.plan.algorithm, bg.token, r, j)
            g.tasks[key] = Task(key, _fusion_kernels.unpack, structure,
                                List(*(TaskRef(cast(Key, g.buckets[b].outputs[r])) for b in used)), parts)
            g.placement[key] = workers[r]
            g.outputs[r].append(key)
    return g


def pack_sources(layout: Layout, bucket: Bucket, specs_of: Sequence[tuple[Any, ...]], opaths: Sequence[str],
                 check: bool) -> tuple[list[int], tuple[tuple[int, int, int, int], ...], tuple[Any, ...]]:
    """What a fused bucket's pack task (:func:`flowreduce.kernels.fusion.pack`)
    reads of one rank: the input futures (their indices among the rank's
    inputs), where each of the bucket's tensors is in them and goes in the
    buffer, and each input's structure (its tensors' specs too when
    ``check``: a template's, checked naming the rank) and path."""
    outers = sorted({layout.tensors[i].outer for i in bucket.tensors})
    slot = {j: v for v, j in enumerate(outers)}
    picks = tuple((slot[layout.tensors[i].outer], layout.tensors[i].inner, off, layout.tensors[i].spec.size)
                  for i, off in zip(bucket.tensors, bucket.offsets))
    sources = tuple((layout.inner[j], specs_of[j] if check else None, opaths[j]) for j in outers)
    return outers, picks, sources


def unpack_cuts(layout: Layout, located: dict[int, tuple[int, int]], j: int
                ) -> tuple[list[int], tuple[tuple[Any, ...], ...]]:
    """What input ``j``'s unpack task (:func:`flowreduce.kernels.fusion.unpack`)
    cuts out of the reduced buffers (``located``: tensor -> (bucket, offset)):
    the buckets it reads, and per tensor the buffer, offset, size, shape and kind."""
    mine = layout.tensors_of(j)
    used = sorted({located[i][0] for i in mine})
    slot = {b: v for v, b in enumerate(used)}
    parts = tuple((slot[located[i][0]], located[i][1], layout.tensors[i].spec.size, layout.tensors[i].spec.shape,
                   layout.tensors[i].spec.native) for i in mine)
    return used, parts
