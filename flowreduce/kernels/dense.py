"""The functions tasks run on workers. numpy (and dask's sizeof); the builder decides the
slicing statically and passes it in, so these stay small and dumb.

A node's value is a tuple of 1-D arrays ("pieces") whose layout the builder
knows; ``picks`` say which element slices of which pieces form one input.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from dask.sizeof import sizeof

from flowreduce.ops import FOLD_BLOCK_BYTES, Op
from flowreduce.reproducible import TreeNode, exact_fold, tree_leaf, tree_merge, tree_parent

#: A node's value: 1-D arrays whose layout the builder knows.
Pieces = tuple[np.ndarray, ...]
#: ``(piece, start, stop)``: elements ``start:stop`` of one piece.
Pick = tuple[int, int, int]


class Views(tuple):
    """Pieces that are zero-copy views of a rank's input on its own worker.

    Dask's memory manager sizes a value by its arrays' ``nbytes``, so it would
    count a view of an 800 MB input as another 800 MB, and start spilling
    (writing the view to disk frees nothing: the input still holds the
    memory). Views count as a few bytes instead. Pickled (sent to another
    worker, or spilled), they become a plain tuple of real copies, which
    count in full where they land.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[type[tuple], tuple[tuple[np.ndarray, ...]]]:
        return (tuple, (tuple(self),))


@sizeof.register(Views)
def _sizeof_views(x: Views) -> int:
    return 64 * len(x)


def split(x: Any, start: int, stop: int, dtype: np.dtype | None = None) -> Pieces:
    """A zero-copy view of the rank's flattened input (a cast copy when the
    op accumulates in a wider dtype)."""
    x = np.asarray(x)
    view = x.reshape(-1)[start:stop]
    if dtype is not None:
        return (view.astype(dtype),)
    return Views((view,)) if np.may_share_memory(view, x) else (view,)


