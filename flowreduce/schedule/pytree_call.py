"""``allreduce`` of pytrees and of inputs that are not computed yet (the
schedule layer's part of tensor fusion; :func:`flowreduce.schedule.allreduce`
routes here).

Two ways to learn what the ranks hold:

* no template: wait for the inputs, ask the workers what they hold (the same
  broadcast as the plain all-reduce) and check upfront that the ranks agree
  tensor by tensor;
* a template (``like=``): place each rank from the scheduler's view of its
  futures (:mod:`flowreduce.schedule.placement`), take shapes and dtypes from the
  template, and let the first task of each rank check its input.

Then buckets (:mod:`flowreduce.fusion`), a plan per bucket, one graph for
the whole call (:mod:`flowreduce.build.buckets`), one submission.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import dask
import numpy as np

from flowreduce.build.buckets import build_tree_graph
from flowreduce.fusion import Layout, make_buckets
from flowreduce.ops import Op
from flowreduce.pytree import LEAF, TensorSpec, TreeDef, flatten, leaves_as, paths, same_structure, unflatten
from flowreduce.schedule import placement as _pending

logger = logging.getLogger("flowreduce")


@dataclass(frozen=True)
class Settings:
    """The call's options that decide plans and buckets."""

    op: Op
    algorithm: str
    chunks: int | None
    chunk_bytes: int | None
    model: Any
    options: dict
    bucket_bytes: int | None
    topology: Any = None


def rank_futures(inputs: list[Any]) -> tuple[TreeDef, list[list[Any]]]:
    """The structure of every rank's futures and, per rank, its futures in
    that structure's order.

    Raises
    ------
    TypeError
        A leaf that is not a Future (naming the rank and where).
    ValueError
        Ranks whose futures are arranged differently.
    """
    from distributed import Future

    trees, leaves_by_rank = [], []
    for r, x in enumerate(inputs):
        leaves, tree = ([x], LEAF) if isinstance(x, Future) else flatten(x)
        for path, f in zip(paths(tree), leaves):
            if not isinstance(f, Future):
                at = f" at {path}" if path else ""
                raise TypeError(f"input of rank {r}{at} is a {type(f).__name__}, not a distributed.Future; "
                                "scatter or submit it first")
        trees.append(tree)
        leaves_by_rank.append(leaves)
    outer = trees[0]
    groups: dict[TreeDef, list[int]] = {}
    for r, t in enumerate(trees):
        key = next((g for g in groups if same_structure(g, t)), t)
        groups.setdefault(key, []).append(r)
    if len(groups) > 1:
        detail = "; ".join(f"ranks {rs}: {t}" for t, rs in groups.items())
        raise ValueError(f"ranks disagree on the structure of their inputs: {detail}")
    ranks = [leaves if t == outer else leaves_as(x, outer) for x, t, leaves in zip(inputs, trees, leaves_by_rank)]
    return outer, ranks


def allreduce_tree(client: Any, outer: TreeDef, ranks: list[list[Any]], like: Any, settings: Settings) -> list:
    """A pytree all-reduce: from a template without waiting, else after
    waiting for the inputs and checking them."""
    if like is not None:
        layout = Layout.from_template(outer, like)
        workers = _pending.place(client, ranks)
        cpus = _pending.worker_places(client, workers)
        return _submit(client, layout, ranks, workers, cpus, settings, check=True)
    from flowreduce.schedule import call as schedule

    flat = [f for fs in ranks for f in fs]
    _pending.wait_on(client, flat)
    _pending._check_status(ranks)
    located, cpus = schedule._locate(client, flat)
    per_rank, workers, i = [], [], 0
    for fs in ranks:
        mine = located[i:i + len(fs)]
        i += len(fs)
        per_rank.append([m for _, m in mine])
        workers.append(Counter(w for w, _ in mine).most_common(1)[0][0])
    return _submit(client, layout_from_metas(outer, per_rank), ranks, workers, cpus, settings, check=False)


def allreduce_located(client: Any, outer: TreeDef, ranks: list[list[Any]], workers: list[str], metas: list,
                      cpus: dict, settings: Settings) -> list:
    """One future per rank, already located, some holding pytrees."""
    return _submit(client, layout_from_metas(outer, [[m] for m in metas]), ranks, workers, cpus, settings,
                   check=False)


