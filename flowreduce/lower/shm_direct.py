"""Lower the ``shm-direct`` plan over shared memory: three tasks deep on one
host. Imports dask, never distributed.

Level 1, one task per worker: its ranks' inputs reduced into a pooled
segment (the plan's views and pre-reduce, fused). Level 2, one task per
worker: its slice reduced over every worker's segment, read in place, and
written back into its own segment. Level 3, one task per rank: its result,
a fresh array copied from every worker's slice. Dask edges carry handles of
a few hundred bytes; every task is pinned to its worker, so the scheduler
still orders everything (a reader runs only after the writer's key exists,
and a segment is reused only after its key's readers are done).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from dask.task_spec import List, Task, TaskRef

from flowreduce import keys
from flowreduce.algorithms.ir import Plan
from flowreduce.kernels import shm as shm_kernels
from flowreduce.lower.graph import Graph, chunk_bounds
from flowreduce.ops import Op


def worker_groups(workers: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by worker, in order of each worker's first rank."""
    groups: dict[str, list[int]] = {}
    for r, w in enumerate(workers):
        groups.setdefault(w, []).append(r)
    return list(groups.values())


def build_direct(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], *, size: int,
                 shape: tuple[int, ...], dtype: np.dtype, op: Op, accumulate: Any = None,
                 token: str | None = None, ordered: bool = False) -> Graph:
    """The graph of ``plan`` (``shm-direct`` with its ``groups`` the ranks of
    each worker) for rank inputs ``inputs`` held on ``workers``.
    ``ordered`` (``deterministic=True``): each rank's input has its own
    segment, and each slice is summed over the ranks in the reference
    tree's order (:func:`flowreduce.kernels.shm.reduce_slice_ordered`)."""
    if ordered:
        return _build_ordered(plan, inputs, workers, size=size, shape=shape, dtype=dtype, op=op, token=token)
    groups = [list(g) for g in plan.options.get("groups") or [[r] for r in range(plan.ranks)]]
    if groups != worker_groups(workers):
        raise ValueError(f"shm-direct plan groups {groups} are not the ranks of each worker "
                         f"{worker_groups(workers)}")
    token = token or keys.new_token()
    name, p = plan.algorithm, plan.ranks
    wdtype = np.dtype(accumulate or dtype)
    tasks: dict = {}
    placement: dict = {}
    written, scattered = [], []
    for g, ranks in enumerate(groups):
        key = keys.node_key(name, "reduce", token, 1, ranks[0], 0, g)
        tasks[key] = Task(key, shm_kernels.write, op, wdtype, List(*(inputs[r] for r in ranks)), len(groups) > 1,
                          repr(key), token)
        placement[key] = workers[ranks[0]]
        written.append(key)
    for g, (ranks, (lo, hi)) in enumerate(zip(groups, chunk_bounds(size, len(groups)))):
        key = keys.node_key(name, "reduce-scatter", token, 2, ranks[0], 0, g)
        order = [written[g]] + [k for j, k in enumerate(written) if j != g]  # its own segment first
        tasks[key] = Task(key, shm_kernels.reduce_slice, op, p, lo, hi, List(*(TaskRef(k) for k in order)),
                          repr(key))
        placement[key] = workers[ranks[0]]
        scattered.append(key)
    return _with_outputs(tasks, placement, name, token, p, op, shape, wdtype, scattered, workers)


def _build_ordered(plan: Plan, inputs: Sequence[Any], workers: Sequence[str], *, size: int,
                   shape: tuple[int, ...], dtype: np.dtype, op: Op, token: str | None) -> Graph:
    """:func:`build_direct` with ``ordered=True``: level 1 writes each rank's
    input (not its worker's sum: a worker's ranks need not be a subtree of
    the reference tree), level 2 sums every rank's slice in the tree order."""
    groups = worker_groups(workers)
    token = token or keys.new_token()
    name, p = plan.algorithm, plan.ranks
    tasks: dict = {}
    placement: dict = {}
    written = []
    for r in range(p):
        key = keys.node_key(name, "reduce", token, 1, r, 0, r)
        tasks[key] = Task(key, shm_kernels.write, op, dtype, List(inputs[r]), len(groups) > 1, repr(key), token)
        placement[key] = workers[r]
        written.append(key)
    scattered = []
    for g, (ranks, (lo, hi)) in enumerate(zip(groups, chunk_bounds(size, len(groups)))):
        key = keys.node_key(name, "reduce-scatter", token, 2, ranks[0], 0, p + g)
        tasks[key] = Task(key, shm_kernels.reduce_slice_ordered, op, p, lo, hi,
                          List(*(TaskRef(k) for k in written)), ranks[0], repr(key))
        placement[key] = workers[ranks[0]]
        scattered.append(key)
    return _with_outputs(tasks, placement, name, token, p, op, shape, dtype, scattered, workers)


def _with_outputs(tasks: dict, placement: dict, name: str, token: str, p: int, op: Op, shape: tuple[int, ...],
                  dtype: np.dtype, scattered: Sequence[Any], workers: Sequence[str]) -> Graph:
    """The graph with each of the ``p`` ranks' outputs: every reduced slice gathered into its result,
    on its worker."""
    outputs = [keys.output_key(name, token, r) for r in range(p)]
    for r, key in enumerate(outputs):
        tasks[key] = Task(key, shm_kernels.gather, op, p, shape, dtype, List(*(TaskRef(k) for k in scattered)),
                          repr(key))
        placement[key] = workers[r]
    return Graph(tasks, outputs, placement, token)