def _pick(value: Pieces, picks: Sequence[Pick]) -> np.ndarray:
    parts = [value[i][a:b] for i, a, b in picks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def reduce(op: Op, ranks: int, finish: bool, shape: tuple[int, ...] | None, inputs: Sequence[Pieces],
           picks: Sequence[Sequence[Pick]], owned: Sequence[bool]) -> Pieces | np.ndarray:
    """Combine inputs over one range; accumulate into a received buffer that
    no other task on this worker reads (``owned``), else into a fresh one."""
    arrays = [_pick(v, p) for v, p in zip(inputs, picks)]
    acc_i = next((i for i, o in enumerate(owned) if o and arrays[i].flags.writeable), None)
    if len(arrays) == 1:
        acc = arrays[0] if acc_i is not None else arrays[0].copy()
    elif acc_i is not None and op.in_place:
        acc = arrays[acc_i]
        for i, a in enumerate(arrays):
            if i != acc_i:
                acc = op.combine(acc, a, out=acc)
    else:
        acc = op.combine(arrays[0], arrays[1])
        own = op.in_place and isinstance(acc, np.ndarray)
        for a in arrays[2:]:
            acc = op.combine(acc, a, out=acc if own else None)
    acc = np.asarray(acc)
    if finish:
        acc = op.finish(acc, ranks, owned=True)
    out = (acc,)
    return out if shape is None else output((out,), shape)


def reduce_ordered(op: Op, ranks: int, finish: bool, shape: tuple[int, ...] | None, inputs: Sequence[Pieces],
                   picks: Sequence[Sequence[Pick]], owned: Sequence[bool],
                   nodes: Sequence[Sequence[TreeNode]]) -> Pieces | np.ndarray:
    """:func:`reduce` in the fixed order of ``deterministic=True``: each
    input carries partial sums, one per node of the reference tree
    (``nodes[i][j]``: the tree node of pick ``picks[i][j]``; the picks of a
    node, in order, make its range), and they are added only as siblings
    (:func:`flowreduce.reproducible.tree_merge`). The value: the partial
    sums left, one piece each over the whole range, in the order of their
    nodes (the builder computes the same list). An exact op
    (``deterministic="exact"``) takes every rank's own values at once (a
    plan that gathers them, :func:`flowreduce.lower.graph.gathers_every_rank`)
    and folds them with :func:`flowreduce.reproducible.exact_fold`."""
    if op.exact:
        return _fold_exactly(op, ranks, shape, inputs, picks, nodes)
    parts: dict[TreeNode, np.ndarray] = {}
    mine: set[int] = set()  # ids of arrays this task may write into
    for value, ps, ns, own in zip(inputs, picks, nodes, owned):
        by_node: dict[TreeNode, list[np.ndarray]] = {}
        for (i, a, b), node in zip(ps, ns):
            by_node.setdefault(node, []).append(value[i][a:b])
        for node, arrays in by_node.items():
            if len(arrays) > 1:
                arr = np.concatenate(arrays)
                mine.add(id(arr))
            else:
                arr = arrays[0]
                if own and arr.flags.writeable:
                    mine.add(id(arr))
            parts[node] = arr

    def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = a if id(a) in mine else b if id(b) in mine else None
        acc = np.asarray(op.combine(a, b, out=out))
        mine.add(id(acc))
        return acc

    merged = tree_merge(ranks, parts, add)
    out = tuple(a if id(a) in mine else a.copy() for a in merged.values())
    if finish:
        (acc,) = out
        if op.mean:  # as reference_reduce: the tree's sum divided in the dtype, +0.0 where that is zero
            acc = np.add(np.true_divide(acc, ranks), 0, dtype=acc.dtype)
        out = (acc,)
    return out if shape is None else output((out,), shape)


def _fold_exactly(op: Op, ranks: int, shape: tuple[int, ...] | None, inputs: Sequence[Pieces],
                  picks: Sequence[Sequence[Pick]], nodes: Sequence[Sequence[TreeNode]]) -> Pieces | np.ndarray:
    """:func:`reduce_ordered` of an exact op: every rank's own values (the
    reference tree's leaves), folded at once into a buffer of this task's."""
    leaves = {tree_leaf(ranks, r): r for r in range(ranks)}
    by_rank: dict[int, list[np.ndarray]] = {}
    for value, ps, ns in zip(inputs, picks, nodes):
        for (i, a, b), node in zip(ps, ns):
            if node not in leaves:
                raise RuntimeError("an exact sum folds every rank's own values at once, not partial sums")
            by_rank.setdefault(leaves[node], []).append(value[i][a:b])
    if sorted(by_rank) != list(range(ranks)):
        raise RuntimeError("an exact sum folds every rank's own values at once, not some of them")
    xs = [np.concatenate(v) if len(v) > 1 else v[0] for _, v in sorted(by_rank.items())]
    out = (tree_fold(op, ranks, xs, np.empty_like(xs[0])),)  # the exact fold, and mean's division
    return out if shape is None else output((out,), shape)


@functools.lru_cache(maxsize=64)
def tree_program(ranks: int) -> tuple[tuple[tuple[int, int, int], ...], int, int]:
    """The reference tree's additions for ``ranks`` ranks as instructions
    over slots (``0..ranks-1``: the ranks' values; from ``ranks`` on: scratch
    rows, reused once their partial sum is consumed): ``((dst, a, b), ...)``
    meaning ``slot[dst] = slot[a] op slot[b]``, the slot of the total, and the
    number of scratch rows. Depth first, so at most lg p + 1 rows: each
    node's value is its left plus its right child's whatever the order the
    nodes are computed in."""
    children: dict[TreeNode, tuple[TreeNode, TreeNode]] = {}

    def add(a: TreeNode, b: TreeNode) -> TreeNode:
        parent = tree_parent(ranks, a)
        children[parent] = (a, b)
        return parent

    leaves = {tree_leaf(ranks, r): r for r in range(ranks)}
    (root,) = tree_merge(ranks, {t: t for t in leaves}, add).values()
    program: list[tuple[int, int, int]] = []
    free: list[int] = []
    rows = 0

    def emit(node: TreeNode) -> int:
        nonlocal rows
        if node not in children:
            return leaves[node]
        a, b = (emit(c) for c in children[node])
        dst = a if a >= ranks else b if b >= ranks else -1
        if dst < 0:
            if not free:
                free.append(ranks + rows)
                rows += 1
            dst = free.pop()
        if b >= ranks and b != dst:
            free.append(b)
        program.append((dst, a, b))
        return dst

    total = emit(root)
    return tuple(program), total, rows


_SCRATCH = threading.local()


def _scratch(rows: int, step: int, dtype: np.dtype) -> np.ndarray:
    """``rows`` x ``step`` scratch elements of ``dtype``, kept per thread
    between calls (a few blocks: warm pages, not fresh ones every call)."""
    nbytes = rows * step * dtype.itemsize
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.nbytes < nbytes:
        buf = _SCRATCH.buf = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes].view(dtype).reshape(rows, step)