def layout_from_metas(outer: TreeDef, metas: list[list[tuple | None]]) -> Layout:
    """The tensors every rank holds, from what the workers reported
    (``metas[rank][j]`` for the rank's ``j``-th future).

    Raises
    ------
    TypeError
        A value that is not an array or a pytree of arrays (naming the ranks).
    ValueError
        Ranks disagreeing on structure, shapes or dtypes (naming the ranks
        and the tensor).
    """
    opaths = paths(outer)
    inner: list[TreeDef] = []
    specs: list[list[TensorSpec]] = []
    for j in range(outer.num_leaves):
        trees, by_path = [], []
        bad: dict[int, str] = {}
        leaves_bad: dict[int, str] = {}
        for r, rank_metas in enumerate(metas):
            m = rank_metas[j]
            if m is None:
                bad[r] = "missing"
                continue
            if m[0] == "ndarray":
                tree, leaf_metas = LEAF, (m,)
            elif m[0] == "pytree":
                tree, leaf_metas = m[1], m[2]
            else:
                bad[r] = m[0]
                continue
            odd = [f"{lm[0]} at {p}" for p, lm in zip(paths(tree), leaf_metas) if lm[0] != "ndarray"]
            if odd:
                bad[r] = tree.node_type.__name__ if tree.node_type is not None else tree.kind
                leaves_bad[r] = odd[0]
            trees.append((r, tree))
            by_path.append((r, dict(zip(paths(tree), leaf_metas))))
        where = f" (input {opaths[j]})" if opaths[j] else ""
        if bad:
            detail = "".join(f"; rank {r}: {what}" for r, what in leaves_bad.items())
            raise TypeError(f"inputs must be numpy arrays or pytrees of them{where}; ranks {sorted(bad)} hold "
                            f"{bad}{detail}")
        groups: dict[TreeDef, list[int]] = {}
        for r, t in trees:
            key = next((g for g in groups if same_structure(g, t)), t)
            groups.setdefault(key, []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"ranks {rs}: {t}" for t, rs in groups.items())
            raise ValueError(f"ranks disagree on structure{where}: {detail}")
        tree = trees[0][1]
        leaf_specs = []
        for p in paths(tree):
            seen: dict[TensorSpec, list[int]] = {}
            for r, d in by_path:
                _, shape, *dt_native = d[p]  # native: a tensor's library, dtype and device (flowreduce.arrays)
                seen.setdefault(TensorSpec(tuple(shape), *dt_native), []).append(r)
            if len(seen) > 1:
                what = "shapes" if len({s.shape for s in seen}) > 1 else "dtypes"
                detail = "; ".join(f"ranks {rs}: {s}" for s, rs in seen.items())
                raise ValueError(f"ranks disagree on {what} of tensor {opaths[j] + p}: {detail}")
            (leaf_spec,) = seen
            leaf_specs.append(leaf_spec)
        inner.append(tree)
        specs.append(leaf_specs)
    return Layout.from_specs(outer, inner, specs)


def _check_dtypes(layout: Layout, op: Op) -> None:
    for t in layout.tensors:
        dtype = np.dtype(t.spec.dtype)
        if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
            raise TypeError(f"inputs must have a numeric or boolean dtype, got {dtype} (tensor {t.path or '0'})")
        if op.mean and dtype == np.bool_:
            raise TypeError("op='mean' of boolean arrays is ambiguous; cast them to a number type first "
                            f"(tensor {t.path or '0'})")


def _submit(client: Any, layout: Layout, ranks: list[list[Any]], workers: list[str], cpus: dict,
            settings: Settings, check: bool) -> list:
    """Buckets, a plan per bucket, one graph, one submission; records."""
    from flowreduce.schedule import call as schedule
    from flowreduce.schedule.guard import ensure_guard
    from flowreduce.tracing import registry

    if not layout.tensors:
        raise ValueError("nothing to reduce: the inputs hold no arrays")
    _check_dtypes(layout, settings.op)
    buckets = make_buckets([t.spec for t in layout.tensors], settings.bucket_bytes)
    p = len(ranks)
    levels = schedule.rank_groups(client, workers, cpus, settings.topology)
    chosen = [schedule.choose_plan(p, b.nbytes, workers, cpus, settings, levels) for b in buckets]
    in_place = not any(w.startswith("inproc://") for w in workers)
    g = build_tree_graph(layout, buckets, [plan for plan, _ in chosen], ranks, workers, op=settings.op,
                         check=check, in_place=in_place)
    ensure_guard(client)
    keys = [k for row in g.outputs for k in row]
    # priority: a rank's single thread runs a bucket's pack and reductions as soon as they are
    # ready, ahead of the backward tasks submitted before (dask favours older graphs otherwise),
    # so the reduction of the last layers' bucket overlaps the first layers' backward pass
    with dask.annotate(workers=g.placement.get, allow_other_workers=False):
        futures = client.get(schedule.named_graph(g.tasks, g.buckets[0].token), keys, sync=False, priority=1)
    n = len(layout.inner)
    results = [unflatten(layout.outer, futures[r * n:(r + 1) * n]) for r in range(p)]

    infos = []
    for bg, (plan, model) in zip(g.buckets, chosen):
        b = bg.bucket
        shape = (b.size,) if b.fused else layout.tensors[b.tensors[0]].spec.shape
        info = schedule.CallInfo(plan, b.nbytes, model.predict(plan, b.nbytes, levels[0]), bg.token, tuple(workers),
                                 tuple(shape), b.dtype)
        schedule._remember(schedule._CALLS, bg.token, info)
        infos.append(info)
        registry.note_call(client, registry.Call(bg.token, plan.algorithm, plan, b.nbytes, info.predicted,
                                                 tuple(workers), tuple(bg.inputs)))
    if not layout.single_array:
        bucket_of = [0] * len(layout.tensors)
        for i, b in enumerate(buckets):
            for t in b.tensors:
                bucket_of[t] = i
        tree = schedule.TreeCallInfo(
            tuple(infos), tuple((t.path, t.spec.shape, t.spec.dtype) for t in layout.tensors), tuple(bucket_of),
            settings.bucket_bytes, tuple(workers))
        for info in infos:
            schedule._remember(schedule._TREES, info.token, tree)
    logger.info("allreduce of %d tensors in %d buckets: %d ranks, %d bytes each, %d tasks", len(layout.tensors),
                len(buckets), p, sum(b.nbytes for b in buckets), len(g.tasks))
    return results