def tree_fold(op: Op, ranks: int, arrays: Sequence[Any], out: np.ndarray) -> np.ndarray:
    """Rank ``r``'s array ``arrays[r]`` combined over all ranks in the
    reference tree's order (``deterministic=True``: :func:`tree_program`)
    into ``out`` (a C-contiguous array of their size; it may be one of
    them), a cache-sized block at a time (:data:`~flowreduce.ops.FOLD_BLOCK_BYTES`),
    mean's division as :func:`flowreduce.reproducible.reference_reduce` does
    it. Each block's sum is the whole arrays' sum's: additions are
    elementwise. The partial sums go to a few scratch rows of a block,
    allocated once per call: a fresh temporary per addition would be fresh
    pages each time under Dask's MALLOC_TRIM_THRESHOLD_."""
    flat = out.reshape(-1)
    xs = [np.asarray(x).reshape(-1) for x in arrays]
    if op.exact:  # deterministic="exact": no order at all, the correctly rounded sum
        exact_fold(xs, flat)
        if op.mean:
            np.add(np.divide(flat, ranks, out=flat), 0, out=flat)
        return out
    program, total, nrows = tree_program(ranks)
    step = max(1, min(FOLD_BLOCK_BYTES // max(flat.dtype.itemsize, 1), flat.size))
    scratch = _scratch(nrows, step, flat.dtype) if op.in_place else None
    for lo in range(0, flat.size, step):
        slots: dict[int, Any] = {r: x[lo:lo + step] for r, x in enumerate(xs)}
        width = slots[0].size
        for dst, a, b in program:
            if scratch is not None:
                slots[dst] = op.combine(slots[a], slots[b], out=scratch[dst - ranks, :width])
            else:
                slots[dst] = np.asarray(op.combine(slots[a], slots[b]))
        block = flat[lo:lo + step]
        np.copyto(block, slots[total], casting="unsafe")
        if op.mean:
            np.add(np.divide(block, ranks, out=block), 0, out=block)
    return out


def gather(shape: tuple[int, ...] | None, inputs: Sequence[Pieces],
           picks: Sequence[Sequence[Pick]]) -> Pieces | np.ndarray:
    """Inputs side by side, without copying (a tuple of pieces)."""
    out = tuple(v[i][a:b] for v, p in zip(inputs, picks) for i, a, b in p)
    return out if shape is None else output((out,), shape)


def output(chunks: Sequence[Pieces], shape: tuple[int, ...]) -> np.ndarray:
    """The rank's result in the input's shape: one copy at most."""
    pieces = [a for c in chunks for a in c]
    if len(pieces) == 1:
        return pieces[0].reshape(shape)
    return np.concatenate(pieces).reshape(shape)
